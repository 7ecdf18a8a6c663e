"""benchmarks/studies/speedup_ceiling.py: the bound m · c_ref(1) / c(m) and the tokens a step a goal needs."""

from __future__ import annotations

import doctest
import json
import sys

import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("benchmarks/studies/speedup_ceiling.py")


def test_doctests(study):
    assert doctest.testmod(study).failed == 0


def test_the_table_of_a_results_file(study, tmp_path, monkeypatch, capsys):
    """Two targets against llama.cpp's one-token forward: the ceilings, the tokens a step 2x needs
    with free drafts and with the draft model, and the highest ceiling."""
    results = tmp_path / "perf.json"
    results.write_text(json.dumps({"machine": {"cpu_model": "test"}, "forward_seconds": {
        "llamacpp/target/m=1": 0.05, "llamacpp/target/m=5": 0.2, "llamacpp/draft/m=1": 0.02,
        "openvino-int8/target/m=1": 0.1, "openvino-int8/target/m=5": 0.125,
    }}))
    out = tmp_path / "ceiling.json"
    monkeypatch.setattr(sys, "argv", ["speedup_ceiling.py", str(results), "--goal", "2", "--out", str(out)])
    study.main()
    table = json.loads(out.read_text())
    assert table["ceiling"]["llamacpp"] == {"1": 1.0, "5": pytest.approx(1.25)}
    assert table["ceiling"]["openvino-int8"] == {"1": 0.5, "5": pytest.approx(2.0)}
    assert table["highest"] == {"ceiling": pytest.approx(2.0), "target": "openvino-int8", "m": 5}
    assert table["needed_free_drafts"]["openvino-int8"]["5"] == pytest.approx(5.0)  # 2 · 125 / 50
    assert table["needed_with_draft_model"]["llamacpp"]["5"] == pytest.approx(11.2)  # 2 · (200 + 4 · 20) / 50
    assert "openvino-int8" not in table["needed_with_draft_model"]  # no draft forward measured
    assert table["fewest_needed"] == {"tokens": pytest.approx(5.0), "target": "openvino-int8", "m": 5}
    printed = capsys.readouterr().out
    assert "highest ceiling: 2.00x (openvino-int8, m = 5)" in printed
    assert "fewest tokens a step for 2x: 5.0 (openvino-int8, m = 5, free drafts)" in printed


def test_no_block_can_hold_the_tokens_a_goal_needs(study, tmp_path, monkeypatch):
    """llama.cpp's verification costs m one-token forwards: 2x needs 2m tokens from a block of m."""
    results = tmp_path / "perf.json"
    results.write_text(json.dumps({"forward_seconds": {"llamacpp/target/m=1": 0.05, "llamacpp/target/m=4": 0.2}}))
    out = tmp_path / "ceiling.json"
    monkeypatch.setattr(sys, "argv", ["speedup_ceiling.py", str(results), "--goal", "2", "--out", str(out)])
    study.main()
    table = json.loads(out.read_text())
    assert table["fewest_needed"] is None and table["needed_free_drafts"]["llamacpp"]["4"] == pytest.approx(8.0)


def test_a_file_without_the_reference_is_refused(study, tmp_path, monkeypatch):
    results = tmp_path / "perf.json"
    results.write_text(json.dumps({"forward_seconds": {"openvino-int8/target/m=1": 0.1}}))
    monkeypatch.setattr(sys, "argv", ["speedup_ceiling.py", str(results)])
    with pytest.raises(SystemExit, match="no one-token target forward of 'llamacpp'.*openvino-int8"):
        study.main()


def test_the_ceiling_of_a_lossy_rule_over_lossless_sd(study, tmp_path, monkeypatch, capsys):
    """Lossless sd K = 4 emitting 4 tokens a step against a rule that accepts every draft: per block,
    m / (c(m) + (m - 1) d) over 4 / (c(5) + 4 d); the pipeline without a draft forward is left out."""
    results = tmp_path / "perf.json"
    results.write_text(json.dumps({"forward_seconds": {
        "llamacpp/target/m=1": 0.05, "llamacpp/target/m=5": 0.2, "llamacpp/target/m=9": 0.4, "llamacpp/draft/m=1": 0.02,
        "openvino-int8/target/m=1": 0.1, "openvino-int8/target/m=5": 0.125}}))
    out = tmp_path / "ceiling.json"
    monkeypatch.setattr(sys, "argv", ["speedup_ceiling.py", str(results), "--over-lossless", "4", "--out", str(out)])
    study.main()
    table = json.loads(out.read_text())
    lossless = 4 / (0.2 + 4 * 0.02)
    assert table["over_lossless"]["ceiling"] == {"llamacpp": {
        "1": pytest.approx(1 / 0.05 / lossless), "5": pytest.approx(1.25), "9": pytest.approx(9 / (0.4 + 8 * 0.02) / lossless)}}
    assert table["over_lossless"]["tokens_a_step"] == 4 and "--over-lossless 4" in table["command"]
    assert "over sd K = 4 at 4 tokens a step" in capsys.readouterr().out


@pytest.mark.parametrize("tokens, costs, match", [
    (6.0, {5: 0.2}, "between 1 and 5"),
    (0.0, {5: 0.2}, "between 1 and 5"),
    (4.0, {1: 0.1, 9: 0.3}, "blocks of 5 tokens"),
])
def test_over_lossless_refuses_what_cannot_be(study, tokens, costs, match):
    with pytest.raises(ValueError, match=match):
        study.over_lossless(costs, draft=0.01, tokens_a_step=tokens)
