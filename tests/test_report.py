"""Reports from a small synthetic result set: summary arithmetic, paired tests, tables, plots, README."""

from __future__ import annotations

import csv
import json

import pytest

from quickdraft.evaluation.bench import _write_json, cell_path
from quickdraft.evaluation.quality import compare_paired, compare_paired_means, pass_at_1
from quickdraft.evaluation.report import (
    README_END,
    README_START,
    markdown_table,
    summarize,
    update_readme,
    write_reports,
)

N = 10
# method label -> (name, params, kind, passes per prompt, new tokens per prompt, decode seconds per prompt)
METHODS = {
    "ar": ("ar", {}, "method", [True] * 6 + [False] * 4, 20, 4.0),
    "sd:k=4": ("sd", {"k": 4}, "method", [True] * 6 + [False] * 4, 20, 2.0),
    "fsd:divergence=js,threshold=0.2": ("fsd", {"divergence": "js", "threshold": 0.2}, "method",
                                        [True] * 6 + [False] * 4, 20, 1.6),
    "fsd:divergence=js,threshold=0.8": ("fsd", {"divergence": "js", "threshold": 0.8}, "method",
                                        [True] * 3 + [False] * 7, 20, 1.0),
    "fsd:hybrid=true": ("fsd", {"hybrid": True}, "method", [True] * 6 + [False] * 4, 20, 1.9),
    "typical": ("typical", {}, "method", [True] * 5 + [False] * 5, 20, 1.5),
    "sd:k=2": ("sd", {"k": 2}, "method", [True] * 6 + [False] * 4, 20, 2.5),
    "hf-ar": ("hf-ar", {}, "anchor", [True] * 6 + [False] * 4, 20, None),
}


def _record(label: str, i: int, temperature: float = 0.0) -> dict:
    name, params, kind, passes, new, decode = METHODS[label]
    tokens = list(range(new)) if label in ("ar", "sd:k=4", "hf-ar") or i < 5 else [99] + list(range(new - 1))
    rec = {
        "schema": 1, "method": label, "name": name, "params": params, "kind": kind,
        "lossless": name in ("ar", "sd", "hf-ar"), "prompt_id": f"P/{i}", "prompt_index": i, "dataset": "humaneval",
        "temperature": temperature, "seed": i, "max_new_tokens": 32, "prompt_tokens": 5, "run_index": i * 10,
        "token_ids": tokens, "text": "", "new_tokens": new, "seconds": (decode or 3.0) + 0.5,
        "decode_seconds": decode, "prefill_seconds": 0.5 if decode else None,
        "quality": {"extraction": "fence/function", "parsed": i != 9, "passed": passes[i]},
        "fidelity": {"target_mean_logprob": -0.5, "target_logprob_sum": -0.5 * new, "scored_tokens": new},
        "metrics": None,
    }
    if kind == "method" and name != "ar":
        # 5 steps: positions 1..4 reached 5, 4, 3, 2 times; accepted 4, 3, 2, 1 times
        rec["metrics"] = {
            "steps": 5, "emitted_tokens": 15, "accepted_tokens": 10, "drafted_tokens": 20,
            "lossy_accepted_tokens": 4 if name in ("fsd", "typical") else 0, "target_forwards": 6, "draft_forwards": 20,
            "position_reached": [5, 4, 3, 2], "position_accepted": [4, 3, 2, 1],
        }
    elif name == "ar":
        rec["metrics"] = {"steps": 20, "emitted_tokens": 20, "accepted_tokens": 0, "drafted_tokens": 0,
                          "lossy_accepted_tokens": 0, "target_forwards": 21, "draft_forwards": 0,
                          "position_reached": [], "position_accepted": []}
    return rec


@pytest.fixture
def records():
    return [_record(label, i) for i in range(N) for label in METHODS]


