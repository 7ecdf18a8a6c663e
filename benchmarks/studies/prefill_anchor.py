"""Does the engine's prefill cost more than GenAI's? The time to read a prompt, ours against
OpenVINO GenAI's, on the same prompts and the same int8 weights, interleaved in one process.

Per prompt and round: GenAI's plain pipeline generating one token (after an untimed call on an
unrelated prompt, so that its prefix cache holds nothing of this one), GenAI's speculative
pipeline generating one token and two tokens (without a prefix cache:
:func:`quickdraft.evaluation.anchors.speculative_scheduler`), then the engine's target runner and
draft runner each reading the whole prompt (one forward, the last column's logits). The first
round warms up and is left out of the medians. GenAI's one-token call is its prefill plus one
sampling; the engine's ``sd`` reads the prompt into both models before its first step.

    python benchmarks/studies/prefill_anchor.py --out benchmarks/results/prefill_anchor_avx2.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the benchmark programs
from openvino_compression import _lscpu, _run_clock  # noqa: E402  (the studies' CPU and run record)


def genai_call(pipeline, ids: list[int], new_tokens: int, speculative: bool) -> float:
    """Seconds of one greedy GenAI ``generate`` of ``new_tokens`` tokens after ``ids``, as the
    benchmark's anchor makes it (the plain pipeline's untimed flush call first)."""
    from quickdraft.evaluation.anchors import openvino_genai_generate
    from quickdraft.verification.sampling import SamplingParams

    return openvino_genai_generate(pipeline, ids, sampling=SamplingParams(), max_new_tokens=new_tokens,
                                   eos_token_ids=set(), num_assistant_tokens=4 if speculative else None).seconds


def engine_prefill(runner, ids: list[int]) -> float:
    """Seconds of the engine's runner reading ``ids`` into an empty cache."""
    runner.reset(1)
    start = time.perf_counter()
    runner.forward(torch.tensor([ids]), logits_to_keep=1)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=3, help="first HumanEval problems (140-179 prompt tokens with the chat template for 3)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds per prompt, the first a warm-up")
    ap.add_argument("--out", default="benchmarks/results/prefill_anchor_avx2.json")
    args = ap.parse_args()
    clock = _run_clock()
    from bench_perf import genai_pipelines, load_pipelines
    from quickdraft.backends.threads import runtime_threads
    from quickdraft.evaluation.datasets import load_humaneval

    pipe = load_pipelines(["openvino-int8/int8-sd"], "auto")["openvino-int8/int8"]
    genai = genai_pipelines("int8", plain=True, speculative=True)
    samples: dict[str, dict[str, list[float]]] = {}
    prompt_tokens: dict[str, int] = {}
    for problem in load_humaneval()[: args.limit]:
        ids = pipe.encode_messages(problem.messages)
        prompt_tokens[problem.id] = len(ids)
        for round_ in range(args.rounds):
            row = {
                "genai_plain_1_token": genai_call(genai.plain, ids, 1, speculative=False),
                "genai_speculative_1_token": genai_call(genai.speculative, ids, 1, speculative=True),
                "genai_speculative_2_tokens": genai_call(genai.speculative, ids, 2, speculative=True),
                "engine_target_prefill": engine_prefill(pipe.target, ids),
                "engine_draft_prefill": engine_prefill(pipe.draft, ids),
            }
            print(problem.id, len(ids), round_, {k: round(v, 3) for k, v in row.items()}, flush=True)
            if round_:
                for key, value in row.items():
                    samples.setdefault(problem.id, {}).setdefault(key, []).append(value)
    medians = {pid: {k: float(np.median(v)) for k, v in rows.items()} for pid, rows in samples.items()}
    keys = next(iter(medians.values())).keys()
    overall = {k: float(np.median([s for rows in samples.values() for s in rows[k]])) for k in keys}
    result = {
        "command": "python benchmarks/studies/prefill_anchor.py " + " ".join(sys.argv[1:]),
        "machine": {**_lscpu(), "threads": runtime_threads()}, **clock,
        "loadavg_after": os.getloadavg(),
        "prompt_tokens": prompt_tokens,
        "median_seconds": medians, "median_seconds_all": overall,
        "engine_target_over_genai_plain": overall["engine_target_prefill"] / overall["genai_plain_1_token"],
        "samples_s": samples,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: round(v, 3) for k, v in overall.items()}), flush=True)


if __name__ == "__main__":
    main()
