"""quickdraft.evaluation.rates: the ratio of two configurations' rates over the same prompts and its
paired bootstrap interval (coverage on simulated runs, and a real difference it must detect)."""

from __future__ import annotations

import doctest

import numpy as np
import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.evaluation import rates
from quickdraft.evaluation.rates import rate_ratio

from conftest import load_script


def test_doctests():
    assert doctest.testmod(rates).failed == 0


def _simulated(rng, n, true_ratio, spread=0.06):
    """n prompts of different lengths and difficulty (shared by both configurations), each run's time
    multiplied by its own machine noise of about ``spread``; A is ``true_ratio`` times as fast."""
    tokens = rng.integers(60, 129, n).astype(float)
    base = tokens / rng.uniform(5, 15, n)  # seconds of B: prompts differ 3x in rate
    seconds_b = base * rng.lognormal(0, spread, n)
    seconds_a = base / true_ratio * rng.lognormal(0, spread, n)
    return tokens, seconds_a, tokens, seconds_b


def test_ratio_is_the_ratio_of_summed_rates():
    r = rate_ratio([100, 10], [10, 10], [100, 10], [20, 5])
    assert r.ratio == pytest.approx((110 / 20) / (110 / 25))
    assert np.isnan(r.low) and np.isnan(r.high) and r.prompts == 2  # too few prompts for an interval
    assert "2 prompts" in str(r)
    rng = np.random.default_rng(0)
    assert np.isnan(rate_ratio(*_simulated(rng, 9, 1.0)).low)  # under MIN_PROMPTS: none (it would undercover)
    assert not np.isnan(rate_ratio(*_simulated(rng, 10, 1.0)).low)


def test_interval_covers_the_true_ratio_about_as_often_as_it_says():
    """200 simulated runs of 20 prompts at a true ratio of 1: the 95% interval holds 1 in at least
    88% of them (a binomial 95% band around 0.95 for 200 runs reaches down to ~0.92)."""
    rng = np.random.default_rng(1)
    covered = 0
    for i in range(200):
        r = rate_ratio(*_simulated(rng, 20, 1.0), resamples=999, seed=i)
        assert r.low <= r.ratio <= r.high
        covered += r.low <= 1.0 <= r.high
    assert covered >= 176, covered


def test_a_real_difference_is_detected():
    """Negative control: A 8% slower than B on 20 prompts with 6% noise per run; the interval must
    exclude 1 in most runs (a check that could not fail would hold 1 every time)."""
    rng = np.random.default_rng(2)
    excluded = sum(rate_ratio(*_simulated(rng, 20, 0.92), resamples=999, seed=i).high < 1.0 for i in range(50))
    assert excluded >= 40, excluded


