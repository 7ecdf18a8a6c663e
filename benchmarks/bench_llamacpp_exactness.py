"""How far greedy speculative output on the llama.cpp backend departs from plain greedy output.

llama.cpp's CPU kernels depend on the number of tokens in one ``llama_decode``, so verifying a
block of K+1 tokens does not give bitwise the logits of decoding them one by one (see
:mod:`quickdraft.backends.llamacpp`). On the first N HumanEval prompts (as chat, greedy,
``--max-new-tokens`` tokens, EOS ignored so every run has the same length), for the target
runner in its default mode and in exact mode:

* ``ar``          plain greedy decoding with our engine (the reference of the row);
* ``sd-k{K}``     chain speculative decoding with the default draft (0.5B, default kernels);
* ``ngram-k{K}``  prompt lookup;
* ``anchor``      llama.cpp's own plain greedy decoding (``anchors.llamacpp_generate``, default
  kernels, whole prompt in one call), compared with the default mode's ``ar``.

Each output is compared with ``ar`` of the same mode: identical or not, and the index of the first
differing token. With ``--timing-rounds R`` it also times 1- and 5-token target forwards after a
180-token prefix in both modes, interleaved (R rounds of 4 each), for the cost of exact mode.
Raw rows and a summary go to --out.

    python benchmarks/bench_llamacpp_exactness.py --limit 5 --max-new-tokens 128
    python benchmarks/bench_llamacpp_exactness.py --limit 0 --timing-rounds 6 --out benchmarks/results/llamacpp_exact_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from quickdraft.evaluation.anchors import llamacpp_generate
from quickdraft.backends.llamacpp import LlamaCppRunner, gguf_path_for, load_llamacpp
from quickdraft.evaluation.datasets import load_humaneval
from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter
from quickdraft.decoding.engine import generate
from quickdraft.decoding.policies import Constant
from quickdraft.verification.sampling import SamplingParams


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (``None`` when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def cpu_description() -> dict:
    info = {"machine": platform.machine()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return info
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("Model name", "CPU(s)", "Flags"):
            info[key.strip()] = value.strip()
    return info


def time_forwards(gguf, args: argparse.Namespace) -> dict:
    """Median and minimum milliseconds of 1- and 5-token forwards in both modes, interleaved."""
    import statistics

    runners = {mode: LlamaCppRunner(gguf, "target", n_ctx=512, n_threads=args.threads, exact=mode == "exact")
               for mode in ("default", "exact")}
    prefix = torch.arange(1000, 1180).unsqueeze(0)
    times: dict[str, dict[int, list[float]]] = {mode: {1: [], 5: []} for mode in runners}
    for runner in runners.values():
        runner.reset(1)
        runner.forward(prefix, logits_to_keep=1)
    for _ in range(args.timing_rounds):
        for mode, runner in runners.items():
            for m in (1, 5):
                for _ in range(4):
                    t0 = time.perf_counter()
                    runner.forward(torch.arange(2000, 2000 + m).unsqueeze(0))
                    times[mode][m].append(time.perf_counter() - t0)
                    runner.truncate(torch.tensor([prefix.shape[1]]))
    for runner in runners.values():
        runner.close()
    return {mode: {f"{m}_token_ms": {"median": round(1000 * statistics.median(v), 1), "min": round(1000 * min(v), 1),
                                      "n": len(v)} for m, v in per.items()} for mode, per in times.items()}


def run(args: argparse.Namespace) -> dict:
    import llama_cpp

    torch.set_num_threads(args.threads)
    draft, tokenizer = load_llamacpp(args.draft, "draft", n_threads=args.threads, exact=False)
    target_gguf = gguf_path_for(args.target)
    vocab = draft.vocab_size
    prompts = []
    for problem in (load_humaneval(args.limit) if args.limit else []):
        ids = tokenizer.apply_chat_template(problem.messages, add_generation_prompt=True, tokenize=True)
        prompts.append((problem.id, list(ids["input_ids"] if hasattr(ids, "keys") else ids)))
    rows = []
    for exact in args.modes:
        target = LlamaCppRunner(target_gguf, "target", vocab_size=vocab, n_threads=args.threads, exact=exact)
        for pid, ids in prompts:
            outputs, seconds = {}, {}
            runs = [("ar", dict(method="ar"))]
            runs += [(f"sd-k{k}", dict(method="sd", drafter=ModelDrafter(draft, vocab), policy=Constant(k)))
                     for k in args.ks]
            runs += [(f"ngram-k{k}", dict(method="ngram", drafter=NGramDrafter(vocab), policy=Constant(k)))
                     for k in args.ks]
            for label, kwargs in runs:
                t0 = time.perf_counter()
                out = generate(target, [ids], max_new_tokens=args.max_new_tokens, eos_token_ids=set(), **kwargs)
                seconds[label] = time.perf_counter() - t0
                outputs[label] = out.sequences[0]
            if not exact and args.anchor:
                t0 = time.perf_counter()
                res = llamacpp_generate(target_gguf, ids, sampling=SamplingParams(), max_new_tokens=args.max_new_tokens,
                                        eos_token_ids=set(), n_threads=args.threads)
                seconds["anchor"] = time.perf_counter() - t0
                outputs["anchor"] = res.new_ids
            for label, new_ids in outputs.items():
                div = first_divergence(new_ids, outputs["ar"])
                rows.append(dict(mode="exact" if exact else "default", prompt=pid, prompt_tokens=len(ids),
                                 method=label, identical_to_ar=div is None, first_divergence=div,
                                 new_tokens=len(new_ids), seconds=round(seconds[label], 2), new_ids=new_ids))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "new_ids"}), flush=True)
        target.close()
    forward_ms = time_forwards(target_gguf, args) if args.timing_rounds else None
    summary = []
    for mode in sorted({r["mode"] for r in rows}):
        for method in dict.fromkeys(r["method"] for r in rows if r["mode"] == mode):
            if method == "ar":
                continue
            sel = [r for r in rows if r["mode"] == mode and r["method"] == method]
            divs = [r["first_divergence"] for r in sel if r["first_divergence"] is not None]
            summary.append(dict(mode=mode, method=method, prompts=len(sel),
                                identical=sum(r["identical_to_ar"] for r in sel),
                                first_divergences=divs, seconds=round(sum(r["seconds"] for r in sel), 1)))
    ar_seconds = {mode: round(sum(r["seconds"] for r in rows if r["mode"] == mode and r["method"] == "ar"), 1)
                  for mode in {r["mode"] for r in rows}}
    return dict(args=vars(args), cpu=cpu_description(), llama_cpp_python=llama_cpp.__version__,
                system_info=llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
                ar_seconds=ar_seconds, forward_ms=forward_ms, summary=summary, rows=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="target")
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ks", type=int, nargs="+", default=[4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--modes", default="default,exact",
                    help="comma-separated: default (repacked weights, llama.cpp's default attention), exact")
    ap.add_argument("--timing-rounds", type=int, default=0)
    ap.add_argument("--no-anchor", dest="anchor", action="store_false")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/llamacpp_exactness.json"))
    args = ap.parse_args()
    args.modes = [m.strip() == "exact" for m in args.modes.split(",") if m.strip()]
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result["args"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in result["args"].items()}
    result["args"]["modes"] = ["exact" if m else "default" for m in args.modes]
    args.out.write_text(json.dumps(result, indent=1))
    for line in result["summary"]:
        print(json.dumps(line))


if __name__ == "__main__":
    main()
