"""Chain speculative decoding vs target alone vs Hugging Face assisted generation, side by side.

On the default pair and the first N HumanEval prompts (as chat), in one process, interleaved
prompt by prompt (so machine drift hits every method alike), after a warm-up:

* ``ar``          target alone (our engine)
* ``sd-k{K}``     our chain speculative decoding, K in --ks
* ``hf-ar``       Hugging Face ``generate`` on the same target
* ``hf-assisted`` Hugging Face ``generate(..., assistant_model=draft)`` (its default adaptive K)

Times are end to end per prompt (prefill included) so that every row is measured the same way;
our decode-only tokens/s is recorded too. Raw per-prompt rows and a summary go to --out.

    python benchmarks/bench_chain.py --limit 4 --max-new-tokens 128 --temperatures 0 0.7
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from quickdraft.evaluation.anchors import hf_generate
from quickdraft.evaluation.datasets import load_humaneval
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Constant
from quickdraft.verification.sampling import SamplingParams


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    pipe = Pipeline.from_specs(args.target, args.draft, dtype=args.dtype)
    load_seconds = time.perf_counter() - t0
    problems = load_humaneval()[: args.limit]
    prompt_ids = [pipe.encode_messages(p.messages) for p in problems]
    eos = pipe.eos_ids()
    methods = ["ar"] + [f"sd-k{k}" for k in args.ks] + ["hf-ar", "hf-assisted"]

    def one(method: str, ids: list[int], sampling: SamplingParams, seed: int) -> dict:
        if method.startswith("hf-"):
            res = hf_generate(
                pipe.target_model, ids, sampling=sampling, max_new_tokens=args.max_new_tokens, eos_token_ids=eos,
                seed=seed, assistant_model=pipe.draft_model if method == "hf-assisted" else None,
            )
            return {"new_tokens": len(res.new_ids), "seconds": res.seconds, "new_ids": res.new_ids}
        k = int(method.split("-k")[1]) if method.startswith("sd-k") else 1
        out = pipe.generate(
            [""], prompt_ids=[ids], method="ar" if method == "ar" else "sd", policy=Constant(k), sampling=sampling,
            max_new_tokens=args.max_new_tokens, seed=seed,
        )
        m = out.metrics
        return {
            "new_tokens": m.new_tokens, "seconds": m.prefill_seconds + m.decode_seconds,
            "decode_seconds": m.decode_seconds, "mean_acceptance_length": m.mean_acceptance_length,
            "acceptance_rate_by_position": m.acceptance_rate_by_position, "target_forwards": m.target_forwards,
            "draft_forwards": m.draft_forwards, "new_ids": out.completions[0].token_ids,
        }

    # warm-up: every method once on a short run
    warm = SamplingParams()
    for method in methods:
        saved = args.max_new_tokens
        args.max_new_tokens = 8
        one(method, prompt_ids[0], warm, 0)
        args.max_new_tokens = saved

    rows = []
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature)
        for i, ids in enumerate(tqdm(prompt_ids, desc=f"T={temperature}")):
            order = methods[i % len(methods):] + methods[: i % len(methods)]  # rotate to cancel order effects
            for method in order:
                r = one(method, ids, sampling, seed=i)
                r.update(method=method, temperature=temperature, prompt=problems[i].id)
                rows.append(r)

    summary = {}
    for temperature in args.temperatures:
        base = _tps([r for r in rows if r["method"] == "ar" and r["temperature"] == temperature])
        for method in methods:
            sel = [r for r in rows if r["method"] == method and r["temperature"] == temperature]
            tps = _tps(sel)
            summary[f"{method}@T={temperature}"] = {
                "method": method, "temperature": temperature, "tokens_per_second": tps, "speedup_vs_ar": tps / base,
                "new_tokens": sum(r["new_tokens"] for r in sel),
                "mean_acceptance_length": (
                    sum(r["mean_acceptance_length"] * r["target_forwards"] for r in sel) / sum(r["target_forwards"] for r in sel)
                    if "mean_acceptance_length" in sel[0] else None
                ),
            }
        if 0.0 == temperature:
            greedy_ar = [r["new_ids"] for r in rows if r["method"] == "ar" and r["temperature"] == 0.0]
            for method in methods:
                ids = [r["new_ids"] for r in rows if r["method"] == method and r["temperature"] == 0.0]
                summary[f"{method}@T=0.0"]["identical_to_ar"] = sum(a == b for a, b in zip(ids, greedy_ar))
    return {
        "command": "python benchmarks/bench_chain.py " + " ".join(args.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads, "torch": torch.__version__},
        "dtype": args.dtype, "model_load_seconds": load_seconds, "max_new_tokens": args.max_new_tokens,
        "prompts": [p.id for p in problems], "summary": summary, "rows": rows,
    }


def _tps(rows: list[dict]) -> float:
    return sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6, 8])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--target", default="target")
    parser.add_argument("--draft", default="draft")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/chain.json")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"{'method':<14} {'T':>4} {'tok/s':>7} {'x ar':>6} {'acc.len':>7}")
    for s in result["summary"].values():
        acc = f"{s['mean_acceptance_length']:.2f}" if s["mean_acceptance_length"] else "-"
        print(f"{s['method']:<14} {s['temperature']:>4} {s['tokens_per_second']:>7.2f} {s['speedup_vs_ar']:>6.2f} {acc:>7}")


if __name__ == "__main__":
    main()
