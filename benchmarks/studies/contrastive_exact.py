"""Greedy scd against greedy cd on the real pair, with the openvino backend's batch-invariant kernels.

On the default kernels a block of K + 1 tokens is not computed exactly as K + 1 one-token forwards,
so greedy ``scd`` (the target verifies blocks) and greedy ``cd`` (one token at a time) can part
where contrastive decoding's top two scores nearly tie, or a token sits at the plausibility cut α
(as greedy ``sd`` and ``ar`` can). With ``exact=True`` the arithmetic does not depend on the block
size, and the two must agree token for token. This runs both on the given HumanEval problems
(default: the two where the openvino run ``contrastive_humaneval`` saw them part) and writes, per
problem, the tokens of each and whether they are equal.

    python benchmarks/studies/contrastive_exact.py --out benchmarks/results/contrastive_exact.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=["HumanEval/1", "HumanEval/5"])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()

    from quickdraft.evaluation.bench import encode_prompt
    from quickdraft.evaluation.datasets import load_dataset
    from quickdraft.methods import build_method
    from quickdraft.pipeline import Pipeline

    # the benchmark's weights (int8 target, int4 draft with its full head), batch-invariant kernels
    pipe = Pipeline.from_specs("target", "draft", backend="openvino", quantize="int8", quantize_draft="int4",
                               exact=True)
    prompts = {p.id: p for p in load_dataset("humaneval", None)}
    rows = []
    for problem in args.problems:
        ids = encode_prompt(pipe, prompts[problem])
        row = {"problem": problem}
        for method in ("cd", "scd"):
            spec = build_method(method)  # α = 0.1, β = 0.5, K = 4, T = 0
            completion = pipe.generate([""], prompt_ids=[ids], method=spec.engine_method, rule=spec.rule,
                                       policy=spec.policy, max_new_tokens=args.max_new_tokens, seed=0).completions[0]
            row[method] = {"token_ids": completion.token_ids,
                           "mean_acceptance_length": completion.metrics.mean_acceptance_length}
        row["equal"] = row["cd"]["token_ids"] == row["scd"]["token_ids"]
        rows.append(row)
        print(f"{problem}: {len(row['cd']['token_ids'])} tokens, scd == cd: {row['equal']}, scd acceptance length "
              f"{row['scd']['mean_acceptance_length']:.2f}", flush=True)
    if args.out:
        payload = {"backend": "openvino", "exact": True, "quantize": "int8", "quantize_draft": "int4",
                   "cd_alpha": 0.1, "cd_beta": 0.5, "k": 4, "temperature": 0.0, "rows": rows}
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
