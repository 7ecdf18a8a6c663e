"""benchmarks/rescore_pass_at_1.py re-scores stored completions and saves only what changed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from quickdraft.errors import QuickdraftError

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "benchmarks" / "results" / "bench" / "fsd_humaneval"


def _script():
    return load_script("benchmarks/rescore_pass_at_1.py")


@pytest.fixture
def small_run(tmp_path):
    """A copy of a committed run with two of its records: one stored with a wrong verdict."""
    if not RUN.is_dir():
        pytest.skip("the committed fsd_humaneval run is not here")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(RUN / "run.json", run / "run.json")
    kept = []
    for rel in ("raw/T0/sd_k=8/HumanEval_0.json", "raw/T0/sd_k=8/HumanEval_1.json"):
        target = run / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(RUN / rel, target)
        kept.append(target)
    wrong = json.loads(kept[0].read_text())
    assert wrong["quality"]["passed"] is True
    wrong["quality"].update(passed=False, sandbox_status="error", detail="exited with code 0 before the check finished")
    kept[0].write_text(json.dumps(wrong, indent=1))
    return run, kept


def test_rescore_reports_and_saves_only_changed_verdicts(small_run, capsys):
    run, (wrong, right) = small_run
    untouched = right.read_text()
    script = _script()

    assert script.main([str(run)]) == 0  # dry run: prints, writes nothing
    out = capsys.readouterr().out
    assert "sd:k=8" in out and "pass@1   1/2   ->   2/2" in out and "<- changed" in out, out
    assert "1 verdicts changed (not saved: pass --write)" in out, out
    assert json.loads(wrong.read_text())["quality"]["passed"] is False
    assert not (run / "summary.json").exists()

    assert script.main([str(run), "--write"]) == 0
    out = capsys.readouterr().out
    fixed = json.loads(wrong.read_text())["quality"]
    assert (fixed["passed"], fixed["sandbox_status"], fixed["detail"]) == (True, "passed", ""), out
    assert fixed["isolation"] in ("namespaces", "basic") and fixed["network"]
    assert right.read_text() == untouched, out  # an unchanged verdict is not rewritten
    summary = json.loads((run / "summary.json").read_text())
    assert [(r["method"], r["passed"]) for r in summary["rows"]] == [("sd:k=8", 2)]


def test_rescore_names_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(QuickdraftError, match="not a bench run directory"):
        _script().humaneval_records(tmp_path)