def test_summary_arithmetic(records):
    rows = {r["method"]: r for r in summarize(records, baseline="sd:k=4", method_order=list(METHODS))}
    assert list(rows) == list(METHODS)
    ar, sd = rows["ar"], rows["sd:k=4"]
    assert ar["decode_tps"] == pytest.approx(N * 20 / (N * 4.0))
    assert ar["e2e_tps"] == pytest.approx(N * 20 / (N * 4.5))
    assert sd["speedup_decode"] == pytest.approx(2.0)
    assert rows["hf-ar"]["decode_tps"] is None and rows["hf-ar"]["speedup_e2e"] == pytest.approx(4.5 / 3.5)
    assert sd["mean_acceptance_length"] == pytest.approx(3.0)
    assert sd["acceptance_rate"] == pytest.approx(0.5)
    assert sd["acceptance_by_position"] == pytest.approx([0.8, 0.75, 2 / 3, 0.5])
    assert rows["typical"]["lossy_share"] == pytest.approx(4 / 15) and sd["lossy_share"] == 0


def test_pass_rates_and_paired_tests_match_quality_module(records):
    rows = {r["method"]: r for r in summarize(records, baseline="sd:k=4")}
    fsd = rows["fsd:divergence=js,threshold=0.8"]
    passes = METHODS["fsd:divergence=js,threshold=0.8"][3]
    expected = pass_at_1(passes)
    assert (fsd["passed"], fsd["pass_at_1"]) == (3, 0.3)
    assert (fsd["pass_low"], fsd["pass_high"]) == pytest.approx((expected.low, expected.high))
    cmp = compare_paired(passes, METHODS["sd:k=4"][3])
    assert fsd["vs_baseline_difference"] == pytest.approx(-0.3)
    assert (fsd["vs_baseline_only_method"], fsd["vs_baseline_only_baseline"]) == (0, 3)
    assert fsd["vs_baseline_p"] == pytest.approx(cmp.p_value) and fsd["vs_baseline_p"] == pytest.approx(0.25)
    assert rows["sd:k=4"]["vs_baseline_p"] is None  # the baseline is not compared with itself
    assert fsd["unparseable"] == 1
    # agreement with target-alone greedy output: prompts 0-4 identical, 5-9 differ at the first token
    assert fsd["agree_exact"] == pytest.approx(0.5) and fsd["agree_prefix"] == pytest.approx(0.5)
    assert rows["sd:k=4"]["agree_exact"] == 1.0


def test_logprob_paired_with_baseline(records):
    # FSD at 0.8 loses 0.1 nats a token against sd on every prompt, with a spread across prompts
    for rec in records:
        if rec["method"] == "fsd:divergence=js,threshold=0.8":
            i = rec["prompt_index"]
            lp = -0.6 + 0.01 * (i % 3)
            rec["fidelity"] = {"target_mean_logprob": lp, "target_logprob_sum": lp * rec["new_tokens"],
                               "scored_tokens": rec["new_tokens"]}
    rows = {r["method"]: r for r in summarize(records, baseline="sd:k=4")}
    fsd = rows["fsd:divergence=js,threshold=0.8"]
    cmp = compare_paired_means({f"P/{i}": -0.6 + 0.01 * (i % 3) for i in range(N)}, {f"P/{i}": -0.5 for i in range(N)})
    assert fsd["vs_baseline_logprob_difference"] == pytest.approx(cmp.difference)
    assert fsd["vs_baseline_logprob_high"] < 0 and fsd["vs_baseline_logprob_p"] < 1e-6
    assert (fsd["vs_baseline_logprob_low"], fsd["vs_baseline_logprob_high"]) == pytest.approx((cmp.low, cmp.high))
    assert rows["sd:k=4"]["vs_baseline_logprob_difference"] is None
    assert rows["typical"]["vs_baseline_logprob_difference"] == 0.0  # same scores: no difference
    assert "Δ logprob vs baseline" in markdown_table(list(rows.values()))


