"""Token trees vs chain speculative decoding vs target alone, and the cost of verifying N tree nodes.

On the default pair (bf16) and the first --limit HumanEval prompts (as chat), in one process:

1. ``forward_cost``: one target forward over a tree of M = 1 … 64 nodes after a prompt
   (a random dynamic-looking tree: every node's parent drawn among the earlier nodes), median of
   --repeats, sizes interleaved round by round. This is the price of a bigger tree.
2. ``runs``: per prompt, interleaved method by method (machine drift hits every method alike),
   at every temperature in --temperatures:

   * ``ar``                  target alone
   * ``sd-k4``               chain speculative decoding, K = 4
   * ``tree-N{N}-d{d}-k{k}-{scheme}-{verifier}``  token trees (at T = 0: topk, greedy walk)

Mean acceptance length counts the bonus token (tokens per target forward). Tokens/s is decode
only (prefill excluded), the same for every method. Raw rows and a summary go to --out.

    python benchmarks/bench_tree.py --limit 3 --max-new-tokens 64 --temperatures 0 0.7 \\
        --out benchmarks/results/tree_humaneval.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from quickdraft.datasets import load_humaneval
from quickdraft.pipeline import Pipeline
from quickdraft.policies import Constant
from quickdraft.sampling import SamplingParams
from quickdraft.tree import TreeConfig
from quickdraft.tree_decoding import generate_tree

#: (budget N, depth d, top-k k, scheme, verifier); at T = 0 only the greedy-walk topk entries run
TREES_T0 = [(8, 4, 2, "topk", "rrs"), (16, 5, 4, "topk", "rrs"), (32, 6, 4, "topk", "rrs"), (64, 6, 6, "topk", "rrs")]
TREES_T = [
    (16, 5, 4, "topk", "rrs"),
    (32, 6, 4, "topk", "rrs"),
    (16, 4, 4, "without_replacement", "rrs"),
    (16, 4, 4, "with_replacement", "kseq"),
    (16, 4, 4, "greedy", "optimal_greedy"),
]


def tree_name(n: int, d: int, k: int, scheme: str, verifier: str) -> str:
    return f"tree-N{n}-d{d}-k{k}-{scheme}-{verifier}"


def forward_cost(pipe: Pipeline, prompt: list[int], sizes: list[int], repeats: int) -> list[dict]:
    """Median seconds of one target forward over M tree nodes after ``prompt``."""
    runner = pipe.target
    gen = torch.Generator().manual_seed(0)
    times: dict[int, list[float]] = {m: [] for m in sizes}
    runner.reset(1)
    runner.forward(torch.tensor([prompt[:-1]]), logits_to_keep=1)
    for _ in range(repeats):
        for m in sizes:
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, m)]
            depths = [0]
            for i in range(1, m):
                depths.append(depths[parents[i]] + 1)
            from quickdraft.tree import ancestor_mask

            mask = ancestor_mask(torch.tensor([parents]))
            tokens = torch.randint(0, 1000, (1, m), generator=gen)
            runner.begin_tree()
            t0 = time.perf_counter()
            runner.forward_tree(tokens, torch.tensor([depths]), mask)
            times[m].append(time.perf_counter() - t0)
            runner.commit_tree(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    return [{"nodes": m, "median_seconds": statistics.median(times[m]), "seconds": times[m]} for m in sizes]


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    pipe = Pipeline.from_specs(args.target, args.draft, dtype=args.dtype)
    load_seconds = time.perf_counter() - t0
    problems = load_humaneval(args.limit)
    prompt_ids = [pipe.encode_messages(p.messages) for p in problems]
    eos = pipe.eos_ids()

    # warm-up (first calls allocate and pick kernels)
    pipe.generate([""], prompt_ids=[prompt_ids[0]], method="sd", policy=Constant(4), max_new_tokens=8)
    generate_tree(pipe.target, pipe.draft, [prompt_ids[0]], config=TreeConfig(4, 2, 8), max_new_tokens=8)

    cost = forward_cost(pipe, prompt_ids[0], args.sizes, args.repeats)
    print("forward cost:", {c["nodes"]: round(c["median_seconds"], 3) for c in cost}, flush=True)

    rows = []
    partial = Path(args.out).with_suffix(".partial.json")
    for pi, ids in enumerate(prompt_ids):
        for temperature in args.temperatures:
            sampling = SamplingParams(temperature=temperature)
            trees = TREES_T0 if temperature == 0 else TREES_T
            methods = ["ar", "sd-k4"] + [tree_name(*t) for t in trees]
            for method in methods:
                if method.startswith("tree"):
                    n, d, k, scheme, verifier = trees[methods.index(method) - 2]
                    out = generate_tree(
                        pipe.target, pipe.draft, [ids], config=TreeConfig(d, k, n, scheme), verifier=verifier,
                        sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed + pi, eos_token_ids=eos,
                    )
                    m = out.batch_metrics
                    seq = out.sequences[0]
                else:
                    res = pipe.generate(
                        [""], prompt_ids=[ids], method="ar" if method == "ar" else "sd", policy=Constant(4),
                        sampling=sampling, max_new_tokens=args.max_new_tokens, seed=args.seed + pi,
                    )
                    m = res.metrics
                    seq = res.completions[0].token_ids
                row = {
                    "temperature": temperature, "prompt": problems[pi].id, "method": method,
                    "new_tokens": m.new_tokens, "decode_seconds": m.decode_seconds,
                    "tokens_per_second": m.tokens_per_second, "mean_acceptance_length": m.mean_acceptance_length,
                    "target_forwards": m.target_forwards, "draft_forwards": m.draft_forwards,
                    "drafted_tokens": m.drafted_tokens, "accepted_tokens": m.accepted_tokens, "new_ids": seq,
                }
                rows.append(row)
                print(f"T={temperature} {problems[pi].id} {method:42s} {m.new_tokens:4d} tok "
                      f"{m.tokens_per_second:5.2f} tok/s  MAL {m.mean_acceptance_length:4.2f}", flush=True)
                partial.write_text(json.dumps({"forward_cost": cost, "rows": rows}, indent=1))

    summary = []
    for temperature in args.temperatures:
        names = []
        for r in rows:
            if r["temperature"] == temperature and r["method"] not in names:
                names.append(r["method"])
        ar_rows = [r for r in rows if r["temperature"] == temperature and r["method"] == "ar"]
        ar_tps = sum(r["new_tokens"] for r in ar_rows) / sum(r["decode_seconds"] for r in ar_rows)
        for name in names:
            sel = [r for r in rows if r["temperature"] == temperature and r["method"] == name]
            tokens = sum(r["new_tokens"] for r in sel)
            seconds = sum(r["decode_seconds"] for r in sel)
            steps = sum(r["target_forwards"] for r in sel)
            summary.append({
                "temperature": temperature, "method": name, "prompts": len(sel), "new_tokens": tokens,
                "tokens_per_second": tokens / seconds,
                "speedup_vs_ar": tokens / seconds / ar_tps,
                "mean_acceptance_length": statistics.mean(r["mean_acceptance_length"] for r in sel),
                "target_forwards": steps,
            })
    if 0 in args.temperatures:
        ar0 = {r["prompt"]: r["new_ids"] for r in rows if r["temperature"] == 0 and r["method"] == "ar"}
        for s in summary:
            if s["temperature"] == 0:
                s["identical_to_ar"] = all(
                    r["new_ids"] == ar0[r["prompt"]] for r in rows if r["temperature"] == 0 and r["method"] == s["method"]
                )
    return {
        "command": "python benchmarks/bench_tree.py " + " ".join(args.argv),
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
        "models": {"target": args.target, "draft": args.draft, "dtype": args.dtype},
        "load_seconds": load_seconds,
        "max_new_tokens": args.max_new_tokens,
        "forward_cost": cost,
        "summary": summary,
        "rows": rows,
    }


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="target")
    parser.add_argument("--draft", default="draft")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/tree_humaneval.json")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
