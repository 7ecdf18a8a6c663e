"""A draft-length policy that prices each token: the draft's confidence, calibrated online, against
the measured step costs. A replay study at T = 0, no model run.

The ``cost`` policy chooses a step's length from one running acceptance rate and the step costs;
``Confidence`` stops after a draft token whose top probability is below a threshold, whatever a
token costs. *Rate stopping* joins them. After drafting chain token ``i`` with draft confidence
``c_i``, it holds ``s_i``, the probability that every token so far is accepted (the product of
``f(c_t)``, ``f`` a calibration of confidence to acceptance), and the expected tokens of the step
verified now, ``E_k = 1 + s_0 + … + s_{k-1}`` for ``k = i + 1`` drafts; it drafts one more token while
some longer length would raise the step's expected tokens per second,

    max over k' > k of  (E_k + s_{k-1} · (p + p² + … + p^(k'−k))) / step(k')  >  E_k / step(k),

``p = f(c_{k-1})``: the later tokens' acceptance taken as the last one's (their confidences are not
known before their draft forwards). Looking past the next length matters where a verification's
cost is not convex in its tokens (the float32 target's over 2 and 3 tokens costs more than over 5). ``f`` is learnt online within each generation from the steps already verified:
per tenth of confidence, accepted over drafted tokens with a prior of two tokens at ``f(c) = c``. No
threshold is tuned, so the in-sample figures are also held out.

As in ``target_gate_replay.py`` (whose file holds the draft's teacher-forced confidences per output,
``draft_confidence``, and whose replay holds ``match``), chain token ``i`` of the step at ``j`` has
the confidence of output token ``j + i`` while the chain equals the output (``i <= match[j]``, the
first rejected token included); a step drafting past that token leaves the output, so its length is
known only to lie between one more token and ``max_k``: rate stopping is scored at both ends
(``[slower, faster]``), and the calibration learns only from tokens whose confidence is known.

    python benchmarks/studies/confidence_cost_replay.py --confidences benchmarks/results/target_gate_replay_openvino.json \\
        --costs-from benchmarks/results/perf_openvino_methods.json --out benchmarks/results/confidence_cost_replay_openvino.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from quickdraft.adaptive.replay import clairvoyant, walk
from quickdraft.backends.costs import StepCost

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_adaptive import greedy_replay_step_cost  # noqa: E402  (the replays' cost models)
from target_gate_replay import fixed, rate, tokens_per_s  # noqa: E402  (fixed K and rates, as joint confidence is scored)

#: calibration bins (tenths of confidence) and the prior's weight in tokens
BINS = 10
PRIOR_TOKENS = 2.0


class Calibration:
    """Acceptance given the draft's confidence, learnt from verified tokens: per tenth of confidence,
    ``(accepted + w · c) / (drafted + w)`` with ``w`` = :data:`PRIOR_TOKENS` (the prior ``f(c) = c``).

    >>> f = Calibration()
    >>> f(0.55)
    0.55
    >>> f.observe(0.52, True); f.observe(0.58, True)
    >>> round(f(0.55), 4)  # (2 + 2 · 0.55) / (2 + 2)
    0.775
    """

    def __init__(self) -> None:
        self.accepted = [0.0] * BINS
        self.drafted = [0.0] * BINS

    @staticmethod
    def _bin(c: float) -> int:
        return min(BINS - 1, max(0, int(c * BINS)))

    def __call__(self, c: float) -> float:
        b = self._bin(c)
        return (self.accepted[b] + PRIOR_TOKENS * c) / (self.drafted[b] + PRIOR_TOKENS)

    def observe(self, c: float, accepted: bool) -> None:
        b = self._bin(c)
        self.drafted[b] += 1
        self.accepted[b] += bool(accepted)


def rate_length(d: list[float], match: int, j: int, f, cost: StepCost, max_k: int, end: str) -> int:
    """Rate stopping's draft length at start ``j`` (at least one token): draft token ``i`` (confidence
    ``d[j + i + 1]``, known while ``i <= match``), then one more while some longer length would raise
    the step's expected tokens per second; past ``match`` the length is ``i + 1`` (``end="low"``) or
    ``max_k`` (``"high"``).

    >>> cost = StepCost(target=(1.0, 1.0, 1.0, 2.0), draft=0.1)
    >>> sure = [1.0, 0.95, 0.95, 0.95, 0.95]
    >>> rate_length(sure, 3, 0, lambda c: c, cost, 3, "high")  # verifying 3 tokens costs as 1: draft on
    2
    >>> rate_length(sure, 3, 0, lambda c: c, cost, 3, "high") == rate_length(sure, 3, 0, lambda c: c, cost, 2, "high")
    True
    >>> rate_length([1.0, 0.1, 0.9, 0.9], 3, 0, lambda c: c, cost, 3, "high")  # the first token is a coin flip
    1
    >>> rate_length(sure, 0, 0, lambda c: c, cost, 3, "low"), rate_length(sure, 0, 0, lambda c: c, cost, 3, "high")
    (2, 3)
    """
    s, expected = 1.0, 1.0
    for i in range(max_k):
        if i > match:  # this token's chain left the output: its confidence is not in d
            return i + 1 if end == "low" else max_k
        p = f(d[j + i + 1]) if j + i + 1 < len(d) else 0.0
        s *= p
        expected += s
        k = i + 1
        longest = min(max_k, len(cost.target) - 1)
        if k >= longest:
            return k
        now = expected / cost.step(k)
        ahead, gain, q = expected, s, p
        for longer in range(k + 1, longest + 1):  # every longer length, the later tokens accepted at p each
            gain *= q
            ahead += gain
            if ahead / cost.step(longer) > now:
                break
        else:
            return k
    return max_k


def rate_stopping(output: dict, cost: StepCost, max_k: int, end: str):
    """Rate stopping over one output (a fresh calibration per generation)."""
    d, match, f = output["draft_confidence"], output["match"], Calibration()
    state = {}

    def choose(j: int) -> int:
        state["j"] = j
        return rate_length(d, match[j], j, f, cost, max_k, end)

    def update(k: int, accepted: int) -> None:
        j = state["j"]
        for i in range(min(k, accepted + 1, match[j] + 1)):  # verified tokens whose confidence is known
            if j + i + 1 < len(d):
                f.observe(d[j + i + 1], i < accepted)

    return walk(output["new_tokens"], match, choose, cost, update)


def evaluate(outputs: list[dict], cost: StepCost, max_k: int) -> dict:
    """Best fixed K, rate stopping (both ends), the clairvoyant bound, and what each drafts."""
    rates = {k: tokens_per_s(outputs, fixed(k, cost)) for k in range(1, max_k + 1)}
    best = max(rates, key=rates.get)
    runs = {end: [rate_stopping(o, cost, max_k, end) for o in outputs] for end in ("high", "low")}
    bound = tokens_per_s(outputs, lambda o: clairvoyant(o["new_tokens"], o["match"], cost, max_k))
    tokens = sum(o["new_tokens"] for o in outputs)
    gain = {end: rate(r) / rates[best] - 1 for end, r in runs.items()}
    return {"best_fixed_k": best, "best_fixed_tokens_per_s": rates[best],
            "fixed_tokens_per_s": {str(k): v for k, v in rates.items()},
            "rate_stopping_gain": [gain["high"], gain["low"]],
            "rate_stopping_target_calls_per_token": [sum(r.steps for r in runs[e]) / tokens for e in ("high", "low")],
            "rate_stopping_discarded_per_token": [sum(r.drafted - r.accepted for r in runs[e]) / tokens for e in ("high", "low")],
            "clairvoyant_gain": bound / rates[best] - 1,
            "share_of_clairvoyant": ([g / (bound / rates[best] - 1) for g in (gain["high"], gain["low"])]
                                     if bound > rates[best] else None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replay", default="benchmarks/results/adaptive_replay_t0_drawing.json",
                    help="a T = 0 replay_adaptive.py result (outputs, match, its own cost model)")
    ap.add_argument("--confidences", default="benchmarks/results/target_gate_replay_openvino.json",
                    help="a target_gate_replay.py result over the same outputs (draft_confidence)")
    ap.add_argument("--costs-from", default=None, metavar="PERF_RESULT")
    ap.add_argument("--costs-config", default="openvino-int4/int4v49152")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    replay = json.loads(Path(args.replay).read_text())
    conf = json.loads(Path(args.confidences).read_text())
    cost, source = greedy_replay_step_cost(replay, args.replay, args.costs_from, args.costs_config)
    max_k = replay["meta"]["args"]["max_k"]
    summary = {}
    for ds, outs in replay["outputs"].items():
        by_id = {o["prompt_id"]: o for o in conf["outputs"][ds]}
        outputs = [{"new_tokens": o["new_tokens"], "match": o["match"],
                    "draft_confidence": by_id[o["prompt_id"]]["draft_confidence"]} for o in outs]
        summary[ds] = evaluate(outputs, cost, max_k)
        r = summary[ds]
        print(f"{ds}: best fixed K = {r['best_fixed_k']} ({r['best_fixed_tokens_per_s']:.2f} tok/s); rate stopping "
              f"{r['rate_stopping_gain'][0]:+.1%} to {r['rate_stopping_gain'][1]:+.1%}; bound {r['clairvoyant_gain']:+.1%}")
    Path(args.out).write_text(json.dumps({
        "meta": {"script": "benchmarks/studies/confidence_cost_replay.py", "command": "python " + " ".join(sys.argv),
                 "replay": args.replay, "confidences": args.confidences, "max_k": max_k,
                 "cost": {"target_by_tokens": list(cost.target), "draft": cost.draft, "overhead_per_step": cost.overhead,
                          "source": source},
                 "calibration": {"bins": BINS, "prior_tokens": PRIOR_TOKENS},
                 "note": "step counts are exact replays; a step drafting past its first rejected token is scored at "
                         "both ends of its range ([slower, faster]); seconds are modelled; gains over the best fixed K"},
        "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
