"""The decoding loop's own cost per step, in two source trees: the chain path before and after a change.

A step of speculative decoding is two runtimes' forwards plus the engine's work around them
(propose, verify, commit). With two small random Qwen2 models (2 layers, hidden 64, vocabulary 512)
the forwards cost little, so milliseconds per step measure the loop itself. Each tree runs in its
own processes, alternating tree by tree for ``--rounds`` rounds, each process generating greedy
``sd`` K = 4 chains for a batch of 1 and of 4 prompts, with a draft equal to the target (every
draft accepted) and with a draft of other weights (most rejected). The JSON keeps every sample and
the medians per tree.

    git worktree add --detach /tmp/loop-before 4f981df^     # before the one-loop change
    python benchmarks/studies/loop_overhead.py --tree before=/tmp/loop-before/src --tree after=src \\
        --out benchmarks/results/loop_overhead.json

Only names that both trees have are used (``quickdraft.engine``, ``quickdraft.runner``, …; a newer
tree answers them through its deprecated aliases).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from quickdraft.engine import generate
from quickdraft.runner import ModelRunner
from quickdraft.drafters import ModelDrafter
from quickdraft.policies import Constant

torch.set_num_threads(1)
V, NEW, REPEATS = 512, 96, 3

def model(seed):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg).eval()

target, other = model(0), model(1)
prompts = [[(7 * i + 3 * j) % V for j in range(24)] for i in range(4)]
out = {}
for label, draft in (("accept_all", target), ("mostly_rejected", other)):
    for b in (1, 4):
        for rep in range(REPEATS + 1):  # the first run warms up
            start = time.perf_counter()
            res = generate(ModelRunner(target), prompts[:b], method="sd", drafter=ModelDrafter(ModelRunner(draft), V),
                           policy=Constant(4), max_new_tokens=NEW, seed=0)
            seconds = time.perf_counter() - start
            if rep:
                steps = max(m.steps for m in res.metrics)
                out.setdefault(f"{label}/B={b}", []).append(1e3 * seconds / steps)
            sequences = res.sequences
        out[f"{label}/B={b}/tokens"] = [list(s) for s in sequences]
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH of a source tree's src/")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    samples: dict[str, dict[str, list[float]]] = {label: {} for label in trees}
    tokens: dict[str, dict] = {}
    for _ in range(args.rounds):
        for label, path in trees.items():
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve()), "OMP_NUM_THREADS": "1"}
            with tempfile.TemporaryDirectory() as cwd:  # not the checkout: its src/ must not shadow the tree
                res = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=cwd, capture_output=True, text=True)
            if res.returncode:
                raise SystemExit(f"{label}: {res.stderr[-2000:]}")
            row = json.loads(res.stdout.strip().splitlines()[-1])
            for key, value in row.items():
                if key.endswith("/tokens"):
                    tokens.setdefault(label, {})[key] = value
                else:
                    samples[label].setdefault(key, []).extend(value)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    labels = list(trees)
    medians = {label: {k: statistics.median(v) for k, v in per.items()} for label, per in samples.items()}
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"model": fields.get("Model name", "").strip(),
                    "isa": sorted(f for f in fields.get("Flags", "").split() if f.startswith(("avx", "amx"))),
                    "threads": 1},
        "trees": trees,
        "ms_per_step_median": medians,
        "ratio_to_first": {label: {k: medians[label][k] / medians[labels[0]][k] for k in medians[label]}
                           for label in labels[1:]},
        "same_tokens": all(tokens[label] == tokens[labels[0]] for label in labels[1:]),
        "samples_ms_per_step": samples,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for label in labels:
        print(label, {k: round(v, 2) for k, v in medians[label].items()})
    print("ratio", {label: {k: round(v, 3) for k, v in r.items()} for label, r in result["ratio_to_first"].items()})
    print("same tokens in every tree:", result["same_tokens"])


if __name__ == "__main__":
    main()
