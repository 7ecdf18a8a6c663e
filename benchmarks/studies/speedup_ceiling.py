"""The most any chain method can gain on a machine, from the target forward costs a benchmark measured.

A speculative step emits at most the m tokens of the block its target verifies (K drafts plus the
bonus token, m = K + 1) and costs at least that verification. So with drafts that cost nothing and
are always accepted, decoding runs at m / c(m) tokens a second, where c(m) is the target's forward
over m new tokens; against plain decoding on a reference runtime (one token per c_ref(1)) that is

    ceiling(m) = m · c_ref(1) / c(m),

an upper bound for every drafter, rule and draft-length policy on that target (a draft model's
forwards, the engine's work, rejected drafts and the prefill only lower it). Turned around, a goal
of g× needs on average

    needed(m) = g · (c(m) + (m − 1) · d) / c_ref(1)

tokens a step, d the draft's one-token forward (0 for prompt lookup, which runs no model); where
needed(m) > m no method reaches the goal with blocks of m tokens, and the smallest needed(m) ≤ m
over every target and block is the fewest tokens a step any method must average. The study reads
``forward_seconds`` of a ``benchmarks/bench_perf.py`` results file (keys ``<pipeline>/target/m=<m>``,
medians of forwards after a prefill of the first prompt, timed round-robin) and prints the ceiling of
every target measured there against the reference, by default llama.cpp (``llamacpp``): a goal of
1.9× llama.cpp plain is out of reach on that machine for every method if no ceiling reaches it.

``--over-lossless TOKENS`` bounds a lossy rule against lossless ``sd`` K = 4 that emits TOKENS a step
(:func:`over_lossless`): even accepting every draft, a rule drafting m − 1 tokens with the pipeline's
draft model cannot beat lossless ``sd`` by more than that block's figure.

    python benchmarks/bench_perf.py --limit 1 --datasets humaneval --configs llamacpp-ar \\
        openvino-int8/int4v49152-ar openvino-int4/int4v49152-ar --forward-blocks 1 2 3 5 9 17 33 65 \\
        --forward-repeats 5 --forward-costs-only --skip-bandwidth --out benchmarks/results/forward_costs_avx2.json
    python benchmarks/studies/speedup_ceiling.py benchmarks/results/forward_costs_avx2.json \\
        --out benchmarks/results/speedup_ceiling_avx2.json
    python benchmarks/studies/speedup_ceiling.py benchmarks/results/forward_costs_avx2.json --over-lossless 4.45 \\
        --out benchmarks/results/fsd_ceiling_avx2.json
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def target_costs(forward_seconds: dict[str, float]) -> dict[str, dict[int, float]]:
    """``{"<pipeline>/target/m=<m>": s}`` -> ``{pipeline: {m: s}}`` (draft rows are left out).

    >>> target_costs({"llamacpp/target/m=1": 0.05, "llamacpp/target/m=5": 0.2, "llamacpp/draft/m=1": 0.03})
    {'llamacpp': {1: 0.05, 5: 0.2}}
    """
    out: dict[str, dict[int, float]] = {}
    for key, seconds in forward_seconds.items():
        match = re.fullmatch(r"(.+)/target/m=(\d+)", key)
        if match:
            out.setdefault(match.group(1), {})[int(match.group(2))] = float(seconds)
    return out


def ceiling(costs: dict[int, float], reference_one_token: float) -> dict[int, float]:
    """``m · c_ref(1) / c(m)`` for every block size ``m`` of ``costs`` (``{m: c(m)}`` in seconds).

    >>> ceiling({1: 0.1, 5: 0.25}, reference_one_token=0.05)
    {1: 0.5, 5: 1.0}
    """
    if reference_one_token <= 0 or any(c <= 0 for c in costs.values()):
        raise ValueError("forward costs must be positive")
    return {m: m * reference_one_token / c for m, c in sorted(costs.items())}


def needed(costs: dict[int, float], reference_one_token: float, goal: float, draft: float = 0.0) -> dict[int, float]:
    """Tokens a step must emit on average for ``goal``× the reference's plain decoding, per block size
    ``m``: ``goal · (c(m) + (m − 1) · draft) / c_ref(1)``.

    >>> needed({1: 0.1, 5: 0.25}, reference_one_token=0.05, goal=2.0, draft=0.01)
    {1: 4.0, 5: 11.6}
    """
    return {m: round(goal * (c + (m - 1) * draft) / reference_one_token, 10) for m, c in sorted(costs.items())}


def over_lossless(costs: dict[int, float], draft: float, tokens_a_step: float, k: int = 4) -> dict[int, float]:
    """The most a lossy rule (FSD, typical, ...) drafting ``m - 1`` tokens can gain over lossless
    speculative decoding at ``k`` that emits ``tokens_a_step`` tokens per verification, per block
    size ``m``: the lossy rule at best accepts every draft, so a step emits ``m`` tokens for
    ``c(m) + (m − 1) · draft``, against the lossless step's ``tokens_a_step`` for
    ``c(k + 1) + k · draft``:

        (m / (c(m) + (m − 1) · draft)) / (tokens_a_step / (c(k + 1) + k · draft))

    >>> over_lossless({1: 0.1, 5: 0.2, 9: 0.3}, draft=0.05, tokens_a_step=4.0)
    {1: 1.0, 5: 1.25, 9: 1.2857142857}
    """
    if k + 1 not in costs:
        raise ValueError(f"the lossless reference verifies blocks of {k + 1} tokens; that block was not measured")
    if not 1 <= tokens_a_step <= k + 1:
        raise ValueError(f"a step of K = {k} emits between 1 and {k + 1} tokens, got {tokens_a_step}")
    lossless = tokens_a_step / (costs[k + 1] + k * draft)
    return {m: round(m / (c + (m - 1) * draft) / lossless, 10) for m, c in sorted(costs.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a bench_perf.py results file with forward_seconds")
    parser.add_argument("--reference", default="llamacpp", help="the pipeline whose one-token forward is plain decoding")
    parser.add_argument("--goal", type=float, default=1.9, help="the speed-up over the reference to test (g)")
    parser.add_argument("--over-lossless", type=float, metavar="TOKENS",
                        help="also the ceiling of a lossy rule over lossless sd at K = 4 that emits TOKENS a step "
                             "(with each pipeline's draft model)")
    parser.add_argument("--out", help="write the table as JSON here")
    args = parser.parse_args()

    data = json.loads(Path(args.results).read_text())
    costs = target_costs(data.get("forward_seconds") or {})
    if args.reference not in costs or 1 not in costs[args.reference]:
        raise SystemExit(f"{args.results} has no one-token target forward of {args.reference!r} "
                         f"(targets measured: {', '.join(costs) or 'none'})")
    ref = costs[args.reference][1]
    table = {name: ceiling(c, ref) for name, c in costs.items()}
    drafts = {name: data["forward_seconds"].get(f"{name}/draft/m=1") for name in costs}
    need_free = {name: needed(c, ref, args.goal) for name, c in costs.items()}
    need_draft = {name: needed(c, ref, args.goal, drafts[name]) for name, c in costs.items() if drafts[name]}
    best = max(((v, name, m) for name, row in table.items() for m, v in row.items()))
    print(f"reference: {args.reference}, one token {1e3 * ref:.1f} ms ({1 / ref:.1f} tok/s)")
    for name, row in table.items():
        print(f"{name:34s} " + "  ".join(f"m={m}: {costs[name][m] * 1e3:6.1f} ms -> {v:.2f}x" for m, v in row.items()))
        print(f"{'':34s} tokens a step for {args.goal:g}x, free drafts: "
              + "  ".join(f"m={m}: {v:.1f}" for m, v in need_free[name].items()))
        if name in need_draft:
            print(f"{'':34s} with its draft model ({drafts[name] * 1e3:.1f} ms): "
                  + "  ".join(f"m={m}: {v:.1f}" for m, v in need_draft[name].items()))
    print(f"highest ceiling: {best[0]:.2f}x ({best[1]}, m = {best[2]})")
    # the fewest tokens a step that reach the goal, over the blocks that can hold them (free drafts)
    feasible = [(v, name, m) for name, row in need_free.items() for m, v in row.items() if v <= m]
    fewest = min(feasible) if feasible else None
    print(f"fewest tokens a step for {args.goal:g}x: "
          + (f"{fewest[0]:.1f} ({fewest[1]}, m = {fewest[2]}, free drafts)" if fewest else "none: no block measured can hold them"))
    lossy = {}
    if args.over_lossless:
        lossy = {name: over_lossless(c, drafts[name], args.over_lossless) for name, c in costs.items()
                 if drafts[name] and 5 in c}
        for name, row in lossy.items():
            print(f"{name:34s} a lossy rule accepting every draft, over sd K = 4 at {args.over_lossless:g} tokens a step: "
                  + "  ".join(f"m={m}: {v:.2f}x" for m, v in row.items()))
    if args.out:
        Path(args.out).write_text(json.dumps({
            "command": "python benchmarks/studies/speedup_ceiling.py " + args.results
                       + (f" --reference {args.reference}" if args.reference != "llamacpp" else "")
                       + (f" --goal {args.goal:g}" if args.goal != 1.9 else "")
                       + (f" --over-lossless {args.over_lossless:g}" if args.over_lossless else "") + f" --out {args.out}",
            "source": args.results, "machine": data.get("machine"), "reference": args.reference,
            "reference_one_token_seconds": ref,
            "forward_seconds": {n: {str(m): c for m, c in row.items()} for n, row in costs.items()},
            "ceiling": {n: {str(m): v for m, v in row.items()} for n, row in table.items()},
            "highest": {"ceiling": best[0], "target": best[1], "m": best[2]},
            "fewest_needed": ({"tokens": fewest[0], "target": fewest[1], "m": fewest[2]} if fewest else None),
            "goal": args.goal, "draft_one_token_seconds": {n: d for n, d in drafts.items() if d},
            "needed_free_drafts": {n: {str(m): v for m, v in row.items()} for n, row in need_free.items()},
            "needed_with_draft_model": {n: {str(m): v for m, v in row.items()} for n, row in need_draft.items()},
            **({"over_lossless": {"tokens_a_step": args.over_lossless, "k": 4,
                                  "ceiling": {n: {str(m): v for m, v in row.items()} for n, row in lossy.items()}}}
               if lossy else {}),
        }, indent=1))


if __name__ == "__main__":
    main()