def test_pairing_removes_the_variance_between_prompts():
    """Prompts that differ 3x in rate but where A is exactly 0.95x B on each: the interval is the point,
    while resampling the two configurations' prompts independently would spread it widely."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(60, 129, 20).astype(float)
    seconds_b = tokens / rng.uniform(5, 15, 20)
    r = rate_ratio(tokens, seconds_b / 0.95, tokens, seconds_b)
    assert r.ratio == pytest.approx(0.95) and r.low == pytest.approx(0.95) and r.high == pytest.approx(0.95)


@pytest.mark.parametrize("args, match", [
    (([1, 2], [1, 1], [1], [1]), "one value per prompt"),
    (([], [], [], []), "no prompts"),
    (([1, 2, 3], [1, 0, 1], [1, 2, 3], [1, 1, 1]), "seconds finite and > 0"),
    (([1, 2, 3], [1, 1, 1], [1, 2, float("nan")], [1, 1, 1]), "finite"),
    (([1, 2, 3], [1, 1, 1], [0, 0, 0], [1, 1, 1]), "made no tokens"),
])
def test_bad_input_is_named(args, match):
    with pytest.raises(QuickdraftError, match=match):
        rate_ratio(*args)


def test_bad_confidence_is_named():
    with pytest.raises(QuickdraftError, match="confidence"):
        rate_ratio([1, 2, 3], [1, 1, 1], [1, 2, 3], [1, 1, 1], confidence=95)


@pytest.fixture(scope="module")
def bench_perf():
    return load_script("benchmarks/bench_perf.py")


def test_bench_perf_summary_gives_each_anchor_ratio_its_interval(bench_perf):
    """The benchmark's summary: x_<GenAI sd> and x_llamacpp_anchor with their paired intervals, over the
    prompts both completed (a prompt one config failed on is left out of that pair)."""
    rng = np.random.default_rng(4)
    tokens, sa, _, sb = _simulated(rng, 12, 0.9)
    rows = []
    for i in range(12):
        p = f"HumanEval/{i}"
        rows.append(dict(config="llamacpp-anchor", prompt=p, dataset="humaneval", temperature=0.0, new_tokens=tokens[i], seconds=sb[i] / 2))
        rows.append(dict(config="ovgenai-int8-sd", prompt=p, dataset="humaneval", temperature=0.0, new_tokens=tokens[i], seconds=sb[i]))
        rows.append(dict(config="openvino-int8/int8-sd", prompt=p, dataset="humaneval", temperature=0.0, new_tokens=tokens[i], seconds=sa[i]))
    rows[-1] = dict(rows[-1], error="boom")  # ours failed on the last prompt
    configs = ["llamacpp-anchor", "ovgenai-int8-sd", "openvino-int8/int8-sd"]
    summary = bench_perf.summarize(rows, configs, [0.0])
    ours = summary["openvino-int8/int8-sd@T=0.0"]
    expect = rate_ratio(tokens[:11], sa[:11], tokens[:11], sb[:11])  # the 11 prompts both completed
    # the point ratio stays each config's rate over its own prompts, as in every committed summary
    assert ours["x_ovgenai-int8-sd"] == pytest.approx((tokens[:11].sum() / sa[:11].sum()) / (tokens.sum() / sb.sum()))
    assert ours["ci95_x_ovgenai-int8-sd"] == pytest.approx([expect.low, expect.high])
    # ... and the interval's own point and prompt count sit beside it
    assert ours["paired_x_ovgenai-int8-sd"] == pytest.approx(expect.ratio)
    assert ours["paired_prompts_x_ovgenai-int8-sd"] == 11
    assert ours["paired_x_ovgenai-int8-sd"] != pytest.approx(ours["x_ovgenai-int8-sd"])
    # where both completed every prompt, the point ratio is the interval's own: nothing to add
    assert "paired_x_ovgenai-int8-sd" not in summary["llamacpp-anchor@T=0.0"]
    assert "paired_x_llamacpp_anchor" not in summary["ovgenai-int8-sd@T=0.0"]
    # the anchor failed on one prompt and ours on another: the interval and its point cover the 10 both
    # completed, on both sides of the pair
    rows[4 * 3 + 1] = dict(rows[4 * 3 + 1], error="boom")  # GenAI on HumanEval/4
    summary = bench_perf.summarize(rows, configs, [0.0])
    ours = summary["openvino-int8/int8-sd@T=0.0"]
    both = [i for i in range(12) if i not in (4, 11)]
    expect = rate_ratio(tokens[both], sa[both], tokens[both], sb[both])
    assert ours["paired_prompts_x_ovgenai-int8-sd"] == 10
    assert ours["paired_x_ovgenai-int8-sd"] == pytest.approx(expect.ratio)
    assert ours["ci95_x_ovgenai-int8-sd"] == pytest.approx([expect.low, expect.high])
    assert summary["llamacpp-anchor@T=0.0"]["paired_prompts_x_ovgenai-int8-sd"] == 11
    assert ours["ci95_x_llamacpp_anchor"][1] < 1.0  # half the anchor's rate: far below 1
    assert "ci95_x_llamacpp_anchor" not in summary["llamacpp-anchor@T=0.0"]
    assert "ci95_x_ovgenai-int8-sd" not in summary["ovgenai-int8-sd@T=0.0"]


def test_bench_perf_summary_survives_an_anchor_that_failed_everywhere(bench_perf):
    """GenAI raising on every prompt leaves its ratio and interval undefined (NaN), not a crash at the
    end of a long run."""
    rows = []
    for i in range(12):
        p = f"HumanEval/{i}"
        rows.append(dict(config="ovgenai-int8-sd", prompt=p, dataset="humaneval", temperature=0.7, error="raised"))
        rows.append(dict(config="openvino-int8/int8-sd", prompt=p, dataset="humaneval", temperature=0.7,
                         new_tokens=100, seconds=10.0))
    summary = bench_perf.summarize(rows, ["ovgenai-int8-sd", "openvino-int8/int8-sd"], [0.7])
    ours = summary["openvino-int8/int8-sd@T=0.7"]
    assert ours["tokens_per_second"] == pytest.approx(10.0)
    assert all(np.isnan(v) for v in ours["ci95_x_ovgenai-int8-sd"])
    assert summary["ovgenai-int8-sd@T=0.7"]["errors"] == 12
