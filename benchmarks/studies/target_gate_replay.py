"""Does the target's own confidence tell where to draft long? A replay study at T = 0.

Before a step that starts at output position ``j`` drafts anything, the engine holds the target's
distribution over the last token it emitted, output token ``j - 1`` (its bonus or correction token;
the engine prefills everything but the prompt's last token, so for ``j = 0`` the distribution over
the prompt's last token). Its top probability ``t[j]`` is free information; the target's
distribution over token ``j`` itself comes only with this step's verification, so no policy may read
it. Two policies read ``t[j]``:

* the *target gate* drafts ``k_hi`` tokens where ``t[j] >= tau`` and ``k_lo`` where it is below;
* *joint confidence* is :class:`quickdraft.decoding.policies.Confidence` (stop after a draft token
  whose draft top probability is below ``p``) with ``p = p_sure`` where ``t[j] >= tau`` and
  ``p_unsure`` where it is below; ``p_sure = p_unsure`` is Confidence itself.

It reuses a T = 0 replay of ``replay_adaptive.py`` (its outputs and ``match``) and runs the target
and the draft once each, teacher-forced over prompt + output, per output. The draft's confidence in
chain token ``i`` of the step at ``j`` is its teacher-forced confidence in output token ``j + i``
wherever the chain equals the output up to it (``i <= match[j]``, the first rejected token
included); a step whose policy drafts on past that token continues from a context off the output,
so its length is known only to lie between one more token and ``max_k``: joint confidence is scored
at both ends (``low``: one more token; ``high``: ``max_k``), and its parameters are chosen by the
``high`` (slower) end. Every parameter set is chosen on the grid in-sample and held out (chosen on
one half of the prompts, scored on the other; the replay's two folds), under the replay's cost model
or, with ``--costs-from``, a ``bench_perf.py`` result's (as ``replay_adaptive.py --retime --costs-from``).
The result keeps both confidences per output (``outputs``).

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

from quickdraft.adaptive.replay import clairvoyant, walk
from quickdraft.backends.costs import StepCost
from quickdraft.evaluation.datasets import load_humaneval, load_mtbench
from quickdraft.pipeline import Pipeline

from openvino_compression import _lscpu  # the studies' CPU record (this script's folder is on sys.path)
from replay_adaptive import greedy_replay_step_cost

TAUS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
P_MINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


def confidences(pipe: Pipeline, prompt: list[int], output: list[int]) -> list[float]:
    """``c[t]`` for ``t = 0 .. n``: the top probability of ``pipe``'s target model over token ``t`` of
    ``[prompt[-1]] + output`` given what precedes it, teacher-forced (``n = len(output)``)."""
    ids = torch.tensor([list(prompt) + list(output[:-1])])
    pipe.target.reset(1)
    logits = pipe.target.forward(ids, logits_to_keep=len(output) + 1).logits[0, :, :pipe.vocab_size]
    pipe.target.reset(0)
    return torch.softmax(logits.float(), dim=-1).max(dim=-1).values.tolist()


def rate(results) -> float:
    """Modelled tokens/s of replayed generations (``ReplayResult`` s) taken together."""
    results = list(results)
    return sum(r.new_tokens for r in results) / sum(r.seconds for r in results)


def tokens_per_s(outputs: list[dict], run) -> float:
    """Modelled tokens/s of ``run(o) -> ReplayResult`` over ``outputs``."""
    return rate(run(o) for o in outputs)


def fixed(k: int, cost: StepCost):
    return lambda o: walk(o["new_tokens"], o["match"], lambda j: k, cost)


def gate(tau: float, k_lo: int, k_hi: int, cost: StepCost):
    """The target gate: ``k_hi`` tokens where the target's confidence before the step is at least ``tau``."""
    def run(o):
        t = o["target_confidence"]
        return walk(o["new_tokens"], o["match"], lambda j: k_hi if t[j] >= tau else k_lo, cost)
    return run