def test_rows_use_complete_cases_only(records):
    kept = [r for r in records if not (r["method"] == "typical" and r["prompt_id"] == "P/0")]
    rows = summarize(kept, baseline="sd:k=4")
    assert {r["prompts"] for r in rows} == {N - 1}
    # without `ar`, the lossless baseline is the greedy reference
    no_ar = {r["method"]: r for r in summarize([r for r in records if r["method"] != "ar"], baseline="sd:k=4")}
    assert no_ar["fsd:divergence=js,threshold=0.8"]["agree_exact"] == pytest.approx(0.5)
    # no temperature-0 agreement at other temperatures
    hot = summarize([_record("ar", i, 0.7) for i in range(3)] + [_record("sd:k=4", i, 0.7) for i in range(3)])
    assert all(r["agree_exact"] is None for r in hot)


def test_markdown_table(records):
    rows = summarize(records, baseline="sd:k=4")
    table = markdown_table(rows)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + len(rows)
    assert "pass@1 [95% CI]" in lines[0] and "Δ vs baseline" in lines[0]
    assert "3/10 = 30%" in table and "-30 pt (+0/−3, p=0.25)" in table
    # columns that are empty for every row are dropped
    slim = markdown_table(summarize([_record("hf-ar", i) for i in range(2)]))
    assert "acc. length" not in slim and "tok/s e2e" in slim


def _write_run(run_dir, records, title="Synthetic run"):
    for rec in records:
        _write_json(cell_path(run_dir, rec["temperature"], rec["method"], rec["prompt_id"]), rec)
    _write_json(run_dir / "run.json", {
        "title": title, "description": "A synthetic run.", "config": {
            "dataset": "humaneval", "max_new_tokens": 32, "temperatures": [0.0], "seed": 0, "baseline": "sd:k=4"},
        "models": {"target": "t", "draft": "d", "dtype": "auto"}, "prompts": [f"P/{i}" for i in range(N)],
        "entries": list(METHODS),
        "sessions": [{"command": "quickdraft bench --out Y", "model_load_seconds": 0.5, "skipped": []},
                     {"command": "quickdraft bench --out X", "model_load_seconds": 1.5, "finished": "now",
                      "machine": {"cores": 2, "load_average_at_start": [3.0, 2.0, 1.0]}, "skipped": []}],
    })


