"""benchmarks/studies/confidence_cost_replay.py: rate stopping (the draft's confidence, calibrated
online, priced against the step costs) walked over stored outputs."""

from __future__ import annotations

import doctest
import json
import sys

import pytest

from quickdraft.backends.costs import StepCost

from conftest import load_script


@pytest.fixture(scope="module")
def study():
    return load_script("benchmarks/studies/confidence_cost_replay.py")


def test_doctests(study):
    assert doctest.testmod(study).failed == 0


def test_the_calibration_learns_that_a_confidence_fails(study):
    f = study.Calibration()
    for _ in range(20):
        f.observe(0.92, False)
    assert f(0.95) < 0.1 and f(0.5) == pytest.approx(0.5)  # only its own tenth moves


def test_a_sure_draft_on_a_flat_cost_drafts_to_the_longest(study):
    """Verification free up to max_k tokens and every draft right: every step drafts max_k, so the walk
    equals fixed K = max_k's. A draft that is always wrong at confidence 0.6: on the flat cost it drafts
    past its rejected token (the two ends of the range differ); where each verified token costs, it
    stops after one token, and learning that 0.6 fails keeps it there."""
    flat = StepCost(target=(1.0,) * 5, draft=0.01)
    n = 21
    right = {"new_tokens": n, "match": [n - j - 1 for j in range(n)], "draft_confidence": [0.99] * (n + 1)}
    run = study.rate_stopping(right, flat, 4, "high")
    assert run.lengths == [4] * 4 and run.accepted == 16
    wrong = {"new_tokens": n, "match": [0] * n, "draft_confidence": [0.6] * (n + 1)}
    low, high = (study.rate_stopping(wrong, flat, 4, end) for end in ("low", "high"))
    assert high.lengths[0] == 4 and low.lengths[0] == 2
    rising = StepCost(target=(1.0, 1.5, 2.0, 2.5, 3.0), draft=0.01)
    run = study.rate_stopping(wrong, rising, 4, "high")
    assert set(run.lengths[:-1]) == {1} and run.accepted == 0  # the last step is cut by the budget


def test_main_reads_a_replay_and_its_confidences(study, tmp_path, monkeypatch):
    n = 12
    replay = {"meta": {"args": {"max_k": 3}, "step_cost": {"target_by_tokens": [1.0, 1.0, 1.0, 1.2], "draft": 0.1,
                                                            "overhead_per_step": 0.0}},
              "outputs": {"humaneval": [{"prompt_id": "HumanEval/0", "new_tokens": n, "match": [n - j - 1 for j in range(n)]}]}}
    conf = {"outputs": {"humaneval": [{"prompt_id": "HumanEval/0", "draft_confidence": [0.99] * (n + 1)}]}}
    (tmp_path / "r.json").write_text(json.dumps(replay))
    (tmp_path / "c.json").write_text(json.dumps(conf))
    out = tmp_path / "o.json"
    monkeypatch.setattr(sys, "argv", ["x", "--replay", str(tmp_path / "r.json"), "--confidences", str(tmp_path / "c.json"),
                                      "--out", str(out)])
    study.main()
    s = json.loads(out.read_text())["summary"]["humaneval"]
    assert s["best_fixed_k"] == 3 and s["rate_stopping_gain"] == [pytest.approx(0.0), pytest.approx(0.0)]


def test_a_replay_at_temperature_is_refused(study, tmp_path, monkeypatch):
    """The confidences are of greedy outputs: an ERSD replay at T = 0.7 is refused by name."""
    replay = {"meta": {"args": {"max_k": 3, "temperature": 0.7}}, "outputs": {}}
    (tmp_path / "r.json").write_text(json.dumps(replay))
    (tmp_path / "c.json").write_text(json.dumps({"outputs": {}}))
    monkeypatch.setattr(sys, "argv", ["x", "--replay", str(tmp_path / "r.json"), "--confidences", str(tmp_path / "c.json"),
                                      "--out", str(tmp_path / "o.json")])
    with pytest.raises(SystemExit, match="T > 0.*T = 0 replays"):
        study.main()
