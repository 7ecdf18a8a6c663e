"""The EAGLE-style feature drafter against the 0.5B draft model, on the torch backend, in one process.

Rows (``--configs``), every prompt running every row one after the other (the order rotates from
prompt to prompt, so drift hits all alike):

* ``ar``                   the target alone
* ``sd-model``             chains of ``--k`` from the draft model
* ``sd-feature``           chains of ``--k`` from the feature drafter (the target's whole head)
* ``sd-feature<N>``        the same with the drafter's head cut to the ``N`` lowest ids (``--draft-vocab``-like)
* ``tree-model``           EAGLE-2 dynamic trees (``--depth``, ``--topk``, ``--tree-budget``) from the draft model
* ``tree-feature``         the same trees from the feature drafter: EAGLE-2's configuration
* ``tree-feature-fsd``     FSD on the feature drafter's trees (``--divergence``, ``--threshold``): the FSD paper's
                           configuration

Each row gives tokens/s end to end (prefill included), tokens per target forward (the acceptance
length of a step, bonus token included), draft forwards per step and, for the lossy row, the share of
tokens accepted by the divergence test. The per-forward costs of the two drafters and of the target's
verification blocks are timed separately (median of ``--repeats``). Machine facts (``lscpu`` model and
flags) are in the results.

    python benchmarks/bench_feature_drafter.py --limit 3 --max-new-tokens 128 \\
        --out benchmarks/results/feature_drafter.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from quickdraft.decoding.policies import Constant
from quickdraft.decoding.tree import TreeConfig
from quickdraft.evaluation.datasets import load_dataset
from quickdraft.methods import build_method
from quickdraft.pipeline import Pipeline
from quickdraft.verification.sampling import SamplingParams


def lscpu() -> dict:
    """``lscpu``'s model name and flags (what every performance figure here depends on)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    return {"model": fields.get("Model name", "").strip(), "cpus": fields.get("CPU(s)", "").strip(),
            "isa": sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))}


def parse_config(name: str) -> dict:
    """``sd-feature49152`` -> method sd, drafter feature, head 49152; see the module docstring."""
    parts = name.split("-")
    method = parts[0]
    if method not in ("ar", "sd", "tree") or (method == "ar") != (len(parts) == 1):
        raise SystemExit(f"unknown config {name!r}")
    cfg = {"name": name, "method": method, "drafter": "model", "head": 0, "rule": "lossless"}
    if method != "ar":
        who = parts[1]
        if who == "model":
            pass
        elif who.startswith("feature"):
            cfg["drafter"] = "feature"
            cfg["head"] = int(who[len("feature"):] or 0)
        else:
            raise SystemExit(f"unknown drafter in {name!r}: model or feature[N]")
        if len(parts) == 3:
            if parts[2] != "fsd" or method != "tree":
                raise SystemExit(f"unknown config {name!r}: only tree rows take -fsd")
            cfg["rule"] = "fsd"
    return cfg


