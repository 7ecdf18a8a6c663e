"""Does the target's own confidence tell where to draft long? A replay study at T = 0.

Every draft-length policy in ``quickdraft.decoding.policies`` reads only the draft. Before a step
that starts at output position ``j`` drafts anything, the engine already holds the target's
distribution at position ``j - 1`` (the one its bonus or correction token was taken from), so its
top probability ``c_{j-1}`` is free information. This study asks how much of the clairvoyant gain a
policy reading nothing else captures: the *target gate* drafts ``k_hi`` tokens where
``c_{j-1} >= tau`` and ``k_lo`` where it is below (a step at ``j = 0`` reads the prefill's
distribution).

It reuses a T = 0 replay of ``replay_adaptive.py`` (its outputs and ``match``, so every walk is exact)
and runs the target once, teacher-forced over prompt + output, per output. The gate's
``(tau, k_lo, k_hi)`` is chosen on the grid in-sample and held out (chosen on one half of the prompts,
scored on the other; the replay's two folds), under the replay's cost model or, with
``--costs-from``, a ``bench_perf.py`` result's (as ``replay_adaptive.py --retime --costs-from``).

    python benchmarks/studies/target_gate_replay.py --replay benchmarks/results/adaptive_replay_t0_drawing.json \\
        --costs-from benchmarks/results/perf_openvino_methods.json --out benchmarks/results/target_gate_replay.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

from quickdraft.adaptive.replay import StepCost, clairvoyant, walk
from quickdraft.evaluation.datasets import load_humaneval, load_mtbench
from quickdraft.pipeline import Pipeline

from openvino_compression import _lscpu  # the studies' CPU record (this script's folder is on sys.path)
from replay_adaptive import perf_step_cost

TAUS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)


def target_confidence(pipe: Pipeline, prompt: list[int], output: list[int]) -> list[float]:
    """``c[j]`` for ``j = 0 .. n - 1``: the target's top probability at the position that precedes
    output token ``j`` (``j = 0``: the prompt's last position), teacher-forced."""
    ids = torch.tensor([list(prompt) + list(output[:-1])])
    pipe.target.reset(1)
    logits = pipe.target.forward(ids, logits_to_keep=len(output)).logits[0, :, :pipe.vocab_size]
    pipe.target.reset(0)
    return torch.softmax(logits.float(), dim=-1).max(dim=-1).values.tolist()


def tokens_per_s(outputs: list[dict], run) -> float:
    """Modelled tokens/s of ``run(o) -> ReplayResult`` over ``outputs``."""
    results = [run(o) for o in outputs]
    return sum(r.new_tokens for r in results) / sum(r.seconds for r in results)


def fixed(k: int, cost: StepCost):
    return lambda o: walk(o["new_tokens"], o["match"], lambda j: k, cost)


def gate(tau: float, k_lo: int, k_hi: int, cost: StepCost):
    """The target gate: ``k_hi`` tokens where the target's confidence before the step is at least ``tau``."""
    def run(o):
        c = o["target_confidence"]
        return walk(o["new_tokens"], o["match"], lambda j: k_hi if c[j] >= tau else k_lo, cost)
    return run


def evaluate(outputs: list[dict], cost: StepCost, max_k: int) -> dict:
    """Best fixed K, best gate on the grid and the clairvoyant bound on ``outputs``."""
    rates = {k: tokens_per_s(outputs, fixed(k, cost)) for k in range(1, max_k + 1)}
    best_k = max(rates, key=rates.get)
    gates = {(tau, k_lo, k_hi): tokens_per_s(outputs, gate(tau, k_lo, k_hi, cost))
             for tau, k_lo, k_hi in itertools.product(TAUS, range(1, max_k + 1), range(1, max_k + 1)) if k_lo < k_hi}
    best_gate = max(gates, key=gates.get)
    bound = tokens_per_s(outputs, lambda o: clairvoyant(o["new_tokens"], o["match"], cost, max_k))
    gain, bound_gain = gates[best_gate] / rates[best_k] - 1, bound / rates[best_k] - 1
    return {"best_fixed_k": best_k, "best_fixed_tokens_per_s": rates[best_k],
            "gate": dict(zip(("tau", "k_lo", "k_hi"), best_gate)),
            "gate_gain": gain, "clairvoyant_gain": bound_gain, "gate_share_of_clairvoyant": gain / bound_gain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", default="benchmarks/results/adaptive_replay_t0_drawing.json")
    ap.add_argument("--costs-from", default=None, metavar="PERF_RESULT")
    ap.add_argument("--costs-config", default="openvino-int4/int4v49152")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/target_gate_replay.json")
    args = ap.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    replay = json.loads(Path(args.replay).read_text())
    if replay["meta"]["args"].get("temperature", 0.0) != 0:
        raise SystemExit("the target gate study reads T = 0 replays (greedy outputs)")
    max_k = replay["meta"]["args"]["max_k"]
    if args.costs_from:
        cost, source = perf_step_cost(json.loads(Path(args.costs_from).read_text()), args.costs_config, 0.0, max_k)
    else:
        sc = replay["meta"]["step_cost"]
        cost = StepCost(target=tuple(sc["target_by_tokens"]), draft=sc["draft"], overhead=sc["overhead_per_step"])
        source = {"from": args.replay}
    pipe = Pipeline.from_specs("target", None, dtype="float32")
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
    summary = {}
    for ds, outs in replay["outputs"].items():
        ids = {p.id: pipe.encode_messages(p.messages) for p in loaders[ds](len(outs))}
        outputs = []
        for o in outs:
            outputs.append({"prompt_id": o["prompt_id"], "new_tokens": o["new_tokens"], "match": o["match"],
                            "target_confidence": target_confidence(pipe, ids[o["prompt_id"]], o["tokens"])})
            print(f"[{time.perf_counter() - t0:5.0f}s] {ds} {o['prompt_id']}", flush=True)
        full = evaluate(outputs, cost, max_k)
        held = []
        folds = [outputs[0::2], outputs[1::2]]
        for pick, score in ((folds[0], folds[1]), (folds[1], folds[0])):
            chosen = evaluate(pick, cost, max_k)
            g = chosen["gate"]
            gain = (tokens_per_s(score, gate(g["tau"], g["k_lo"], g["k_hi"], cost))
                    / tokens_per_s(score, fixed(chosen["best_fixed_k"], cost)) - 1)
            held.append({"chosen": g, "chosen_fixed_k": chosen["best_fixed_k"], "gain": gain})
        summary[ds] = full | {"heldout": held}
        print(f"{ds}: best fixed K = {full['best_fixed_k']} {full['best_fixed_tokens_per_s']:.2f} tok/s; target gate "
              f"{full['gate']} {full['gate_gain']:+.1%} ({full['gate_share_of_clairvoyant']:.0%} of the bound "
              f"{full['clairvoyant_gain']:+.1%}); held out " + " / ".join(f"{h['gain']:+.1%}" for h in held), flush=True)
    result = {"meta": {"script": "benchmarks/studies/target_gate_replay.py", "command": "python " + " ".join(sys.argv),
                       "replay": args.replay, "cost": {"target_by_tokens": list(cost.target), "draft": cost.draft,
                                                       "overhead_per_step": cost.overhead, "source": source},
                       "taus": list(TAUS), "max_k": max_k, "machine": {**_lscpu(), "threads": args.threads},
                       "seconds": time.perf_counter() - t0,
                       "note": "step counts are exact replays; seconds are modelled from the cost model"},
              "summary": summary}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
