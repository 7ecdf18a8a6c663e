"""Do the cache's holes make greedy speculative output leave plain greedy output on openvino?

A rejected draft token's slot stays in the OpenVINO runner's KV cache as a hole, masked out of
every later call, until holes make up half of the slots (``OpenVINORunner._maybe_compact``). This
study runs the default pair's int4 target (tuned plugin settings) and int4 draft with two roll-back
policies for the *target*: ``holes`` (the runner's default) and ``compact`` (the target's cache
compacted after every step that leaves a hole), greedy, ``ar``, ``sd`` K = 4 and ``ngram_sd``, on the
first HumanEval and MT-Bench prompts, and records whether each speculative output equals the
plain greedy one token for token and what compaction costs in tokens/s (policies alternating
prompt by prompt, ``--rounds`` rounds).

    python benchmarks/studies/openvino_holes.py --out benchmarks/results/openvino_holes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import types
from pathlib import Path

from openvino_compression import _lscpu  # the studies' CPU record (this script's folder is on sys.path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=3, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from quickdraft import Pipeline, SamplingParams
    from quickdraft.backends.openvino.runner import OpenVINORunner
    from quickdraft.evaluation.datasets import load_dataset

    pipe = Pipeline.from_specs("target", "draft", backend="openvino", quantize="int4", quantize_draft="int4",
                               draft_vocab=49152)
    target = pipe.target

    def compact_every_hole(runner) -> None:
        if runner.num_holes > 0:
            runner.compact()

    policies = {"holes": OpenVINORunner._maybe_compact, "compact": compact_every_hole}
    problems = load_dataset("humaneval", args.limit) + load_dataset("mtbench", args.limit)
    greedy = SamplingParams(temperature=0.0)
    records = []
    for rnd in range(args.rounds):
        for i, problem in enumerate(problems):
            ids = pipe.encode_messages(problem.messages)
            order = list(policies) if (i + rnd) % 2 == 0 else list(policies)[::-1]
            for name in order:
                target._maybe_compact = types.MethodType(policies[name], target)
                runs = {}
                for method in ("ar", "sd", "ngram_sd"):
                    out = pipe.generate([""], prompt_ids=[ids], method=method, k=4, sampling=greedy,
                                        max_new_tokens=args.max_new_tokens)
                    runs[method] = {"round": rnd, "prompt_id": problem.id, "rollback": name, "method": method,
                                    "tokens_per_second": out.metrics.tokens_per_second,
                                    "text": out.completions[0].text}
                for method in ("sd", "ngram_sd"):
                    runs[method]["identical_to_ar"] = runs[method]["text"] == runs["ar"]["text"]
                records.extend(runs.values())
                print(rnd, problem.id, name, {m: runs[m]["identical_to_ar"] for m in ("sd", "ngram_sd")}, flush=True)
    summary = {}
    for name in policies:
        for method in ("ar", "sd", "ngram_sd"):
            rows = [r for r in records if r["rollback"] == name and r["method"] == method]
            entry = {"mean_tokens_per_second": statistics.mean(r["tokens_per_second"] for r in rows), "runs": len(rows)}
            first = [r for r in rows if r["round"] == 0]
            if method != "ar":
                entry["identical_to_ar"] = f"{sum(r['identical_to_ar'] for r in first)}/{len(first)}"
            summary[f"{name}/{method}"] = entry
            print(name, method, entry, flush=True)
    result = {"command": "python benchmarks/studies/openvino_holes.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
              "machine": _lscpu(), "target_plugin_config": target.plugin_config,
              "summary": summary, "records": records}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
