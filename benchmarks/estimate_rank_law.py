"""Estimate a pair's race rank law c(j) = Pr[the target's race winner is the draft's j-th earliest arrival].

The target generates ``--max-new-tokens`` tokens (plain decoding, the given temperature, seed per
prompt) for calibration prompts taken *after* the first ``--skip`` of each dataset (the benchmarks use
the first few), then both models read prompt + continuation back in one forward each and
:func:`quickdraft.decoding.tree_shapes.estimate_rank_law` counts ranks at every generated position over
``--draws`` arrival-time vectors. The laws (one per temperature) go to one JSON file that
``--tree-shape optimal --rank-law FILE`` reads; the default pair's file ships in the package:

    python benchmarks/estimate_rank_law.py --backend openvino --temperatures 0 0.7 \\
        --out src/quickdraft/rank_laws/default-openvino.json
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from quickdraft.evaluation.bench import encode_prompt, prompt_seed
from quickdraft.evaluation.datasets import load_dataset
from quickdraft.pipeline import Pipeline
from quickdraft.verification.sampling import SamplingParams
from quickdraft.decoding.tree_shapes import RankLawFile, describe, estimate_rank_law, optimal_race_tree


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="target")
    ap.add_argument("--draft", default="draft")
    ap.add_argument("--backend", default="openvino")
    ap.add_argument("--quantize", default="auto")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"])
    ap.add_argument("--skip", type=int, default=10, help="calibrate on prompts after the first SKIP of each dataset")
    ap.add_argument("--prompts", type=int, default=4, help="calibration prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--draws", type=int, default=16, help="arrival-time vectors per position (T > 0)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    started = time.time()
    pipe = Pipeline.from_specs(args.target, args.draft, backend=args.backend, quantize=args.quantize)
    prompts = [p for name in args.datasets for p in load_dataset(name, args.skip + args.prompts)[args.skip :]]
    prompt_ids = [encode_prompt(pipe, p) for p in prompts]
    laws = []
    for temperature in args.temperatures:
        sampling = SamplingParams(temperature=temperature)
        sequences = []
        for prompt, ids in zip(prompts, prompt_ids):
            seed = prompt_seed(args.seed, prompt.id)
            out = pipe.generate([""], prompt_ids=[ids], method="ar", sampling=sampling,
                                max_new_tokens=args.max_new_tokens, seed=seed)
            sequences.append((ids + list(out.completions[0].token_ids), len(ids)))
        law = estimate_rank_law(pipe.target, pipe.draft, sequences, sampling, seed=args.seed, draws=args.draws)
        laws.append(law)
        trees = {n: optimal_race_tree(law.law, n).expected_tokens for n in (4, 8, 16, 32)}
        print(f"T={temperature:g}: {law.positions} positions, {describe(law.law)}, never {law.never:.4f}; "
              f"optimal tree E[T] " + ", ".join(f"N={n}: {e:.2f}" for n, e in trees.items()), file=sys.stderr)
    RankLawFile(
        pair={"target": args.target, "draft": args.draft, "backend": args.backend, "quantize": args.quantize},
        prompts=[p.id for p in prompts], max_new_tokens=args.max_new_tokens,
        command="python benchmarks/estimate_rank_law.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        laws=laws,
    ).save(args.out)
    print(f"wrote {args.out} in {time.time() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
