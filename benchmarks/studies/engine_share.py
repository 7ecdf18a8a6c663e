"""The engine's share of a decoding step on the openvino backend: everything outside the two
runtimes' inference calls, at T = 0 and T > 0, with the inverse-CDF sampler and, as the control in
the same run, ``torch.multinomial`` (the sampler it replaced).

For each configuration, prompt and sampler: one ``Pipeline.generate`` of ``--max-new-tokens``
tokens (a warm-up run first); the engine's time is the generation's time (prefill and decode)
minus the time both runners spent inside inference calls (``OpenVINORunner.infer_seconds``), as
``bench_perf.py`` counts it. Rows are interleaved prompt by prompt, samplers alternating, in one
process. Targets: ``int8`` is the default configuration (int8 target, int4 draft with the
49,152-id head); ``int4`` the int4 target with the same draft.

    python benchmarks/studies/engine_share.py --out benchmarks/results/engine_share.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from quickdraft import Pipeline, SamplingParams
from quickdraft.evaluation.datasets import load_humaneval, load_mtbench
from quickdraft.verification import sampling as sampling_module

from openvino_compression import _lscpu  # the studies' CPU record (this script's folder is on sys.path)


def multinomial_sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The control: ``torch.multinomial`` over the same rows."""
    flat = probs.reshape(-1, probs.shape[-1]).float()
    return torch.multinomial(flat, 1, generator=generator).squeeze(-1).reshape(probs.shape[:-1])


SAMPLERS = {"inverse_cdf": sampling_module.sample, "multinomial": multinomial_sample}


def use_sampler(name: str) -> None:
    """Point every module that imported ``sample`` at the chosen sampler."""
    fn = SAMPLERS[name]
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("quickdraft") and getattr(module, "sample", None) in SAMPLERS.values():
            module.sample = fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantize", nargs="+", default=["int8", "int4"], help="target weights (the draft: int4, 49,152 ids)")
    ap.add_argument("--prompts", type=int, default=2, help="per dataset (HumanEval, MT-Bench)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    records = []
    for quantize in args.quantize:
        pipe = (Pipeline.from_specs("target", "draft", backend="openvino") if quantize == "int8" else
                Pipeline.from_specs("target", "draft", backend="openvino", quantize=quantize, quantize_draft="int4",
                                    draft_vocab=49152))
        prompts = [(p.id, pipe.encode_messages(p.messages)) for loader in (load_humaneval, load_mtbench)
                   for p in loader(args.prompts)]
        pipe.generate([], prompt_ids=[prompts[0][1]], method="sd", k=args.k, max_new_tokens=16)  # warm-up
        for i, (pid, ids) in enumerate(prompts):
            for temperature in args.temperatures:
                names = list(SAMPLERS) if temperature > 0 else ["inverse_cdf"]  # T = 0 samples nothing
                for name in names if i % 2 == 0 else names[::-1]:
                    use_sampler(name)
                    before = pipe.target.infer_seconds + pipe.draft.infer_seconds
                    out = pipe.generate([], prompt_ids=[ids], method="sd", k=args.k, seed=i,
                                        sampling=SamplingParams(temperature=temperature),
                                        max_new_tokens=args.max_new_tokens)
                    m = out.metrics
                    infer = pipe.target.infer_seconds + pipe.draft.infer_seconds - before
                    total = m.prefill_seconds + m.decode_seconds
                    rec = {"quantize": quantize, "prompt_id": pid, "temperature": temperature, "sampler": name,
                           "new_tokens": m.new_tokens, "steps": m.steps, "seconds": total,
                           "decode_seconds": m.decode_seconds, "runtime_seconds": infer, "engine_seconds": total - infer}
                    rec["engine_share"] = rec["engine_seconds"] / total
                    records.append(rec)
                    print(f"{quantize} {pid} T={temperature:g} {name}: {m.new_tokens / m.decode_seconds:.2f} tok/s, "
                          f"engine {rec['engine_share']:.1%} ({rec['engine_seconds'] / max(1, m.steps) * 1e3:.1f} ms/step)",
                          flush=True)
        use_sampler("inverse_cdf")
        del pipe
    summary = {}
    for r in records:
        key = f"{r['quantize']} T={r['temperature']:g} {r['sampler']}"
        s = summary.setdefault(key, {"seconds": 0.0, "decode_seconds": 0.0, "engine_seconds": 0.0, "steps": 0,
                                     "new_tokens": 0})
        for f in ("seconds", "decode_seconds", "engine_seconds", "steps", "new_tokens"):
            s[f] += r[f]
    for key, s in summary.items():
        s["engine_share"] = s["engine_seconds"] / s["seconds"]
        s["engine_ms_per_step"] = s["engine_seconds"] / s["steps"] * 1e3
        s["tokens_per_second"] = s["new_tokens"] / s["seconds"]
        print(f"{key}: engine {s['engine_share']:.1%}, {s['engine_ms_per_step']:.1f} ms/step, {s['tokens_per_second']:.2f} tok/s")
    Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv),
                                          "machine": {**_lscpu(), "threads": args.threads},
                                          "summary": summary, "records": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
