"""Where a decoding step's time goes: target forwards, draft forwards, and everything else.

Wraps the ``forward`` / ``forward_tree`` methods of both model runners with wall-clock timers and
runs plain (``ar``) and speculative (``sd``, constant K) decoding of the same HumanEval prompts, for
each configuration of ``bench_perf.py`` (``torch-fp32mkl``: both models float32 on ``nn.Linear``, i.e.
MKL — before; ``torch-fp32``: the same with oneDNN packed linear layers — after; ``llamacpp``: the
GGUF pair on llama.cpp). "Other" is the rest of the decode time: sampling,
verification, KV truncation and Python. Prefill is excluded (it is timed apart by the engine).

    python benchmarks/studies/profile_step.py --limit 2 --max-new-tokens 96 --weights torch-fp32mkl torch-fp32 llamacpp \
        --out benchmarks/results/profile_step.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmark programs, one folder up
from bench_tree import ForwardClock  # noqa: E402  (the same forward timers as the tree benchmark)

from quickdraft.evaluation.datasets import load_humaneval
from quickdraft.decoding.policies import Constant
from quickdraft.verification.sampling import SamplingParams


def profile(weights: str, prompts: list[list[int]], pipe, k: int, max_new: int) -> list[dict]:
    target, draft = ForwardClock(pipe.target), ForwardClock(pipe.draft)  # prefill (first forward) excluded
    rows = []
    for method in ("ar", "sd"):
        pipe.generate([""], prompt_ids=[prompts[0]], method=method, policy=Constant(k), max_new_tokens=4)  # warm-up
        totals = dict(decode=0.0, target=0.0, draft=0.0, target_calls=0, draft_calls=0, tokens=0)
        for ids in prompts:
            target.take(), draft.take()
            out = pipe.generate([""], prompt_ids=[ids], method=method, policy=Constant(k),
                                sampling=SamplingParams(), max_new_tokens=max_new, seed=0)
            m = out.metrics
            t_sec, t_calls = target.take()
            d_sec, d_calls = draft.take()
            totals["decode"] += m.decode_seconds
            totals["target"] += t_sec
            totals["draft"] += d_sec
            totals["target_calls"] += t_calls
            totals["draft_calls"] += d_calls
            totals["tokens"] += m.new_tokens
        other = totals["decode"] - totals["target"] - totals["draft"]
        rows.append({
            "weights": weights, "method": method, "k": k if method == "sd" else None,
            "new_tokens": totals["tokens"], "decode_seconds": totals["decode"],
            "tokens_per_second": totals["tokens"] / totals["decode"],
            "share_target": totals["target"] / totals["decode"], "share_draft": totals["draft"] / totals["decode"],
            "share_other": other / totals["decode"],
            "target_calls": totals["target_calls"], "draft_calls": totals["draft_calls"],
            "ms_per_target_call": 1000 * totals["target"] / max(1, totals["target_calls"]),
            "ms_per_draft_call": 1000 * totals["draft"] / max(1, totals["draft_calls"]),
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--weights", nargs="+", default=["torch-fp32mkl", "torch-fp32", "llamacpp"])
    parser.add_argument("--base-dtype", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/profile_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from bench_perf import load_pipelines  # the same model loading as the benchmark

    rows = []
    for weights in args.weights:  # one configuration at a time: memory holds one pair
        pipe = load_pipelines([f"{weights}-ar"], args.base_dtype)[weights]
        prompts = [pipe.encode_messages(p.messages) for p in load_humaneval()[: args.limit]]
        rows += profile(weights, prompts, pipe, args.k, args.max_new_tokens)
        del pipe
    result = {"command": "python benchmarks/studies/profile_step.py " + " ".join(sys.argv[1:]), "rows": rows,
              "threads": args.threads, "note": "prefill excluded; 'other' = decode time outside both models' forwards"}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
