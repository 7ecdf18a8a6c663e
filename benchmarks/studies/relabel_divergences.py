"""Relabel the FSD divergences of `quickdraft bench` run directories to the current names.

For runs whose ``js`` is the textbook Jensen–Shannon divergence and whose ``js_fsd`` is FSD's
"JS" (KL from the mixture), this renames, without recomputing anything:

==================  ==================
in the run          current name
==================  ==================
``js``              ``jsd``
``js_fsd``          ``js``
``topk_js``         ``topk_jsd``
``topk_js_fsd``     ``topk_js``
==================  ==================

in every raw cell (``method`` label and ``params.divergence``, and the cell's file path, which
is derived from the label), in ``run.json`` (entries, baseline, commands), and then rewrites
``summary.csv`` / ``summary.json`` / ``summary.md`` and the plots from the relabelled cells with
:func:`quickdraft.evaluation.report.write_reports`. Titles and descriptions (prose) are left as they are.

A run that already names ``jsd``, ``topk_jsd`` or a ``topp_*`` divergence uses the current names
and is left alone, so running the script twice on a run with a ``js`` entry changes nothing (a run
whose only JS entries are ``js_fsd`` names neither afterwards: relabel it once). Run it on a
finished run, not on a directory a bench is still writing to.

Usage::

    python benchmarks/studies/relabel_divergences.py RUN_DIR [RUN_DIR ...] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from quickdraft.evaluation.bench import cell_path
from quickdraft.evaluation.report import write_reports

#: divergence name in the run -> current name
RENAMES = {"js": "jsd", "js_fsd": "js", "topk_js": "topk_jsd", "topk_js_fsd": "topk_js"}
#: names that only runs with the current names contain
CURRENT_ONLY = re.compile(r"(?<![\w])divergence=(?:topk_jsd|jsd|topp_\w+)(?![\w])")
LABEL_DIVERGENCE = re.compile(r"(?<![\w])divergence=((?:topk_)?js(?:_fsd)?)(?![\w])")


def relabel(label: str) -> str:
    """``fsd:divergence=js,threshold=0.4`` -> ``fsd:divergence=jsd,threshold=0.4``; other text unchanged."""
    return LABEL_DIVERGENCE.sub(lambda m: "divergence=" + RENAMES[m.group(1)], label)


def _relabel_strings(value: Any) -> Any:
    """Every label in a JSON value relabelled, and every ``"divergence": name`` renamed."""
    if isinstance(value, str):
        return relabel(value)
    if isinstance(value, list):
        return [_relabel_strings(v) for v in value]
    if isinstance(value, dict):
        return {k: (RENAMES.get(v, v) if k == "divergence" and isinstance(v, str) else _relabel_strings(v))
                for k, v in value.items()}
    return value


def _dump(payload: Any) -> str:
    return json.dumps(payload, indent=1, ensure_ascii=False)  # as quickdraft.evaluation.bench writes them


def relabel_run(run_dir: Path, dry_run: bool = False) -> list[str]:
    """Relabel one run directory; returns what changed (one line per file)."""
    run_file = run_dir / "run.json"
    run_text = run_file.read_text(encoding="utf-8")
    cells = sorted((run_dir / "raw").glob("*/*/*.json"))
    labels = [json.loads(run_text).get("entries", [])] + [json.loads(p.read_text(encoding="utf-8"))["method"] for p in cells]
    if CURRENT_ONLY.search(json.dumps(labels)):
        return [f"{run_dir}: already uses the current names, left alone"]
    # read every cell before writing any: a renamed cell's new path can be another cell's old one
    moves = []
    for path in cells:
        record = json.loads(path.read_text(encoding="utf-8"))
        new = dict(record, method=relabel(record["method"]), params=_relabel_strings(record.get("params", {})))
        if new != record:
            moves.append((path, cell_path(run_dir, record["temperature"], new["method"], record["prompt_id"]), new))
    changes = [f"{old.relative_to(run_dir)} -> {new_path.relative_to(run_dir)}" for old, new_path, _ in moves]
    if not dry_run:
        for old, _, _ in moves:
            old.unlink()
        for _, new_path, record in moves:
            new_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = new_path.with_suffix(new_path.suffix + f".tmp{os.getpid()}")
            tmp.write_text(_dump(record), encoding="utf-8")
            os.replace(tmp, new_path)
        for old, _, _ in moves:
            if old.parent.is_dir() and not any(old.parent.iterdir()):
                old.parent.rmdir()
    new_run_text = _dump(_relabel_strings(json.loads(run_text)))
    if new_run_text != run_text:
        changes.append("run.json")
        if not dry_run:
            run_file.write_text(new_run_text, encoding="utf-8")
    if changes and not dry_run:
        write_reports(run_dir)
        changes.append("summary.csv, summary.json, summary.md, plots/ rewritten")
    return [f"{run_dir}: {c}" for c in changes] or [f"{run_dir}: nothing to relabel"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (each with run.json and raw/)")
    ap.add_argument("--dry-run", action="store_true", help="print what would change, change nothing")
    args = ap.parse_args(argv)
    for run in args.runs:
        if not (run / "run.json").is_file():
            ap.error(f"{run} is not a benchmark run (no run.json)")
        for line in relabel_run(run, dry_run=args.dry_run):
            print(line)


if __name__ == "__main__":
    main()
