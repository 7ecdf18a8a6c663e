"""Adaptive draft length on the default pair: SpecDec++ vs fixed K vs Heuristic vs Confidence.

Every configuration decodes every prompt (B = 1) in one process, interleaved prompt by prompt (the
configurations' order rotates from prompt to prompt, so slow phases of a shared machine do not
fall on one configuration), after a warm-up. Reported per dataset x temperature x configuration:

* ``tokens_per_s``         new tokens / decode seconds (prefill excluded), summed over prompts;
* ``target_calls_per_token`` verification steps (target forwards after prefill) per new token;
* ``discarded_per_token``  drafted-but-rejected draft tokens per new token;
* ``mean_draft_len``       drafted tokens per step.

Re-run the committed numbers with::

    python benchmarks/bench_adaptive.py --prompts 2 --max-new-tokens 64 \\
        --out benchmarks/results/adaptive_default_pair.json

(see ``--help``; the raw per-run records are in the JSON next to the summary).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from quickdraft.datasets import load_humaneval, load_mtbench
from quickdraft.drafters import ModelDrafter
from quickdraft.engine import generate
from quickdraft.head import load_head
from quickdraft.headtrain import DEFAULT_HEAD_PATH
from quickdraft.pipeline import Pipeline
from quickdraft.policies import Confidence, Constant, Heuristic, SpecDecPP
from quickdraft.sampling import SamplingParams


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per dataset (the first N of each)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--fixed-k", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 10])
    ap.add_argument("--thresholds", type=float, nargs="+", default=[0.3, 0.5, 0.7], help="SpecDec++ h")
    ap.add_argument("--max-k", type=int, default=10, help="max draft length of the adaptive policies")
    ap.add_argument("--p-min", type=float, default=0.5, help="Confidence policy threshold")
    ap.add_argument("--head", default=DEFAULT_HEAD_PATH)
    ap.add_argument("--no-ar", action="store_true", help="skip the plain-decoding baseline")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/adaptive_default_pair.json")
    return ap.parse_args()


def configurations(args, head, lm_head) -> list[tuple[str, object]]:
    """(name, policy factory or None for plain decoding); a fresh policy per run."""
    configs: list[tuple[str, object]] = [] if args.no_ar else [("ar", None)]
    configs += [(f"fixed_k{k}", (lambda k=k: Constant(k))) for k in args.fixed_k]
    configs.append(("heuristic", lambda: Heuristic(initial_k=4, max_k=args.max_k)))
    configs.append((f"confidence_p{args.p_min}", lambda: Confidence(p_min=args.p_min, max_k=args.max_k,
                                                                     output_head=lm_head)))
    configs += [(f"specdecpp_h{h}", (lambda h=h: SpecDecPP(head, threshold=h, max_k=args.max_k)))
                for h in args.thresholds]
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


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    pipe = Pipeline.from_specs("target", "draft")
    head = load_head(args.head, draft_name="draft")
    head.check_draft(pipe.draft_model, "the default draft")
    lm_head = pipe.draft_model.get_output_embeddings()
    data = {"humaneval": load_humaneval(args.prompts), "mtbench": load_mtbench(args.prompts)}
    prompt_ids = {ds: [(p.id, pipe.encode(p.messages[0]["content"])) for p in ps] for ds, ps in data.items()}
    configs = configurations(args, head, lm_head)

    # warm-up: every code path once, not recorded
    warm = pipe.encode("Write a Python function that reverses a string.")
    for name, factory in configs[:: max(1, len(configs) // 4)]:
        run_one(pipe, warm, factory, SamplingParams(temperature=0.7), 8, 0)

    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    meta = {
        "script": "benchmarks/bench_adaptive.py", "args": vars(args), "torch": torch.__version__,
        "threads": args.threads, "machine": platform.machine(), "head_metadata": head.metadata.__dict__,
        "configs": [c for c, _ in configs],
        "note": "B = 1, interleaved prompt by prompt with rotating configuration order, one process, after warm-up; "
                "the machine's 2 cores were shared with other jobs, so tokens/s are noisy",
    }
    t_start = time.perf_counter()
    run_index = 0
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature)
        for ds, plist in prompt_ids.items():
            for pi, (pid, ids) in enumerate(plist):
                order = configs[run_index % len(configs):] + configs[: run_index % len(configs)]
                run_index += 1
                for name, factory in order:
                    rec = run_one(pipe, ids, factory, sampling, args.max_new_tokens, args.seed + pi)
                    rec.update(dataset=ds, prompt_id=pid, temperature=temperature, config=name)
                    records.append(rec)
                    print(f"[{time.perf_counter() - t_start:6.0f}s] T={temperature} {ds} {pid} {name:18s} "
                          f"{rec['new_tokens'] / rec['decode_seconds']:5.2f} tok/s  steps {rec['steps']}", flush=True)
                _write(out_path, meta, records, args)
    _write(out_path, meta, records, args)
    print(json.dumps(json.loads(out_path.read_text())["verdict"], indent=1))


def _write(path: Path, meta: dict, records: list[dict], args) -> None:
    summary: dict = {}
    verdict: dict = {}
    for temperature in args.temperatures:
        for ds in ("humaneval", "mtbench"):
            key = f"{ds}@T={temperature}"
            cell = {}
            for name in meta["configs"]:
                recs = [r for r in records if r["dataset"] == ds and r["temperature"] == temperature and r["config"] == name]
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
                verdict[key] = {
                    "best_fixed": best_fixed, "best_fixed_tokens_per_s": fixed[best_fixed]["tokens_per_s"],
                    "best_specdecpp": best_sdpp, "best_specdecpp_tokens_per_s": sdpp[best_sdpp]["tokens_per_s"],
                    "gain_over_best_fixed": gain, "goal_10pct_met": gain >= 0.10,
                    "prompts": cell[best_sdpp]["runs"],
                }
    path.write_text(json.dumps({"meta": meta, "verdict": verdict, "summary": summary, "records": records}, indent=1))


if __name__ == "__main__":
    main()
