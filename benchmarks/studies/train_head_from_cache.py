"""Train the SpecDec++ heads from lockstep batches already cached by ``quickdraft train-head``.

``quickdraft train-head`` builds its data in batches of 16 prompts and caches each batch under
``~/.cache/quickdraft/specdecpp/lockstep-*.pt`` before training. This script trains (no model is
loaded) from whatever batches are cached, for every label temperature they hold, and writes the
heads, the training report and the reliability plot exactly as ``train-head`` would. The heads'
metadata take the draft's fingerprint from ``--fingerprint-from`` (a head file made for the same
draft), the draft/target cost ratio from ``--draft-cost`` (measured at the start of the
``train-head`` run that built the batches).

    python benchmarks/studies/train_head_from_cache.py --draft-cost 0.12 --holdout 0.4 \\
        --report benchmarks/results/adaptive_head_training.json --plot docs/specdecpp_reliability.png
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from quickdraft.decoding.head import HeadMetadata, load_head, save_head
from quickdraft.adaptive.headtrain import (
    DEFAULT_HEAD_PATH, Examples, TrainConfig, head_path_for, plot_reliability, specdecpp_cache_dir, train_head,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=str(specdecpp_cache_dir()))
    ap.add_argument("--draft-cost", type=float, required=True, help="draft forward time / target forward time")
    ap.add_argument("--fingerprint-from", default=str(head_path_for(DEFAULT_HEAD_PATH, 0.0, True)),
                    help="a head file trained for the same draft (its draft fingerprint is copied)")
    ap.add_argument("--holdout", type=float, default=0.2)
    ap.add_argument("--num-layers", type=int, default=TrainConfig.num_layers)
    ap.add_argument("--epochs", type=int, default=TrainConfig.epochs)
    ap.add_argument("--out", default=DEFAULT_HEAD_PATH)
    ap.add_argument("--report", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    files = sorted(glob.glob(str(Path(args.cache) / "lockstep-*.pt")))
    if not files:
        sys.exit(f"no cached lockstep batches in {args.cache}")
    batches = [torch.load(f, weights_only=True) for f in files]
    temps = sorted(batches[0]["by_temperature"], key=float)
    for f, data in zip(files, batches):  # batches of another train-head setting cannot be pooled
        if sorted(data["by_temperature"], key=float) != temps:
            sys.exit(f"{f} holds label temperatures {sorted(data['by_temperature'])}, {files[0]} holds {temps}: "
                     "give a --cache directory with batches of one train-head setting only")
    reference = load_head(args.fingerprint_from)
    cfg = TrainConfig(holdout=args.holdout, num_layers=args.num_layers, epochs=args.epochs)
    results = {}
    for t in temps:
        parts = {k: [] for k in ("features", "labels", "loss_mask", "draft_stats", "groups")}
        for b, data in enumerate(batches):
            d = data["by_temperature"][t]
            for k in ("features", "labels", "loss_mask", "draft_stats"):
                parts[k].append(d[k])
            parts["groups"].append(data["rows"] + 1000 * b)  # prompt = (batch, row)
        ex = Examples(torch.cat(parts["features"]), torch.cat(parts["labels"]).float(), torch.cat(parts["loss_mask"]),
                      torch.cat(parts["groups"]), "", torch.cat(parts["draft_stats"]), float(t))
        digest = hashlib.sha256()
        for f in files:
            digest.update(Path(f).read_bytes())
        meta = HeadMetadata(draft=reference.metadata.draft, target=reference.metadata.target,
                            draft_fingerprint=reference.metadata.draft_fingerprint, data_hash=digest.hexdigest(),
                            temperature=float(t))
        head, report = train_head(ex, replace(cfg, temperature=float(t)), meta, draft_cost=args.draft_cost)
        report.update(config=asdict(replace(cfg, temperature=float(t))), target=meta.target, draft=meta.draft,
                      data_hash=meta.data_hash, cached_batches=[Path(f).name for f in files],
                      prompts_used=int(ex.groups.unique().numel()), response_tokens=int(ex.labels.numel()),
                      labelled_positions=int(ex.loss_mask.sum()), command="python " + " ".join(sys.argv))
        head.metadata.extra = {k: report[k] for k in (
            "brier_raw", "brier_unweighted", "brier_constant_baseline", "brier_base_rate", "brier_logistic_baseline",
            "train_positions", "validation_positions", "heldout_positions", "response_tokens", "prompts_used",
            "suggested_thresholds") if k in report}
        head.metadata.extra["reject_weight"] = cfg.reject_weight
        path = head_path_for(args.out, float(t), len(temps) > 1)
        save_head(head, path)
        report["head_path"] = str(path)
        print(f"head saved to {path}")
        results[float(t)] = report
    if args.report:
        Path(args.report).write_text(json.dumps({f"T={t:g}": r for t, r in results.items()}, indent=1))
    if args.plot:
        plot_reliability([(f"SpecDec++ head, T={t:g}", r) for t, r in results.items()], args.plot)


if __name__ == "__main__":
    main()