def joint_length(d: list[float], match: int, j: int, p: float, max_k: int, end: str) -> int:
    """Joint confidence's draft length at start ``j`` with threshold ``p``: one more than the first
    chain index ``i`` whose draft confidence ``d[j + i + 1]`` is below ``p`` (the engine asks the
    policy after each token but the last), known while ``i <= match``; past it ``end`` decides.

    >>> d = [1.0, 0.9, 0.9, 0.3, 0.9, 0.9]  # over the prompt's last token, then output tokens 0..4
    >>> joint_length(d, 5, 0, 0.5, 10, "high"), joint_length(d, 1, 0, 0.5, 10, "low"), joint_length(d, 1, 0, 0.5, 10, "high")
    (3, 3, 10)
    >>> joint_length(d, 5, 0, 0.5, 2, "high"), joint_length(d, 5, 1, 0.5, 10, "high")
    (2, 2)
    """
    for i in range(max_k - 1):
        if i > match:  # the chain left the output: its confidences are not in d
            return min(i + 1, max_k) if end == "low" else max_k
        if j + i + 1 >= len(d) or d[j + i + 1] < p:
            return i + 1
    return max_k


def joint(tau: float, p_sure: float, p_unsure: float, max_k: int, cost: StepCost, end: str):
    """Joint confidence scored at ``end`` (``low`` or ``high``) of its length range."""
    def run(o):
        t, d, match = o["target_confidence"], o["draft_confidence"], o["match"]
        return walk(o["new_tokens"], match,
                    lambda j: joint_length(d, match[j], j, p_sure if t[j] >= tau else p_unsure, max_k, end), cost)
    return run


def evaluate(outputs: list[dict], cost: StepCost, max_k: int) -> dict:
    """Best fixed K, best gate, best Confidence and best joint confidence on the grid, and the
    clairvoyant bound, on ``outputs``."""
    rates = {k: tokens_per_s(outputs, fixed(k, cost)) for k in range(1, max_k + 1)}
    best_k = max(rates, key=rates.get)
    base = rates[best_k]
    gates = {(tau, k_lo, k_hi): tokens_per_s(outputs, gate(tau, k_lo, k_hi, cost))
             for tau, k_lo, k_hi in itertools.product(TAUS, range(1, max_k + 1), range(1, max_k + 1)) if k_lo < k_hi}
    best_gate = max(gates, key=gates.get)
    caps = sorted({2, 3, 4, max_k})
    confidence = {(p, cap): tokens_per_s(outputs, joint(1.0, p, p, cap, cost, "high"))
                  for p, cap in itertools.product(P_MINS, caps)}
    best_conf = max(confidence, key=confidence.get)
    joints = {(tau, ps, pu, cap): tokens_per_s(outputs, joint(tau, ps, pu, cap, cost, "high"))
              for tau, ps, pu, cap in itertools.product(TAUS, P_MINS, P_MINS, caps) if ps < pu}
    best_joint = max(joints, key=joints.get)
    tau, ps, pu, cap = best_joint
    joint_low = tokens_per_s(outputs, joint(tau, ps, pu, cap, cost, "low"))
    conf_low = tokens_per_s(outputs, joint(1.0, best_conf[0], best_conf[0], best_conf[1], cost, "low"))
    bound = tokens_per_s(outputs, lambda o: clairvoyant(o["new_tokens"], o["match"], cost, max_k))
    bound_gain = bound / base - 1
    return {"best_fixed_k": best_k, "best_fixed_tokens_per_s": base,
            "gate": dict(zip(("tau", "k_lo", "k_hi"), best_gate)), "gate_gain": gates[best_gate] / base - 1,
            "confidence": dict(zip(("p_min", "max_k"), best_conf)),
            "confidence_gain": [confidence[best_conf] / base - 1, conf_low / base - 1],
            "joint": dict(zip(("tau", "p_sure", "p_unsure", "max_k"), best_joint)),
            "joint_gain": [joints[best_joint] / base - 1, joint_low / base - 1],
            "clairvoyant_gain": bound_gain,
            "gate_share_of_clairvoyant": (gates[best_gate] / base - 1) / bound_gain,
            "joint_share_of_clairvoyant": (joints[best_joint] / base - 1) / bound_gain}


