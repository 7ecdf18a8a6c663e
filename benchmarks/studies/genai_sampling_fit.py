"""Does OpenVINO GenAI's speculative decoding sample from the target's distribution at T > 0?

A goodness-of-fit test of the first two new tokens against the target's exact joint law, for
three samplers of the same int8 target:

* ``genai-plain``: GenAI's own plain sampling (``LLMPipeline`` without a draft) — the control: it
  samples the target directly, so it must fit;
* ``genai-sd``: GenAI's speculative decoding with the int8 0.5B draft, ``num_assistant_tokens`` = K;
* ``quickdraft-sd``: quickdraft's ``sd`` on the OpenVINO backend with the same int8 pair (our
  export layout), rows of one batch drawing with their own keys.

The prompt asks for a random two-digit number, so both tokens are uncertain (Qwen writes digits one
token each) and the draft's law at the second token differs from the target's. The first new token
comes from the prefill in both engines; each call asks for three new tokens, so that each engine
drafts exactly one (K is capped by the tokens left; asked for two, GenAI drafts none), and the
second new token is the one a draft proposes and the target verifies. The exact law: the target's
distribution after the prompt, and after the prompt and each first token of probability above
``--min-first``, read from our int8 export in float32 arithmetic (``exact``); every pair outside
those cells is pooled into one.
Each sampler's pair counts are tested against it with Pearson's chi-square, cells expected below 5
pooled (:func:`quickdraft.evaluation.fit.chi_square_pvalue`). Both GenAI pipelines run the
speculative anchor's scheduler (:func:`quickdraft.evaluation.anchors.speculative_scheduler`: no
prefix cache, with which GenAI's speculative decoding at T > 0 raises and then drafts nothing);
every call prefills its whole prompt. A draw whose first token ends the answer falls in the
pooled cell.

    python benchmarks/studies/genai_sampling_fit.py --draws 300 --out benchmarks/results/genai_sampling_fit.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openvino_compression import _lscpu, _run_clock  # noqa: E402  (the studies' CPU and run record)

PROMPT = "Pick a random integer between 10 and 99. Reply with the number only."
ARMS = ("genai-plain", "genai-sd", "quickdraft-sd")


def exact_cells(target_dir: Path, ids: list[int], temperature: float, min_first: float) -> dict:
    """The target's law of the first two new tokens: ``{(t1, t2): p}`` for every ``t1`` of
    probability above ``min_first`` and every ``t2``, from our runner in exact arithmetic."""
    from quickdraft.backends.openvino.runner import OpenVINORunner

    runner = OpenVINORunner(target_dir, "target", exact=True)

    def law(tokens: list[int]) -> torch.Tensor:
        runner.reset(1)
        logits = runner.forward(torch.tensor([tokens]), logits_to_keep=1).logits[0, -1].double()
        return torch.softmax(logits / temperature, dim=-1)

    first = law(ids)
    cells = {}
    for t1 in torch.nonzero(first > min_first).flatten().tolist():
        second = law(ids + [t1])
        for t2 in torch.nonzero(second * first[t1] > 1e-7).flatten().tolist():
            cells[(t1, t2)] = float(first[t1] * second[t2])
    runner.close()
    return cells


def genai_draws(target_dir: Path, draft_dir: Path | None, ids: list[int], n: int, temperature: float,
                k: int, threads: int) -> tuple[list[tuple[int, int]], float]:
    """``n`` draws of GenAI's pipeline (seeds 0 … n-1), three new tokens each; the first two kept.
    With ``draft_dir`` the pipeline is the benchmark's speculative anchor itself; without, plain
    sampling on the same scheduler."""
    import openvino as ov
    import openvino_genai

    from quickdraft.evaluation.anchors import openvino_genai_pipeline, speculative_scheduler

    if draft_dir is None:
        pipe = openvino_genai.LLMPipeline(str(target_dir), "CPU", scheduler_config=speculative_scheduler(),
                                          INFERENCE_NUM_THREADS=threads)
    else:
        pipe = openvino_genai_pipeline(target_dir, draft_dir, n_threads=threads)
    prompt = ov.Tensor(np.asarray([ids], dtype=np.int64))
    out, start = [], time.perf_counter()
    for seed in range(n):
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = 3
        config.do_sample = True
        config.temperature = temperature
        config.top_p = 1.0
        config.top_k = 0
        config.rng_seed = seed
        if draft_dir is not None:
            config.num_assistant_tokens = k
        tokens = [int(t) for t in pipe.generate(prompt, config).tokens[0]]
        out.append((tokens[0], tokens[1] if len(tokens) > 1 else -1))
    return out, time.perf_counter() - start


def quickdraft_draws(ids: list[int], n: int, temperature: float, k: int, batch: int) -> tuple[list[tuple[int, int]], float]:
    """``n`` draws of quickdraft's ``sd`` on OpenVINO (the int8 pair), ``batch`` rows a call, seeds 0, 1, …"""
    from quickdraft.pipeline import Pipeline
    from quickdraft.verification.sampling import SamplingParams

    pipe = Pipeline.from_specs("target", "draft", backend="openvino", quantize="int8")
    sampling = SamplingParams(temperature=temperature)
    out, start, seed = [], time.perf_counter(), 0
    while len(out) < n:
        rows = min(batch, n - len(out))
        result = pipe.generate([""] * rows, prompt_ids=[ids] * rows, method="sd", k=k, sampling=sampling,
                               max_new_tokens=3, seed=seed)
        for c in result.completions:
            out.append((c.token_ids[0], c.token_ids[1] if len(c.token_ids) > 1 else -1))
        seed += 1
    return out, time.perf_counter() - start


