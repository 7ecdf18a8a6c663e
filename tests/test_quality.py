"""pass@1 intervals, the paired McNemar test and the paired t interval against values computed by hand /
from tables, and the intervals' coverage by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from quickdraft.errors import QuickdraftError
from quickdraft.evaluation.quality import (
    clopper_pearson_interval,
    compare_paired,
    compare_paired_means,
    pass_at_1,
    wilson_interval,
)


@pytest.mark.parametrize(
    ("passed", "total", "low", "high"),
    [
        (0, 10, 0.0, 0.277532),  # upper = z^2 / (n + z^2)
        (5, 10, 0.236593, 0.763407),
        (164, 164, 164 / (164 + 1.959964**2), 1.0),  # lower = n / (n + z^2)
        (81, 263, 0.2553, 0.3662),  # Newcombe, Stat. Med. 17 (1998) 857, Table II, 81/263, method 3
    ],
)
def test_wilson_interval_known_values(passed, total, low, high):
    got = wilson_interval(passed, total, 0.95)
    assert got == pytest.approx((low, high), abs=6e-5)


@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_wilson_matches_scipy(confidence):
    for passed, total in [(0, 1), (1, 7), (40, 164), (163, 164)]:
        ci = stats.binomtest(passed, total).proportion_ci(confidence_level=confidence, method="wilson")
        assert wilson_interval(passed, total, confidence) == pytest.approx((ci.low, ci.high), abs=1e-12)


@pytest.mark.parametrize(
    ("passed", "total", "low", "high"),
    [
        (0, 10, 0.0, 1 - 0.025 ** (1 / 10)),  # closed form at k = 0
        (10, 10, 0.025 ** (1 / 10), 1.0),  # closed form at k = n
        (5, 10, 0.187086, 0.812914),
    ],
)
def test_clopper_pearson_known_values(passed, total, low, high):
    assert clopper_pearson_interval(passed, total, 0.95) == pytest.approx((low, high), abs=2e-6)


def test_clopper_pearson_is_wider_than_wilson_and_both_contain_the_estimate():
    for k in (1, 40, 82, 120, 163):
        w_low, w_high = wilson_interval(k, 164)
        e_low, e_high = clopper_pearson_interval(k, 164)
        assert e_high - e_low > w_high - w_low  # the exact interval is conservative
        assert w_low < k / 164 < w_high and e_low < k / 164 < e_high


def test_wilson_coverage_is_near_nominal_and_wald_like_control_is_not():
    # Seeded simulation: true rate 0.1, n = 30. Wilson's coverage stays within a few points of 95 %;
    # the Wald interval (negative control) is known to under-cover badly here.
    rng = np.random.default_rng(0)
    n, rate, trials = 30, 0.1, 4000
    ks = rng.binomial(n, rate, size=trials)
    z = stats.norm.ppf(0.975)
    wilson_hits = np.mean([lo <= rate <= hi for lo, hi in (wilson_interval(int(k), n) for k in ks)])
    wald = [(k / n - z * math.sqrt(k / n * (1 - k / n) / n), k / n + z * math.sqrt(k / n * (1 - k / n) / n)) for k in ks]
    wald_hits = np.mean([lo <= rate <= hi for lo, hi in wald])
    assert 0.92 <= wilson_hits <= 0.99
    assert wald_hits < 0.92


def test_pass_at_1_from_sequence_and_mapping():
    rate = pass_at_1([True, False, True, True])
    assert (rate.passed, rate.total, rate.rate, rate.method) == (3, 4, 0.75, "wilson")
    assert (rate.low, rate.high) == pytest.approx(wilson_interval(3, 4))
    exact = pass_at_1({"a": True, "b": False}, confidence=0.9, method="exact")
    assert (exact.low, exact.high) == pytest.approx(clopper_pearson_interval(1, 2, 0.9))
    assert str(pass_at_1([True] * 3 + [False])) == "75.0% (3/4; 95% CI 30.1–95.4)"


def test_mcnemar_exact_known_values():
    # 9 discordant pairs favour A, 1 favours B: p = 2 * P(X <= 1), X ~ Bin(10, 1/2) = 2 * 11 / 1024.
    a = [True] * 9 + [False] + [True] * 20 + [False] * 5
    b = [False] * 9 + [True] + [True] * 20 + [False] * 5
    cmp = compare_paired(a, b)
    assert (cmp.total, cmp.both, cmp.only_a, cmp.only_b, cmp.neither) == (35, 20, 9, 1, 5)
    assert cmp.p_value == pytest.approx(22 / 1024)
    assert cmp.rate_a == pytest.approx(29 / 35) and cmp.rate_b == pytest.approx(21 / 35)
    assert cmp.difference == pytest.approx(8 / 35)


def test_mcnemar_symmetric_and_no_discordance():
    balanced = compare_paired([True, False] * 5, [False, True] * 5)
    assert balanced.p_value == pytest.approx(1.0) and balanced.difference == 0
    same = compare_paired([True, False, True], [True, False, True])
    assert same.p_value == 1.0 and same.only_a == same.only_b == 0
    # 6 vs 0 discordant: p = 2 / 64.
    assert compare_paired([True] * 6, [False] * 6).p_value == pytest.approx(2 / 64)


def test_paired_mappings_align_by_id_and_reject_mismatches():
    a = {"HumanEval/0": True, "HumanEval/1": False}
    b = {"HumanEval/1": True, "HumanEval/0": True}
    cmp = compare_paired(a, b)
    assert (cmp.both, cmp.only_a, cmp.only_b) == (1, 0, 1)
    with pytest.raises(QuickdraftError, match="same problems"):
        compare_paired(a, {"HumanEval/0": True})
    with pytest.raises(QuickdraftError, match="equal lengths"):
        compare_paired([True], [True, False])


def test_bad_input_is_rejected():
    with pytest.raises(QuickdraftError):
        pass_at_1([])
    with pytest.raises(QuickdraftError):
        wilson_interval(5, 4)
    with pytest.raises(QuickdraftError):
        pass_at_1([True], confidence=1.0)
    with pytest.raises(QuickdraftError):
        pass_at_1([True], method="wald")


def test_paired_means_known_values():
    # differences 1, 2, 3, 4, 5 - 3 (A - B by id): mean 0.6, sd from the hand formula, t quantile from scipy
    a = {"p0": 1.0, "p1": 2.0, "p2": 3.0, "p3": 4.0, "p4": 5.0}
    b = {"p0": 0.0, "p1": 1.0, "p2": 3.0, "p3": 2.0, "p4": 5.0}
    d = [1.0, 1.0, 0.0, 2.0, 0.0]
    mean = sum(d) / 5
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 4)
    half = stats.t.ppf(0.975, 4) * sd / math.sqrt(5)
    cmp = compare_paired_means(a, b)
    assert (cmp.total, cmp.difference, cmp.mean_a, cmp.mean_b) == (5, pytest.approx(0.8), 3.0, 2.2)
    assert (cmp.low, cmp.high) == pytest.approx((mean - half, mean + half))
    t_stat = mean / (sd / math.sqrt(5))
    assert cmp.p_value == pytest.approx(2 * stats.t.sf(t_stat, 4))
    # no spread: a degenerate interval, not NaN
    same = compare_paired_means({"x": -1.0, "y": -2.0}, {"x": -1.0, "y": -2.0})
    assert (same.difference, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)


def test_paired_means_interval_covers_and_pairing_narrows_it():
    # per-problem scores vary far more between problems (sd 0.5) than between methods on one problem
    # (sd 0.05): the paired interval keeps ~95 % coverage and is much narrower than Welch's unpaired one
    rng = np.random.default_rng(3)
    true_diff, n, trials = -0.03, 40, 2000
    hits, ratio = 0, []
    for _ in range(trials):
        problem = rng.normal(-1.0, 0.5, size=n)
        b = problem + rng.normal(0, 0.05, size=n)
        a = problem + true_diff + rng.normal(0, 0.05, size=n)
        cmp = compare_paired_means({str(i): a[i] for i in range(n)}, {str(i): b[i] for i in range(n)})
        hits += cmp.low <= true_diff <= cmp.high
        welch = stats.ttest_ind(a, b, equal_var=False).confidence_interval()
        ratio.append((cmp.high - cmp.low) / (welch.high - welch.low))
    assert 0.93 <= hits / trials <= 0.97
    assert np.median(ratio) < 0.2


def test_paired_means_reject_bad_input():
    with pytest.raises(QuickdraftError, match="same problems"):
        compare_paired_means({"a": 1.0, "b": 2.0}, {"a": 1.0, "c": 2.0})
    with pytest.raises(QuickdraftError, match="at least 2"):
        compare_paired_means({"a": 1.0}, {"a": 2.0})
    with pytest.raises(QuickdraftError, match="finite"):
        compare_paired_means({"a": 1.0, "b": float("nan")}, {"a": 1.0, "b": 2.0})
    with pytest.raises(QuickdraftError, match="confidence"):
        compare_paired_means({"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}, confidence=0.0)