def time_forwards(pipe: Pipeline, heads: list[int], context: list[int], repeats: int, drafter_dir: Path) -> dict:
    """Median ms of: one draft-model token, one feature-drafter token (per head cut), and target
    blocks of 1, 5 and 17 tokens, after ``context``."""
    from quickdraft.decoding.feature_drafter import FeatureState
    from quickdraft.backends.runner import ModelRunner

    def median_ms(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(times), 2)

    out = {}
    ids = torch.tensor([context])
    for m in (1, 5, 17):
        def target_block(m=m):
            pipe.target.reset(1)
            pipe.target.forward(ids[:, :-m], logits_to_keep=1)
            t0 = time.perf_counter()
            pipe.target.forward(ids[:, -m:], logits_to_keep=m)
            return time.perf_counter() - t0
        out[f"target_m{m}"] = round(1000 * statistics.median(target_block() for _ in range(repeats)), 2)
    if pipe.draft is not None:
        pipe.draft.reset(1)
        pipe.draft.forward(ids, logits_to_keep=1)
        out["draft_model_token"] = median_ms(
            lambda: (pipe.draft.forward(ids[:, -1:], logits_to_keep=1), pipe.draft.truncate(pipe.draft.lengths - 1)))
    for head in heads:
        pipe.load_feature_drafter(drafter_dir, head_vocab=head)
        runner: ModelRunner = pipe.feature_draft
        state = FeatureState(runner, pipe.target)
        pipe.target.reset(1)
        pipe.target.forward(ids, logits_to_keep=1)
        state.start([context])
        state.prefill([context])
        feats = torch.zeros(1, 1, runner.model.config.hidden_size, dtype=next(runner.model.parameters()).dtype)
        out[f"feature_token_head{head or 'full'}"] = median_ms(
            lambda: (runner.forward(ids[:, -1:], logits_to_keep=1, features=feats), runner.truncate(runner.lengths - 1)))
    pipe.target.record_hidden = False
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=3, help="prompts per dataset")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=[
        "ar", "sd-model", "sd-feature", "sd-feature49152", "tree-model", "tree-feature"])
    ap.add_argument("--sampled-configs", nargs="+", default=["sd-model", "sd-feature", "tree-feature", "tree-feature-fsd"],
                    help="rows run at --temperature too")
    ap.add_argument("--temperature", type=float, default=0.6, help="the sampled rows' temperature (FSD's paper: 0.6)")
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--tree-budget", type=int, default=16)
    ap.add_argument("--divergence", default="js")
    ap.add_argument("--threshold", type=float, default=0.4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--feature-drafter", default=None, help="the drafter's directory (default: the target's cache entry)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    runs = [(0.0, parse_config(c)) for c in args.configs] + [
        (args.temperature, parse_config(c)) for c in args.sampled_configs]
    heads = sorted({c["head"] for _, c in runs if c["drafter"] == "feature"})

    t0 = time.perf_counter()
    pipe = Pipeline.from_specs("target", "draft", dtype=args.dtype)
    load_s = time.perf_counter() - t0
    from quickdraft.decoding.feature_model import FeatureDraftModel, default_drafter_dir

    drafter_dir = Path(args.feature_drafter) if args.feature_drafter else default_drafter_dir("target")
    _, meta = FeatureDraftModel.load(drafter_dir, pipe.target_model)
    prompts = [p for d in args.datasets for p in load_dataset(d, args.limit)]
    ids = [pipe.encode_messages(p.messages) for p in prompts]
    context = ids[0][:256]
    forward_ms = time_forwards(pipe, heads, context, args.repeats, drafter_dir)

    def run_one(temp: float, cfg: dict, prompt_ids: list[int]):
        sampling = SamplingParams(temperature=temp, top_p=args.top_p if temp else 1.0, top_k=args.top_k if temp else None)
        spec = build_method("tree" if cfg["method"] == "tree" else cfg["method"], k=args.k, sampling=sampling,
                            tree_budget=args.tree_budget, depth=args.depth, topk=args.topk,
                            tree_rule=cfg["rule"], divergence=args.divergence, threshold=args.threshold,
                            tree_sampling="topk")
        if cfg["drafter"] == "feature":
            pipe.load_feature_drafter(drafter_dir, head_vocab=cfg["head"])
        t = time.perf_counter()
        out = pipe.generate(prompts=[], prompt_ids=[prompt_ids], method=spec.engine_method, policy=Constant(args.k),
                            rule=spec.rule, sampling=sampling, max_new_tokens=args.max_new_tokens, seed=0,
                            tree=spec.tree, verifier=spec.verifier, drafter=cfg["drafter"])
        wall = time.perf_counter() - t
        return out, wall

    # warm-up: one short run of every row
    for temp, cfg in runs:
        run_one(temp, cfg, ids[0][:64])
    rows = {f"{cfg['name']}@T{temp}": {"config": cfg, "temperature": temp, "prompts": []} for temp, cfg in runs}
    for i, (prompt, prompt_ids) in enumerate(zip(prompts, ids)):
        order = runs[i % len(runs):] + runs[: i % len(runs)]
        for temp, cfg in order:
            out, wall = run_one(temp, cfg, prompt_ids)
            m = out.metrics
            rec = {"id": prompt.id, "new_tokens": m.new_tokens, "seconds": round(wall, 3),
                   "tokens_per_second": round(m.new_tokens / wall, 3), "target_forwards": m.target_forwards,
                   "draft_forwards": m.draft_forwards, "steps": m.steps, "accepted": m.accepted_tokens,
                   "drafted": m.drafted_tokens, "lossy": m.lossy_accepted_tokens, "tokens": out.completions[0].token_ids}
            rows[f"{cfg['name']}@T{temp}"]["prompts"].append(rec)
            print(f"T={temp} {prompt.id:14s} {cfg['name']:18s} {rec['tokens_per_second']:6.2f} tok/s  "
                  f"{m.new_tokens / max(1, m.target_forwards):.2f} tok/target forward", flush=True)

    summary = {}
    for key, row in rows.items():
        recs = row["prompts"]
        by_ds = {}
        for ds in args.datasets + ["all"]:
            sel = [r for r, p in zip(recs, prompts) if ds == "all" or p.dataset == ds]
            tokens = sum(r["new_tokens"] for r in sel)
            by_ds[ds] = {
                "tokens_per_second": round(tokens / sum(r["seconds"] for r in sel), 3),
                "tokens_per_target_forward": round(tokens / sum(r["target_forwards"] for r in sel), 3),
                "draft_forwards_per_step": round(sum(r["draft_forwards"] for r in sel) / max(1, sum(r["steps"] for r in sel)), 3),
                "lossy_share": round(sum(r["lossy"] for r in sel) / max(1, tokens), 4),
            }
        summary[key] = by_ds
    base = {t: summary.get(f"sd-model@T{t}") for t in {temp for temp, _ in runs}}
    for key, by_ds in summary.items():
        t = rows[key]["temperature"]
        if base.get(t):
            for ds, s in by_ds.items():
                s["x_sd_model"] = round(s["tokens_per_second"] / base[t][ds]["tokens_per_second"], 3)
    # greedy rows must all emit the target's own greedy text (the same backend, the same dtype)
    greedy = [k for k in rows if rows[k]["temperature"] == 0.0 and rows[k]["config"]["rule"] == "lossless"]
    ref = rows.get("ar@T0.0")
    identical = None
    if ref is not None:
        identical = {k: sum(a["tokens"] == b["tokens"] for a, b in zip(rows[k]["prompts"], ref["prompts"]))
                     for k in greedy}
    result = {
        "command": "python benchmarks/bench_feature_drafter.py " + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items() if v is not None),
        "machine": lscpu(), "threads": args.threads, "torch": torch.__version__,
        "dtype": str(next(pipe.target_model.parameters()).dtype),
        "load_seconds": round(load_s, 1), "feature_drafter": {"dir": str(drafter_dir), "training": meta.training},
        "forward_ms": forward_ms, "greedy_identical_to_ar": identical, "prompts": len(prompts),
        "summary": summary, "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, by_ds in summary.items():
        print(key, json.dumps(by_ds["all"]))


if __name__ == "__main__":
    main()