def fit_report(draws: list[tuple[int, int]], cells: dict, decode) -> dict:
    """Counts in the exact cells (plus one pooled cell), the chi-square p-value and the most
    frequent pairs drawn (text, share, exact probability)."""
    from collections import Counter

    from quickdraft.evaluation.fit import chi_square_pvalue

    keys = list(cells)
    index = {c: i for i, c in enumerate(keys)}
    counts = np.zeros(len(keys) + 1)
    for pair in draws:
        counts[index.get(pair, len(keys))] += 1
    probs = np.append(np.array([cells[c] for c in keys]), max(0.0, 1.0 - sum(cells.values())))
    order = np.argsort(-probs[:-1])[:8]
    return {
        "draws": len(draws),
        "p_value": chi_square_pvalue(counts, probs),
        "total_variation_empirical": float(0.5 * np.abs(counts / counts.sum() - probs).sum()),
        "top_cells": [{"pair": list(keys[i]), "exact": round(float(probs[i]), 4),
                       "observed": round(float(counts[i] / counts.sum()), 4)} for i in order],
        "most_drawn": [{"text": decode(pair), "share": round(c / len(draws), 4), "exact": round(cells.get(pair, 0.0), 4)}
                       for pair, c in Counter(draws).most_common(8)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=300, help="draws per sampler")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (GenAI's num_assistant_tokens)")
    ap.add_argument("--min-first", type=float, default=1e-3, help="first tokens of the exact law's own cells")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    ap.add_argument("--batch", type=int, default=16, help="rows per quickdraft call")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/genai_sampling_fit.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from quickdraft.backends.openvino import export_for

    genai = {role: export_for(role, "int8", layout="genai") for role in ("target", "draft")}
    engine_target = export_for("target", "int8")
    tokenizer = AutoTokenizer.from_pretrained(engine_target)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    result = {"command": "python benchmarks/studies/genai_sampling_fit.py " + " ".join(sys.argv[1:]),
              "machine": {**_lscpu(), **_run_clock(), "threads": args.threads},
              "prompt": PROMPT, "prompt_tokens": len(ids), "temperature": args.temperature, "k": args.k}
    cells = exact_cells(engine_target, ids, args.temperature, args.min_first)
    result["exact"] = {"cells": len(cells), "mass_in_cells": sum(cells.values())}
    result["arms"] = {}
    for arm in args.arms:
        if arm == "quickdraft-sd":
            draws, seconds = quickdraft_draws(ids, args.draws, args.temperature, args.k, args.batch)
        else:
            draws, seconds = genai_draws(genai["target"], genai["draft"] if arm == "genai-sd" else None, ids,
                                         args.draws, args.temperature, args.k, args.threads)
        result["arms"][arm] = {**fit_report(draws, cells, lambda pair: tokenizer.decode([t for t in pair if t >= 0])), "seconds": round(seconds, 1)}
        print(arm, json.dumps({k: v for k, v in result["arms"][arm].items() if k not in ("top_cells", "most_drawn")}), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