def test_write_reports_and_readme(records, tmp_path):
    run_dir = tmp_path / "results" / "run1"
    _write_run(run_dir, records)
    summary = write_reports(run_dir)
    assert set(summary["plots"]) == {"tradeoff.png", "acceptance_by_position.png", "speedup_vs_k.png"}
    # without a second draft length there is no speed-up-vs-K curve to draw
    single_k = tmp_path / "results" / "run0"
    _write_run(single_k, [r for r in records if r["method"] != "sd:k=2"])
    assert "speedup_vs_k.png" not in write_reports(single_k)["plots"]
    for plot in summary["plots"]:
        assert (run_dir / "plots" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(run_dir / "summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(METHODS) and rows[1]["method"] == "sd:k=4"
    assert float(rows[1]["speedup_decode"]) == pytest.approx(2.0)
    assert json.loads((run_dir / "summary.json").read_text())["rows"][0]["method"] == "ar"

    (run_dir / "NOTES.md").write_text("FSD at T=0.8 loses 3 problems.\n")
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nIntro.\n")
    update_readme(readme, [run_dir])
    text = readme.read_text()
    assert "speedup_vs_k" in text and "FSD at T=0.8 loses 3 problems." in text
    assert text.startswith("# Project\n\nIntro.\n") and text.count(README_START) == 1
    assert "### Synthetic run" in text and "quickdraft bench --out X\n" in text
    assert "quickdraft bench --out Y   # interrupted" in text
    assert "![tradeoff](results/run1/plots/tradeoff.png)" in text
    # regenerating replaces the section and keeps what follows the end marker
    readme.write_text(text + "\nTail.\n")
    update_readme(readme, [run_dir])
    again = readme.read_text()
    assert again.count(README_START) == 1 and again.count(README_END) == 1 and again.endswith("Tail.\n")
    assert again.count("### Synthetic run") == 1


def test_tradeoff_without_pass_rates_uses_the_paired_logprob(records, tmp_path):
    from quickdraft.evaluation.report import _quality_points

    for rec in records:  # prose: no pass/fail, the target's log-likelihood differs by method
        rec.pop("quality")
        i = rec["prompt_index"]
        lp = -0.5 - 0.01 * (i % 3) - ((0.09 + 0.02 * (i % 2)) if rec["name"] == "fsd" else 0.0)
        rec["fidelity"] = {"target_mean_logprob": lp, "target_logprob_sum": lp * rec["new_tokens"],
                           "scored_tokens": rec["new_tokens"]}
    rows = summarize(records, baseline="sd:k=4")
    points, label = _quality_points(rows)
    by_method = {r["method"]: (y, lo, hi) for r, y, lo, hi in points}
    assert by_method["sd:k=4"] == (0.0, 0.0, 0.0) and "sd:k=4" in label and "log-likelihood" in label
    y, lo, hi = by_method["fsd:divergence=js,threshold=0.8"]
    assert y == pytest.approx(-0.1) and lo < y < hi < 0
    assert "hf-ar" in by_method  # an anchor's output is scored too
    run_dir = tmp_path / "prose"
    _write_run(run_dir, records)
    assert "tradeoff.png" in write_reports(run_dir)["plots"]
    # neither pass rates nor a baseline to pair with: no trade-off plot
    assert _quality_points(summarize(records)) is None


def test_plot_adaptive_draws_fixed_k_against_the_policies(tmp_path):
    from quickdraft.evaluation.report import plot_adaptive

    summary = {"humaneval@T=0.0": {"fixed_k1": {"tokens_per_s": 4.0}, "fixed_k2": {"tokens_per_s": 5.0},
                                   "specdecpp_h0.5": {"tokens_per_s": 5.5}, "heuristic": {"tokens_per_s": 4.5}}}
    path = tmp_path / "adaptive.png"
    assert plot_adaptive(summary, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot_adaptive({"mtbench@T=0.0": {"heuristic": {"tokens_per_s": 3.0}}}, tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_speedups_carry_a_paired_interval_over_the_prompts(records):
    """× ar has the paired bootstrap interval of rate_ratio over the complete cases: a point where
    every prompt has the same ratio, a proper interval around the point where they differ, none
    under 10 prompts and none on the ar row itself; the table prints it beside the ratio."""
    from quickdraft.evaluation.rates import rate_ratio

    rows = {r["method"]: r for r in summarize(records)}
    sd = rows["sd:k=4"]
    assert sd["speedup_decode_low"] == pytest.approx(2.0) and sd["speedup_decode_high"] == pytest.approx(2.0)
    assert rows["ar"]["speedup_e2e_low"] is None and rows["hf-ar"]["speedup_decode_low"] is None
    assert rows["hf-ar"]["speedup_e2e_low"] == pytest.approx(4.5 / 3.5)  # anchors: e2e only
    jitter = [1.3, 2.9, 1.7, 2.2, 1.1, 2.6, 1.9, 2.4, 1.5, 2.0]
    noisy = [dict(r, decode_seconds=jitter[r["prompt_index"]], seconds=jitter[r["prompt_index"]] + 0.5)
             if r["method"] == "sd:k=4" else r for r in records]
    sd = {r["method"]: r for r in summarize(noisy)}["sd:k=4"]
    expected = rate_ratio([20] * N, [j + 0.5 for j in jitter], [20] * N, [4.5] * N)
    assert sd["speedup_e2e"] == pytest.approx(expected.ratio)
    assert (sd["speedup_e2e_low"], sd["speedup_e2e_high"]) == pytest.approx((expected.low, expected.high))
    assert sd["speedup_e2e_low"] < sd["speedup_e2e"] < sd["speedup_e2e_high"]
    assert f"| {sd['speedup_e2e']:.2f} [{sd['speedup_e2e_low']:.2f}, {sd['speedup_e2e_high']:.2f}] |" in markdown_table([sd])
    few = {r["method"]: r for r in summarize([r for r in noisy if r["prompt_index"] < 9])}["sd:k=4"]
    assert few["speedup_e2e"] is not None and few["speedup_e2e_low"] is None
