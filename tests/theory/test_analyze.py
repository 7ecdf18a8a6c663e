"""``quickdraft analyze``: the pure per-position metrics and aggregation, plots, and a tiny-model run."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quickdraft.evaluation.analyze import METRICS, aggregate, collect, pick_positions, plot, position_metrics
from quickdraft.errors import QuickdraftError
from quickdraft.theory import optimal_acceptance


def test_position_metrics_on_a_tiny_pair():
    p = np.array([0.5, 0.2, 0.2, 0.1, 0.0])
    q = np.array([0.1, 0.4, 0.2, 0.2, 0.1])
    m = position_metrics(p, q, 3)
    assert set(m) == set(METRICS) and all(len(v) == 3 for v in m.values())
    one_minus_tv = 1 - 0.5 * np.abs(p - q).sum()  # 0.6
    for name in ("optimal_with_replacement", "optimal_without_replacement", "optimal_greedy", "rrs_with_replacement", "kseq_with_replacement"):
        assert m[name][0] == pytest.approx(one_minus_tv, abs=1e-12), name
    for n in range(3):
        assert m["optimal_without_replacement"][n] >= m["optimal_with_replacement"][n] - 1e-12
        assert m["rrs_with_replacement"][n] <= m["optimal_with_replacement"][n] + 1e-12
        assert m["kseq_with_replacement"][n] <= m["optimal_with_replacement"][n] + 1e-12
        assert m["rrs_greedy"][n] <= m["optimal_greedy"][n] + 1e-12
    assert m["optimal_greedy_verifier"] == pytest.approx(m["optimal_greedy"], abs=1e-12)
    # n = 3 greedy: G = {1, 2} (q = 0.4, 0.2; tie with token 3 goes to the lower id), p(G) = 0.4,
    # q' on {0, 3, 4} = (0.25, 0.5, 0.25): alpha* = 0.4 + 0.25 + 0.1 + 0 = 0.75
    assert m["optimal_greedy"][2] == pytest.approx(0.75, abs=1e-12)
    assert m["optimal_greedy"][2] == pytest.approx(optimal_acceptance(p, q, 3, "greedy"))


def test_aggregate_means_stderr_and_groups():
    recs = [
        {"temperature": 0.7, "dataset": "humaneval", "metrics": {"a": [0.5, 1.0]}},
        {"temperature": 0.7, "dataset": "mtbench", "metrics": {"a": [0.7, 0.6]}},
        {"temperature": 1.0, "dataset": "mtbench", "metrics": {"a": [0.2, 0.4]}},
    ]
    s = aggregate(recs)
    t07 = s["by_temperature"]["0.7"]
    assert t07["positions"] == 2
    assert t07["mean"]["a"] == pytest.approx([0.6, 0.8])
    # sample std / sqrt(2): |0.5 - 0.7| / sqrt(2) / sqrt(2) = 0.1
    assert t07["stderr"]["a"] == pytest.approx([0.1, 0.2])
    assert s["by_temperature"]["1.0"]["mean"]["a"] == pytest.approx([0.2, 0.4])
    assert s["by_temperature"]["1.0"]["stderr"]["a"] == [0.0, 0.0]  # one position
    assert set(s["by_temperature_dataset"]) == {"0.7/humaneval", "0.7/mtbench", "1.0/mtbench"}
    assert s["by_temperature_dataset"]["0.7/mtbench"]["mean"]["a"] == pytest.approx([0.7, 0.6])
    with pytest.raises(QuickdraftError, match="no positions"):
        aggregate([])


def test_pick_positions():
    assert pick_positions(32, 8) == [0, 4, 9, 13, 18, 22, 27, 31]
    assert pick_positions(3, 8) == [0, 1, 2]
    assert pick_positions(0, 8) == []


def test_aggregate_and_plot_on_synthetic_distributions(tmp_path):
    rng = np.random.default_rng(0)
    recs = []
    for i in range(6):
        p = rng.dirichlet(np.full(12, 0.3))
        q = 0.7 * p + 0.3 * rng.dirichlet(np.full(12, 0.3))
        recs.append({"temperature": 0.5 if i < 3 else 1.0, "dataset": "x", "metrics": position_metrics(p, q, 4)})
    s = aggregate(recs)
    mean = s["by_temperature"]["0.5"]["mean"]
    assert all(np.diff(mean["optimal_without_replacement"]) >= -1e-12)  # more drafts never hurt
    manual = np.mean([r["metrics"]["kseq_with_replacement"][3] for r in recs[:3]])
    assert mean["kseq_with_replacement"][3] == pytest.approx(manual)
    paths = plot(s, tmp_path)
    assert [p.name for p in paths] == ["acceptance.png", "gaps.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


class _StubTokenizer:
    eos_token_id = None
    chat_template = None
    all_special_tokens: list[str] = []

    def get_vocab(self):
        return {}

    def decode(self, tokens, skip_special_tokens=True):
        return " ".join(map(str, tokens))


class _Prompt:
    dataset, id, messages = "synthetic", "s/0", ({"role": "user", "content": "x"},)


def test_collect_end_to_end_on_tiny_models(tiny_target, tiny_draft):
    """Generation + one forward per model give per-position distributions that feed the theory."""
    from quickdraft.pipeline import Pipeline

    class TinyPipe(Pipeline):
        def encode_messages(self, messages):
            return [1, 5, 9, 3]

    pipe = TinyPipe(tiny_target, _StubTokenizer(), tiny_draft)
    samples = list(collect(pipe, [_Prompt()], 0.7, max_new_tokens=6, positions_per_prompt=3, seed=0))
    assert [s.index for s in samples] == [0, 2, 5]
    for s in samples:
        assert s.target_probs.shape == (pipe.vocab_size,) and math.isclose(s.target_probs.sum(), 1.0, abs_tol=1e-6)
        assert not np.allclose(s.target_probs, s.draft_probs)  # two different models
    m = position_metrics(samples[0].target_probs, samples[0].draft_probs, 2)
    assert 0.0 < m["optimal_without_replacement"][1] <= 1.0


def test_rrs_without_replacement_interval_in_metrics_and_summary(tmp_path):
    """The RRS-without-replacement interval brackets the exact recursion, and its width is aggregated."""
    from quickdraft.theory import verifier_acceptance

    rng = np.random.default_rng(3)
    recs = []
    for i in range(4):
        p = rng.dirichlet(np.full(7, 0.4))
        q = rng.dirichlet(np.full(7, 0.4))
        m = position_metrics(p, q, 4, rrs_wor_expansions=1, rrs_wor_children=1)  # a tiny budget: real intervals
        for n in range(1, 5):
            exact = verifier_acceptance(p, q, n, "without_replacement", "rrs")
            assert m["rrs_without_replacement_lower"][n - 1] - 1e-12 <= exact <= m["rrs_without_replacement_upper"][n - 1] + 1e-12
        recs.append({"temperature": 1.0, "dataset": "x", "metrics": m})
    s = aggregate(recs)["by_temperature"]["1.0"]
    widths = np.array([np.subtract(r["metrics"]["rrs_without_replacement_upper"], r["metrics"]["rrs_without_replacement_lower"]) for r in recs])
    assert s["rrs_wor_interval_width"]["mean"] == pytest.approx(widths.mean(axis=0).tolist())
    assert s["rrs_wor_interval_width"]["max"] == pytest.approx(widths.max(axis=0).tolist())
    assert max(s["rrs_wor_interval_width"]["max"]) > 0  # the tiny budget left something uncertain
    assert [p.name for p in plot(aggregate(recs), tmp_path)] == ["acceptance.png", "gaps.png"]


def test_analyze_command_end_to_end_on_tiny_models(tmp_path, monkeypatch, tiny_target, tiny_draft):
    """The whole command (prompt-outer loop, JSON, plots, time budget) with tiny models and stub prompts."""
    import json

    import quickdraft.evaluation.datasets as datasets
    from quickdraft.evaluation.analyze import analyze_command
    from quickdraft.pipeline import Pipeline

    class TinyPipe(Pipeline):
        def encode_messages(self, messages):
            return [1, 5, 9, 3]

    class P:
        def __init__(self, dataset, i):
            self.dataset, self.id, self.messages = dataset, f"{dataset}/{i}", ({"role": "user", "content": "x"},)

    monkeypatch.setattr(Pipeline, "from_specs", classmethod(lambda cls, t, d: TinyPipe(tiny_target, _StubTokenizer(), tiny_draft)))
    monkeypatch.setattr(datasets, "load_humaneval", lambda limit: [P("humaneval", i) for i in range(limit)])
    monkeypatch.setattr(datasets, "load_mtbench", lambda limit: [P("mtbench", i) for i in range(limit)])
    analyze_command(limit=2, max_new_tokens=5, positions_per_prompt=2, out=tmp_path / "a", max_drafts=3,
                    temperatures="0.7,1.0", rrs_wor_expansions=4, rrs_wor_children=2)
    res = json.loads((tmp_path / "a" / "analyze.json").read_text())
    assert res["complete"] and res["config"]["prompts_done"] == 4
    assert len(res["positions"]) == 4 * 2 * 2  # prompts x temperatures x positions
    assert [r["prompt_id"] for r in res["positions"][::4]] == ["humaneval/0", "mtbench/0", "humaneval/1", "mtbench/1"]
    s = res["summary"]["by_temperature"]["0.7"]
    assert s["positions"] == 8 and len(s["rrs_wor_interval_width"]["max"]) == 3
    assert all(lo <= hi + 1e-12 for lo, hi in zip(s["mean"]["rrs_without_replacement_lower"], s["mean"]["rrs_without_replacement_upper"]))
    assert (tmp_path / "a" / "gaps.png").stat().st_size > 10_000
    # a budget that the first prompt already uses up: one prompt, marked incomplete
    analyze_command(limit=2, max_new_tokens=5, positions_per_prompt=2, out=tmp_path / "b", max_drafts=2,
                    temperatures="1.0", time_budget=1e-6)
    res = json.loads((tmp_path / "b" / "analyze.json").read_text())
    assert not res["complete"] and res["config"]["prompts_done"] == 1 and len(res["positions"]) == 2
