"""Re-score the stored HumanEval completions of ``quickdraft bench`` runs with the current sandbox.

A bench run keeps every completion's text in ``raw/T*/<entry>/<problem>.json`` next to its
``quality`` (extraction status and sandbox verdict). This script extracts each program again with
:func:`quickdraft.evaluation.extract.extract_program`, runs the problem's tests in
:func:`quickdraft.evaluation.sandbox.run_humaneval_checks`, and prints stored against new pass@1 for every
(run, temperature, entry), then the records whose verdict changed. No model is loaded and nothing
is generated.

With ``--write`` the records whose verdict, status or detail changed get the new ``quality``
(with the sandbox's isolation mode and network level) and the run's reports (``summary.*``,
plots) are regenerated with :func:`quickdraft.evaluation.report.write_reports`; runs without a change are
left untouched. Checks that time out are run again one at a time, so that a loaded machine does not
turn a pass into a timeout.

    python benchmarks/rescore_pass_at_1.py                      # every run under benchmarks/results/bench
    python benchmarks/rescore_pass_at_1.py RUN_DIR ... --write  # chosen runs, saving the changes
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from quickdraft.evaluation.bench import _write_json
from quickdraft.evaluation.datasets import load_humaneval
from quickdraft.errors import QuickdraftError
from quickdraft.evaluation.extract import extract_program
from quickdraft.evaluation.report import write_reports
from quickdraft.evaluation.sandbox import run_humaneval_checks, sandbox_info

DEFAULT_ROOT = Path(__file__).resolve().parent / "results" / "bench"
#: quality fields compared between the stored and the new verdict
VERDICT_FIELDS = ("passed", "sandbox_status", "detail")


def humaneval_records(run_dir: Path) -> list[tuple[Path, dict]]:
    """``(path, record)`` of every checked HumanEval cell of a run directory, in path order."""
    raw = run_dir / "raw"
    if not raw.is_dir():
        raise QuickdraftError(f"{run_dir} is not a bench run directory (no raw/ folder)")
    found = []
    for path in sorted(raw.glob("*/*/*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("dataset") == "humaneval" and "quality" in record:
            found.append((path, record))
    return found


def rescore(records: list[tuple[Path, dict]], workers: int, timeout: float = 10.0) -> list[dict]:
    """The new ``quality`` of each record, in order (``timeout``: wall-clock seconds per check, as in
    ``quickdraft bench``)."""
    prompts = {p.id: p for p in load_humaneval()}
    jobs, extractions = [], []
    for path, record in records:
        prompt = prompts.get(record["prompt_id"])
        if prompt is None:
            raise QuickdraftError(f"{path}: unknown HumanEval problem {record['prompt_id']!r}")
        extraction = extract_program(record["text"], prompt.raw, prompt.metadata["entry_point"])
        extractions.append(extraction)
        jobs.append((prompt, extraction.program))
    outcomes = run_humaneval_checks(jobs, workers=workers, timeout=timeout)
    # A timeout on a loaded machine is not a verdict on the code: check those again, one at a time.
    slow = [i for i, outcome in enumerate(outcomes) if outcome.status == "timeout"]
    if slow:
        again = run_humaneval_checks([jobs[i] for i in slow], workers=1, timeout=timeout)
        for i, outcome in zip(slow, again):
            outcomes[i] = outcome
    return [
        {
            "extraction": extraction.status, "parsed": extraction.parsed, "passed": bool(outcome.passed),
            "sandbox_status": outcome.status, "detail": outcome.detail[:300],
            "isolation": outcome.isolation, "network": outcome.network,
        }
        for extraction, outcome in zip(extractions, outcomes)
    ]


def pass_table(run_dir: Path, records: list[tuple[Path, dict]], new: list[dict]) -> list[str]:
    """One line per (temperature, entry): stored and new passes out of n."""
    counts: dict[tuple[float, str], list[int]] = defaultdict(lambda: [0, 0, 0])
    for (_, record), quality in zip(records, new):
        cell = counts[(record["temperature"], record["method"])]
        cell[0] += bool(record["quality"].get("passed"))
        cell[1] += quality["passed"]
        cell[2] += 1
    lines = []
    for (temperature, method), (stored, now, n) in sorted(counts.items()):
        mark = "" if stored == now else "   <- changed"
        lines.append(f"  {run_dir.name:<18} T={temperature:<4g} {method:<40} pass@1 {stored:>3}/{n:<3} -> {now:>3}/{n:<3}{mark}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", type=Path, help=f"bench run directories (default: every one under {DEFAULT_ROOT})")
    parser.add_argument("--workers", type=int, default=2, help="concurrent sandboxes (default 2)")
    parser.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds per check (default 10)")
    parser.add_argument("--write", action="store_true", help="save changed records and regenerate the run's reports")
    args = parser.parse_args(argv)
    runs = args.runs or sorted(p for p in DEFAULT_ROOT.iterdir() if (p / "raw").is_dir())
    info = sandbox_info()
    print(f"sandbox: isolation {info['mode']}; network {info['network']} ({info['network_meaning']})")
    total_changed = 0
    for run_dir in runs:
        records = humaneval_records(run_dir)
        if not records:
            print(f"{run_dir}: no checked HumanEval completions")
            continue
        new = rescore(records, args.workers, args.timeout)
        print(f"{run_dir}: {len(records)} HumanEval completions")
        print("\n".join(pass_table(run_dir, records, new)))
        changed = [
            (path, record, quality)
            for (path, record), quality in zip(records, new)
            if any(record["quality"].get(f) != quality[f] for f in VERDICT_FIELDS)
        ]
        for path, record, quality in changed:
            stored = record["quality"]
            print(f"    {path.relative_to(run_dir)}: {stored.get('sandbox_status')} ({stored.get('detail', '')!r}) "
                  f"-> {quality['sandbox_status']} ({quality['detail']!r})")
        total_changed += len(changed)
        if args.write and changed:
            for path, record, quality in changed:
                record["quality"] = quality
                _write_json(path, record)
            write_reports(run_dir)
            print(f"    wrote {len(changed)} records and the reports of {run_dir}")
    print(f"{total_changed} verdicts changed" + ("" if args.write or not total_changed else " (not saved: pass --write)"))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except QuickdraftError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
