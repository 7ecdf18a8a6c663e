"""Adaptive draft length on the default pair: SpecDec++ vs fixed K vs Heuristic vs Confidence.

Every configuration decodes every prompt (B = 1) in one process, interleaved prompt by prompt (the
configurations' order rotates from prompt to prompt, so slow phases of a shared machine do not
fall on one configuration), after a warm-up. The unit of work is a *block*: one prompt of one
dataset at one temperature, decoded by every configuration. Blocks run in rounds (prompt ``i`` of
each dataset at each temperature, T = 0 first), and the JSON is rewritten after every run, so a run
that is killed still leaves its results. ``--max-seconds`` (wall time of the whole process, model
loading and warm-up included) starts no block that would end after the budget, estimated from the
mean block time so far: within a dataset x temperature cell every configuration always has the
same prompts. Reported per dataset x temperature x configuration:

* ``tokens_per_s``         new tokens / decode seconds (prefill excluded), summed over prompts;
* ``target_calls_per_token`` verification steps (target forwards after prefill) per new token;
* ``discarded_per_token``  drafted-but-rejected draft tokens per new token;
* ``mean_draft_len``       drafted tokens per step.

SpecDec++ reads the head trained at the run's temperature (``--head-template``, ``{t}`` = the
temperature, e.g. ``...-t0.pt`` / ``...-t0.7.pt``; ``quickdraft train-head --temperature 0
--temperature 0.7`` writes both). ``Confidence`` reads the draft's unwarped distribution, which
the drafter hands every policy (meaningful at temperature 0 too).

Re-run the committed numbers with the command stored in the result JSON (``meta.command``; see
``--help``; the raw per-run records are in the JSON next to the summary).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from quickdraft.evaluation.datasets import load_humaneval, load_mtbench
from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.decoding.head import load_head
from quickdraft.adaptive.headtrain import DEFAULT_HEAD_PATH, head_path_for
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Confidence, Constant, Heuristic, SpecDecPP
from quickdraft.evaluation.report import plot_adaptive
from quickdraft.verification.sampling import SamplingParams

HEAD_TEMPLATE = str(head_path_for(DEFAULT_HEAD_PATH, 0.0, True)).replace("-t0.pt", "-t{t}.pt")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per dataset (the first N of each)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--datasets", nargs="+", choices=["humaneval", "mtbench"], default=["humaneval", "mtbench"])
    ap.add_argument("--fixed-k", type=int, nargs="+", default=list(range(1, 11)))
    ap.add_argument("--thresholds", type=float, nargs="+", default=None,
                    help="SpecDec++ h (default: the head's suggested_thresholds, i.e. the best h of the offline "
                         "estimate on its held-out prompts and its neighbours +-0.1)")
    ap.add_argument("--max-k", type=int, default=10, help="max draft length of the adaptive policies")
    ap.add_argument("--p-min", type=float, default=0.5, help="Confidence policy threshold")
    ap.add_argument("--head-template", default=HEAD_TEMPLATE,
                    help="head file per temperature; {t} is replaced by the temperature (%%g)")
    ap.add_argument("--no-ar", action="store_true", help="skip the plain-decoding baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="model dtype: auto (bf16 where supported), bfloat16, float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-seconds", "--time-budget", dest="max_seconds", type=float, default=0.0,
                    help="wall-time budget of the whole process in seconds (loading and warm-up included): start no "
                         "block (one prompt of one dataset at one temperature, every configuration) that would end "
                         "after it, estimated from the mean block time so far (0 = no limit)")
    ap.add_argument("--warmup-tokens", type=int, default=8, help="tokens per warm-up run (every configuration once)")
    ap.add_argument("--out", default="benchmarks/results/adaptive_default_pair.json")
    return ap.parse_args()


def configurations(args, head) -> list[tuple[str, object]]:
    """(name, policy factory or None for plain decoding); a fresh policy per run."""
    configs: list[tuple[str, object]] = [] if args.no_ar else [("ar", None)]
    configs += [(f"fixed_k{k}", (lambda k=k: Constant(k))) for k in args.fixed_k]
    configs.append(("heuristic", lambda: Heuristic(initial_k=4, max_k=args.max_k)))
    configs.append((f"confidence_p{args.p_min}", lambda: Confidence(p_min=args.p_min, max_k=args.max_k)))
    thresholds = args.thresholds or head.metadata.extra.get("suggested_thresholds") or [0.3, 0.5, 0.7]
    configs += [(f"specdecpp_h{h:g}", (lambda h=h: SpecDecPP(head, threshold=h, max_k=args.max_k)))
                for h in thresholds]
    return configs


def run_one(pipe, ids, factory, sampling, max_new_tokens, seed) -> dict:
    if factory is None:
        out = generate(pipe.target, [ids], method="ar", sampling=sampling, max_new_tokens=max_new_tokens,
                       seed=seed, eos_token_ids=pipe.eos_ids())
    else:
        out = generate(pipe.target, [ids], method="sd", drafter=ModelDrafter(pipe.draft, pipe.vocab_size),
                       policy=factory(), sampling=sampling, max_new_tokens=max_new_tokens, seed=seed,
                       eos_token_ids=pipe.eos_ids())
    m = out.batch_metrics
    return {
        "new_tokens": m.new_tokens, "decode_seconds": m.decode_seconds, "steps": m.steps,
        "drafted": m.drafted_tokens, "accepted": m.accepted_tokens, "draft_forwards": m.draft_forwards,
        "tokens": out.sequences[0],
    }


def summarise(records: list[dict]) -> dict:
    new = sum(r["new_tokens"] for r in records)
    secs = sum(r["decode_seconds"] for r in records)
    steps = sum(r["steps"] for r in records)
    drafted = sum(r["drafted"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    return {
        "runs": len(records), "new_tokens": new, "decode_seconds": secs,
        "tokens_per_s": new / secs if secs else 0.0,
        "target_calls_per_token": steps / new if new else 0.0,
        "discarded_per_token": (drafted - accepted) / new if new else 0.0,
        "mean_draft_len": drafted / steps if steps else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_prompt_tokens_per_s": [r["new_tokens"] / r["decode_seconds"] for r in records],
    }


def cpu_info() -> dict:
    """CPU model and the instruction-set flags that decide the fast dtype (Linux ``/proc/cpuinfo``)."""
    info = {"machine": platform.machine(), "processor": platform.processor()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name") and "model_name" not in info:
            info["model_name"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))
            info["native_bf16"] = bool({"avx512_bf16", "amx_bf16"} & flags)
            break
    return info


def main() -> None:
    t_process = time.perf_counter()
    args = parse_args()
    torch.set_num_threads(args.threads)
    pipe = Pipeline.from_specs("target", "draft", dtype=args.dtype)
    load_seconds = time.perf_counter() - t_process
    heads = {}
    for temperature in args.temperatures:
        path = args.head_template.format(t=f"{temperature:g}")
        heads[temperature] = load_head(path, draft_name="draft")
        heads[temperature].check_draft(pipe.draft_model, "the default draft")
        if heads[temperature].metadata.temperature != temperature:
            print(f"warning: {path} was trained with labels at T={heads[temperature].metadata.temperature}, "
                  f"used at T={temperature}", flush=True)
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
    data = {name: loaders[name](args.prompts) for name in args.datasets}
    prompt_ids = {ds: [(p.id, pipe.encode_messages(p.messages)) for p in ps] for ds, ps in data.items()}
    configs = {t: configurations(args, heads[t]) for t in args.temperatures}
    names = list(dict.fromkeys(c for t in args.temperatures for c, _ in configs[t]))

    # warm-up: every configuration once, not recorded
    t0 = time.perf_counter()
    warm = pipe.encode("Write a Python function that reverses a string.")
    for name, factory in configs[args.temperatures[-1]]:
        run_one(pipe, warm, factory, SamplingParams(temperature=args.temperatures[-1]), args.warmup_tokens, 0)
    warmup_seconds = time.perf_counter() - t0

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    meta = {
        "script": "benchmarks/bench_adaptive.py", "command": "python " + " ".join(sys.argv), "args": vars(args),
        "torch": torch.__version__, "threads": args.threads, "cpu": cpu_info(),
        "dtype_requested": args.dtype, "dtype": str(pipe.target_model.dtype),
        "draft_dtype": str(pipe.draft_model.dtype),
        "load_seconds": load_seconds, "warmup_seconds": warmup_seconds,
        "heads": {f"T={t:g}": {"path": args.head_template.format(t=f"{t:g}"), **h.metadata.__dict__}
                  for t, h in heads.items()},
        "prompts": {ds: [pid for pid, _ in plist] for ds, plist in prompt_ids.items()},
        "configs": names,
        "configs_by_temperature": {f"{t:g}": [c for c, _ in configs[t]] for t in args.temperatures},
        "note": "B = 1, every configuration on every prompt, interleaved prompt by prompt with rotating "
                "configuration order, one process, after warm-up; run with no other "
                "heavy job on the machine, tokens/s = new tokens / decode seconds (prefill excluded)",
        "blocks_completed": 0, "complete": False,
    }
    t_start = time.perf_counter()
    run_index = 0
    block_seconds: list[float] = []
    n_prompts = min(len(v) for v in prompt_ids.values())
    blocks = [(pi, t, ds) for pi in range(n_prompts) for t in args.temperatures for ds in prompt_ids]
    for bi, (pi, temperature, ds) in enumerate(blocks):
        if args.max_seconds:
            elapsed = time.perf_counter() - t_process
            mean_block = sum(block_seconds) / len(block_seconds) if block_seconds else 0.0
            if elapsed + mean_block > args.max_seconds:
                meta["stopped_by_time_budget"] = (f"after {bi} of {len(blocks)} blocks ({elapsed:.0f} s of "
                                                  f"{args.max_seconds:.0f} s, mean block {mean_block:.0f} s)")
                print(meta["stopped_by_time_budget"], flush=True)
                break
        t_block = time.perf_counter()
        sampling = SamplingParams(temperature=temperature)
        cfgs = configs[temperature]
        pid, ids = prompt_ids[ds][pi]
        order = cfgs[run_index % len(cfgs):] + cfgs[: run_index % len(cfgs)]
        run_index += 1
        for name, factory in order:
            rec = run_one(pipe, ids, factory, sampling, args.max_new_tokens, args.seed + pi)
            rec.update(dataset=ds, prompt_id=pid, temperature=temperature, config=name)
            records.append(rec)
            print(f"[{time.perf_counter() - t_start:6.0f}s] T={temperature} {ds} {pid} {name:18s} "
                  f"{rec['new_tokens'] / rec['decode_seconds']:5.2f} tok/s  steps {rec['steps']}", flush=True)
            meta["seconds"] = time.perf_counter() - t_start
            _write(out_path, meta, records, args)  # after every run: a killed run still leaves a JSON
        block_seconds.append(time.perf_counter() - t_block)
        meta["blocks_completed"] = bi + 1
    meta["complete"] = meta["blocks_completed"] == len(blocks)
    meta["seconds"] = time.perf_counter() - t_start
    meta["process_seconds"] = time.perf_counter() - t_process
    _write(out_path, meta, records, args)
    result = json.loads(out_path.read_text())
    if plot_adaptive(result["summary"], out_path.with_suffix(".png")):
        print(f"plot: {out_path.with_suffix('.png')}")
    print(json.dumps(result["verdict"], indent=1))


def _write(path: Path, meta: dict, records: list[dict], args) -> None:
    summary: dict = {}
    verdict: dict = {}
    for temperature in args.temperatures:
        for ds in args.datasets:
            key = f"{ds}@T={temperature}"
            # only prompts every configuration of the cell has finished (a killed run may stop mid-block)
            wanted = meta["configs_by_temperature"][f"{temperature:g}"]
            mine = [r for r in records if r["dataset"] == ds and r["temperature"] == temperature]
            done = {pid for pid in {r["prompt_id"] for r in mine}
                    if {r["config"] for r in mine if r["prompt_id"] == pid} >= set(wanted)}
            cell = {}
            for name in wanted:
                recs = [r for r in mine if r["config"] == name and r["prompt_id"] in done]
                if recs:
                    cell[name] = summarise(recs)
            if not cell:
                continue
            summary[key] = cell
            fixed = {n: s for n, s in cell.items() if n.startswith("fixed_k")}
            sdpp = {n: s for n, s in cell.items() if n.startswith("specdecpp")}
            if fixed and sdpp:
                best_fixed = max(fixed, key=lambda n: fixed[n]["tokens_per_s"])
                best_sdpp = max(sdpp, key=lambda n: sdpp[n]["tokens_per_s"])
                gain = sdpp[best_sdpp]["tokens_per_s"] / fixed[best_fixed]["tokens_per_s"] - 1
                base = fixed[best_fixed]["tokens_per_s"]
                verdict[key] = {
                    "best_fixed": best_fixed, "best_fixed_tokens_per_s": base,
                    "best_specdecpp": best_sdpp, "best_specdecpp_tokens_per_s": sdpp[best_sdpp]["tokens_per_s"],
                    "gain_over_best_fixed": gain, "goal_10pct_met": gain >= 0.10,
                    "gain_over_best_fixed_by_config": {n: c["tokens_per_s"] / base - 1 for n, c in cell.items()
                                                       if not n.startswith("fixed_k")},
                    "prompts": cell[best_sdpp]["runs"],
                    "note": "best fixed K and best threshold are both chosen on these same runs",
                }
    tmp = path.with_name(path.name + ".tmp")  # write then rename: a kill mid-write keeps the last JSON
    tmp.write_text(json.dumps({"meta": meta, "verdict": verdict, "summary": summary, "records": records}, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    main()