def heldout(pick: list[dict], score: list[dict], cost: StepCost, max_k: int) -> dict:
    """Parameters chosen on ``pick``, their gains over ``pick``'s best fixed K on ``score``."""
    chosen = evaluate(pick, cost, max_k)
    base = tokens_per_s(score, fixed(chosen["best_fixed_k"], cost))
    g, c, jt = chosen["gate"], chosen["confidence"], chosen["joint"]
    gain = lambda run: tokens_per_s(score, run) / base - 1  # noqa: E731
    return {"chosen": {"fixed_k": chosen["best_fixed_k"], "gate": g, "confidence": c, "joint": jt},
            "gate_gain": gain(gate(g["tau"], g["k_lo"], g["k_hi"], cost)),
            "confidence_gain": [gain(joint(1.0, c["p_min"], c["p_min"], c["max_k"], cost, end)) for end in ("high", "low")],
            "joint_gain": [gain(joint(jt["tau"], jt["p_sure"], jt["p_unsure"], jt["max_k"], cost, end))
                           for end in ("high", "low")]}


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
    cost, source = greedy_replay_step_cost(replay, args.replay, args.costs_from, args.costs_config)
    max_k = replay["meta"]["args"]["max_k"]
    models = {"target": Pipeline.from_specs("target", None, dtype="float32"),
              "draft": Pipeline.from_specs("draft", None, dtype="float32")}
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
    summary, confidence_of = {}, {}
    for ds, outs in replay["outputs"].items():
        ids = {p.id: models["target"].encode_messages(p.messages) for p in loaders[ds](len(outs))}
        outputs = []
        for o in outs:
            prompt = ids[o["prompt_id"]]
            outputs.append({"prompt_id": o["prompt_id"], "new_tokens": o["new_tokens"], "match": o["match"],
                            **{f"{role}_confidence": confidences(pipe, prompt, o["tokens"])
                               for role, pipe in models.items()}})
            print(f"[{time.perf_counter() - t0:5.0f}s] {ds} {o['prompt_id']}", flush=True)
        confidence_of[ds] = outputs
        full = evaluate(outputs, cost, max_k)
        folds = [outputs[0::2], outputs[1::2]]
        held = [heldout(folds[0], folds[1], cost, max_k), heldout(folds[1], folds[0], cost, max_k)]
        summary[ds] = full | {"heldout": held}
        print(f"{ds}: best fixed K = {full['best_fixed_k']} {full['best_fixed_tokens_per_s']:.2f} tok/s; bound "
              f"{full['clairvoyant_gain']:+.1%}; target gate {full['gate']} {full['gate_gain']:+.1%} (held out "
              + " / ".join(f"{h['gate_gain']:+.1%}" for h in held) + f"); confidence {full['confidence']} "
              + " to ".join(f"{g:+.1%}" for g in full["confidence_gain"]) + f"; joint {full['joint']} "
              + " to ".join(f"{g:+.1%}" for g in full["joint_gain"]) + " (held out "
              + " / ".join(" to ".join(f"{g:+.1%}" for g in h["joint_gain"]) for h in held) + ")", flush=True)
    result = {"meta": {"script": "benchmarks/studies/target_gate_replay.py", "command": "python " + " ".join(sys.argv),
                       "replay": args.replay, "cost": {"target_by_tokens": list(cost.target), "draft": cost.draft,
                                                       "overhead_per_step": cost.overhead, "source": source},
                       "taus": list(TAUS), "p_mins": list(P_MINS), "max_k": max_k,
                       "machine": {**_lscpu(), "threads": args.threads}, "seconds": time.perf_counter() - t0,
                       "note": "step counts are exact replays (joint confidence and Confidence: the two ends of the "
                               "range where a step drafts past its first rejected token, [high, low] = [slower, "
                               "faster]); seconds are modelled from the cost model; gains are over the best fixed K"},
              "summary": summary,
              "outputs": {ds: [{key: o[key] for key in ("prompt_id", "target_confidence", "draft_confidence")}
                               for o in outs] for ds, outs in confidence_of.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
