"""How long the cost policy's step-cost measurement takes, in two source trees (before and after a change).

``quickdraft serve`` measures the forward costs of its pair over the batches it may decode
(``Pipeline.step_costs(max_k, max_rows=--max-batch)``) before it takes requests, once per machine
and pair. Each tree runs in its own process on the default pair (``--backend``, default openvino),
alternating tree by tree for ``--rounds`` rounds, and measures without the cache; the JSON keeps the
seconds of every run and the costs each measured (ms: target over 1 … K + 1 tokens, then the draft),
so that a faster measurement can be checked to measure the same costs.

    git worktree add --detach /tmp/cost-before <commit before the change>
    python benchmarks/studies/cost_measurement.py --tree before=/tmp/cost-before/src --tree after=src \\
        --out benchmarks/results/cost_measurement_avx2.json

``--fork-check`` instead times the same target forwards (1, 3 and 5 tokens over the context, median
of 5) on rows prefilled one by one and on rows forked from one (``select_rows``), interleaved, for 2
and 4 rows, ``--rounds`` times, in this tree: whether a forked row costs what a prefilled one does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, time
from quickdraft.pipeline import Pipeline
backend, max_k, max_rows = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
pipe = Pipeline.from_specs("target", "draft", backend=backend)
start = time.perf_counter()
cost = pipe.step_costs(max_k, max_rows=max_rows, cache=False)
seconds = time.perf_counter() - start
ms = lambda target, draft: [round(t * 1e3, 1) for t in target] + [round(draft * 1e3, 1)]
print(json.dumps({"seconds": seconds, "costs_ms": {"1": ms(cost.target, cost.draft),
                  **{str(r.rows): ms(r.target, r.draft) for r in cost.batched}}}))
"""


FORK_CHECK = r"""
import json, statistics, sys, time
import torch
from quickdraft.pipeline import Pipeline
backend, rounds = sys.argv[1], int(sys.argv[2])
target = Pipeline.from_specs("target", "draft", backend=backend).target
ctx = torch.tensor([[(7 * i + 11) % 1000 for i in range(128)]])

def timed(rows, m, repeats=5):
    base, times = torch.full((rows,), ctx.shape[1]), []
    for _ in range(repeats):
        start = time.perf_counter()
        target.forward(ctx[:, -m:].expand(rows, -1), logits_to_keep=m)
        times.append(time.perf_counter() - start)
        target.truncate(base)
    return round(statistics.median(times) * 1e3, 1)

def prefilled(rows):
    target.reset(rows)
    target.forward(ctx.expand(rows, -1), logits_to_keep=1)

def forked(rows):
    target.reset(1)
    target.forward(ctx, logits_to_keep=1)
    target.select_rows([0] * rows)

out = []
for _ in range(rounds):
    for rows in (2, 4):
        for how, fill in (("prefilled", prefilled), ("forked", forked)):
            fill(rows)
            timed(rows, 1, repeats=1)  # warm-up
            out.append({"rows": rows, "rows_from": how, "ms_by_tokens": {m: timed(rows, m) for m in (1, 3, 5)}})
print(json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="LABEL=SRC",
                   help="a source tree to measure (the directory that holds the quickdraft package)")
    p.add_argument("--fork-check", action="store_true", help="time forwards on forked against prefilled rows")
    p.add_argument("--backend", default="openvino")
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--max-rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from quickdraft.backends.costs import machine_identity

    if args.fork_check:
        out = subprocess.run([sys.executable, "-c", FORK_CHECK, args.backend, str(args.rounds)],
                             capture_output=True, text=True, check=True)
        record = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine_identity(),
                  "backend": args.backend, "fork_check": json.loads(out.stdout.strip().splitlines()[-1])}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        for row in record["fork_check"]:
            print(row)
        return
    if not trees:
        p.error("give --tree LABEL=SRC (one or more) or --fork-check")

    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(args.rounds):
        for label, src in trees.items():
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
            out = subprocess.run([sys.executable, "-c", CHILD, args.backend, str(args.max_k), str(args.max_rows)],
                                 env=env, capture_output=True, text=True, check=True)
            runs[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(label, f"{runs[label][-1]['seconds']:.1f} s", flush=True)
    record = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine_identity(),
              "backend": args.backend, "max_k": args.max_k, "max_rows": args.max_rows, "trees": trees, "runs": runs,
              "median_seconds": {label: statistics.median(r["seconds"] for r in rs) for label, rs in runs.items()}}
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["median_seconds"]))


if __name__ == "__main__":
    main()
