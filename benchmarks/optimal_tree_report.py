"""Predicted against measured tokens per target call for the optimal-tree benchmark (docs/trees.md).

Reads the raw cells of ``quickdraft bench`` runs (default: benchmarks/results/bench/optimal_tree_humaneval and
optimal_tree_mtbench), pools every method's cells per dataset and temperature — acceptance length
= (accepted + steps) / steps, the bonus or recovered token included; decode tok/s = new tokens / decode
seconds — and puts beside each static shape (chain ERSD, the optimal tree) the stationary model's expected
tokens per call, eq. (1) of docs/theory.md §9, under the shipped rank law at that temperature:

    python benchmarks/optimal_tree_report.py --out benchmarks/results/optimal_tree.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from quickdraft.evaluation.bench import load_records
from quickdraft.methods import build_method
from quickdraft.verification.sampling import SamplingParams
from quickdraft.theory.ersd import draft_tree_expected_tokens
from quickdraft.decoding.tree_shapes import RankLawFile, chain_paths

RUNS = ["benchmarks/results/bench/optimal_tree_humaneval", "benchmarks/results/bench/optimal_tree_mtbench"]


def static_paths(record: dict) -> list[list[int]] | None:
    """The tree a cell ran when its shape is static (chain ERSD, the optimal tree); None for dynamic trees."""
    params = record["params"]
    if record["name"] == "ersd" and params.get("candidates", 1) == 1:
        return chain_paths(params.get("k", 4))
    spec = build_method(record["name"], sampling=SamplingParams(temperature=record["temperature"]), **params)
    return None if spec.tree is None or spec.tree.paths is None else [list(p) for p in spec.tree.paths]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", default=RUNS)
    ap.add_argument("--rank-law", default="", help="rank-law file (default: the shipped default-pair laws)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    laws = RankLawFile.load(args.rank_law)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for run in args.runs:
        for rec in load_records(run):
            if rec.get("kind") == "method":
                groups[rec["dataset"], rec["temperature"], rec["method"]].append(rec)
    rows = []
    for (dataset, temperature, method), recs in sorted(groups.items()):
        steps = sum(r["metrics"]["steps"] for r in recs)
        accepted = sum(r["metrics"]["accepted_tokens"] for r in recs)
        paths = static_paths(recs[0])
        law = laws.at(temperature).law
        rows.append({
            "dataset": dataset, "temperature": temperature, "method": method, "prompts": len(recs),
            "nodes": len(paths) if paths else recs[0]["params"].get("tree_budget"),
            "depth": max(map(len, paths)) if paths else recs[0]["params"].get("depth"),
            "acceptance_length": (accepted + steps) / steps,
            "predicted_tokens_per_call": draft_tree_expected_tokens(law, paths) if paths else None,
            "decode_tok_s": sum(r["new_tokens"] for r in recs) / sum(r["decode_seconds"] for r in recs),
            "draft_forwards_per_step": sum(r["draft_forwards"] for r in recs) / steps,
            "passed": [r.get("quality", {}).get("passed") for r in recs] if dataset == "humaneval" else None,
            "paths": paths,
        })
    Path(args.out).write_text(json.dumps({"rank_law": laws.command, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    print("| data | T | method | nodes | depth | acc. length | predicted E[T] | decode tok/s | draft fwd/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pred = f"{r['predicted_tokens_per_call']:.2f}" if r["predicted_tokens_per_call"] else "–"
        print(f"| {r['dataset']} | {r['temperature']:g} | `{r['method']}` | {r['nodes']} | {r['depth']} | "
              f"{r['acceptance_length']:.2f} | {pred} | {r['decode_tok_s']:.2f} | {r['draft_forwards_per_step']:.2f} |")


if __name__ == "__main__":
    main()
