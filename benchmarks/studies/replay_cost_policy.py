"""The cost policy (`--policy cost`) in the exact replay: against every fixed K and the clairvoyant bound.

`CostAware` decides each step's length from its running acceptance estimate and the step costs alone,
so its run on a stored output is a walk of :func:`quickdraft.adaptive.replay.walk` driven by the
real policy object (``begin_step`` / ``update``, as the engine calls them; a plain step is a length
of 0). No model is needed: this script reads the outputs (``match[j]`` for every start) and the step
costs of committed replay results (``benchmarks/studies/replay_adaptive.py``) and, for each, walks
every fixed K = 1 … ``max_k``, the cost policy at ``max_k``, and the clairvoyant optimum over
1 … ``max_k`` (the bound of the SpecDec++ goal) and over 0 … ``max_k`` (plain steps admitted, the
choices the cost policy has), all from the first token after the prefill's, as the engine runs.
``--variants`` adds the policy with other settings (``VARIANTS``: studied, not adopted);
``--cost-max-k 4`` the policy drafting at most 4 tokens (``cost_max4``: ``quickdraft generate``'s
default, ``--k 4`` under ``--policy auto``).

    python benchmarks/studies/replay_cost_policy.py --variants --cost-max-k 4 --out benchmarks/results/replay_cost_policy.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from quickdraft.adaptive.replay import clairvoyant, walk
from quickdraft.backends.costs import StepCost
from quickdraft.decoding.policies import CostAware, best_draft_length

RESULTS = Path(__file__).resolve().parents[1] / "results"
DEFAULT_REPLAYS = ("adaptive_replay_t0.json", "adaptive_replay_t0_openvino.json",
                   "adaptive_replay_ersd_t0.7.json", "adaptive_replay_ersd_t0.7_openvino.json")


class LongProbe(CostAware):
    """A variant: the probe after ``probe_every`` plain steps drafts the length that would pay at
    ``probe_alpha``, not one token."""

    def begin_step(self) -> int:
        k = best_draft_length(self.alpha, self.costs, self.max_k)
        if k == 0 and self.plain_steps >= self.probe_every:
            return best_draft_length(self.probe_alpha, self.costs, self.max_k)
        return k


class PositionalAcceptance(CostAware):
    """A variant: instead of one geometric rate, an acceptance estimate per draft position — the
    hazard ``h_i`` that token ``i`` is rejected once the ones before it were accepted (rejections
    at ``i`` over the drafts that reached ``i``, decayed by ``memory`` each drafting step, with a
    prior ``1 - prior`` of weight ``prior_weight`` at every position), so that runs of accepted
    tokens (code) may make the later positions safer than the first; ``E[tokens | k] = 1 +
    Σ_{i ≤ k} Π_{j ≤ i} (1 - h_j)``. Its settings (prior 0.95, weight 2, memory 0.95) are the best
    worst case of 18 tried on these same outputs: an estimate tuned on the test prompts."""

    def reset(self) -> None:
        super().reset()
        self.reached = [0.0] * (self.max_k + 1)
        self.failed = [0.0] * (self.max_k + 1)

    def expected_by_length(self) -> list[float]:
        expected, survive = [1.0], 1.0
        for i in range(1, self.max_k + 1):
            survive *= 1 - (self.failed[i] + (1 - self.prior) * self.prior_weight) / (self.reached[i] + self.prior_weight)
            expected.append(expected[-1] + survive)
        return expected

    def update(self, num_drafted: int, num_accepted: torch.Tensor) -> None:
        super().update(num_drafted, num_accepted)
        if num_drafted == 0 or num_accepted.numel() == 0:
            return
        self.reached = [self.memory * x for x in self.reached]
        self.failed = [self.memory * x for x in self.failed]
        for a in num_accepted.clamp(0, num_drafted).tolist():
            for i in range(1, min(a + 1, num_drafted) + 1):
                self.reached[i] += 1
            if a < num_drafted:
                self.failed[a + 1] += 1


#: the cost policy with other settings, walked with ``--variants``
VARIANTS = {
    "cost_positional": lambda cost, k: PositionalAcceptance(max_k=k, costs=cost, prior=0.95, memory=0.95),
    "cost_long_probe": lambda cost, k: LongProbe(max_k=k, costs=cost),
    "cost_long_probe_every4": lambda cost, k: LongProbe(max_k=k, costs=cost, probe_every=4),
    "cost_memory0.7": lambda cost, k: CostAware(max_k=k, costs=cost, memory=0.7),
    "cost_memory0.97": lambda cost, k: CostAware(max_k=k, costs=cost, memory=0.97),
}


def step_cost(meta: dict) -> StepCost:
    sc = meta["step_cost"]
    return StepCost(target=tuple(sc["target_by_tokens"]), draft=sc["draft"], overhead=sc.get("overhead_per_step", 0.0))


def replay_output(n: int, match: list[int], cost: StepCost, max_k: int, variants: bool = False,
                  cost_max_k: tuple[int, ...] = ()) -> dict[str, dict]:
    runs = {f"fixed_k{k}": walk(n, match, lambda j, k=k: k, cost) for k in range(1, max_k + 1)}
    policies = {"cost": lambda cost, k: CostAware(max_k=k, costs=cost), **(VARIANTS if variants else {})}
    policies.update({f"cost_max{m}": lambda cost, k, m=m: CostAware(max_k=m, costs=cost) for m in cost_max_k})
    for name, make in policies.items():
        policy = make(cost, max_k)
        runs[name] = walk(n, match, lambda j, p=policy: p.begin_step(), cost,
                          update=lambda k, a, p=policy: p.update(k, torch.tensor([a])))
    runs["clairvoyant"] = clairvoyant(n, match, cost, max_k)
    runs["clairvoyant_plain"] = clairvoyant(n, match, cost, max_k, min_k=0)
    return {name: {**r.as_dict(), "lengths": r.lengths} for name, r in runs.items()}


def summarise(runs: list[dict[str, dict]]) -> dict:
    names = list(runs[0])
    rate = {n: sum(r[n]["new_tokens"] for r in runs) / sum(r[n]["seconds"] for r in runs) for n in names}
    fixed = max((n for n in names if n.startswith("fixed_k")), key=rate.get)
    gain = {n: rate[n] / rate[fixed] - 1 for n in names}
    steps = {n: sum(r[n]["steps"] for r in runs) for n in names}
    plain = sum(sum(1 for k in r["cost"]["lengths"] if k == 0) for r in runs)
    return {
        "prompts": len(runs), "new_tokens": sum(r[fixed]["new_tokens"] for r in runs), "best_fixed": fixed,
        "tokens_per_s": rate, "gain_over_best_fixed": gain, "steps": steps,
        "cost_plain_steps": plain, "cost_mean_draft_len": sum(r["cost"]["drafted"] for r in runs) / steps["cost"],
        "cost_share_of_clairvoyant": gain["cost"] / gain["clairvoyant"] if gain["clairvoyant"] > 0 else None,
        "cost_share_of_clairvoyant_plain": (gain["cost"] / gain["clairvoyant_plain"]
                                            if gain["clairvoyant_plain"] > 0 else None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("replays", nargs="*", default=[str(RESULTS / f) for f in DEFAULT_REPLAYS],
                        help="replay results of replay_adaptive.py (default: the committed T = 0 and ERSD T = 0.7 "
                             "replays, under their own and the openvino backend's costs)")
    parser.add_argument("--variants", action="store_true", help="also walk the VARIANTS of the policy")
    parser.add_argument("--cost-max-k", type=int, nargs="*", default=[], help="also the policy at these longest drafts")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"command": "python " + " ".join(sys.argv), "replays": {}}
    for path in map(Path, args.replays):
        replay = json.loads(path.read_text())
        meta = replay["meta"]
        cost, max_k = step_cost(meta), int(meta["args"]["max_k"])
        entry = {"setting": meta.get("setting"), "temperature": meta["args"].get("temperature", 0.0),
                 "max_k": max_k, "step_cost": {"target": list(cost.target), "draft": cost.draft,
                                               "overhead": cost.overhead, "source": meta["step_cost"].get("config")},
                 "datasets": {}}
        for dataset, outputs in replay["outputs"].items():
            runs = [replay_output(o["new_tokens"], o["match"], cost, max_k, args.variants, tuple(args.cost_max_k))
                    for o in outputs]
            entry["datasets"][dataset] = {"summary": summarise(runs),
                                          "outputs": [{"prompt_id": o["prompt_id"], "runs": r}
                                                      for o, r in zip(outputs, runs)]}
            s = entry["datasets"][dataset]["summary"]
            share = s["cost_share_of_clairvoyant"]
            print(f"{path.name:42s} {dataset:9s} best fixed {s['best_fixed']:10s} "
                  f"{s['tokens_per_s'][s['best_fixed']]:.3f} tok/s; cost {s['gain_over_best_fixed']['cost']:+.1%} "
                  f"({'-' if share is None else f'{share:.0%}'} of the bound {s['gain_over_best_fixed']['clairvoyant']:+.1%}; "
                  f"with plain steps {s['gain_over_best_fixed']['clairvoyant_plain']:+.1%}); "
                  f"plain steps {s['cost_plain_steps']} of {s['steps']['cost']}, mean draft {s['cost_mean_draft_len']:.2f}"
                  + "".join(f"; {n} {g:+.1%}" for n, g in s["gain_over_best_fixed"].items() if n in VARIANTS)
                  + "".join(f"; cost_max{m} {s['tokens_per_s'][f'cost_max{m}'] / s['tokens_per_s'][f'fixed_k{m}']:.3f}x "
                            f"fixed K = {m}" for m in args.cost_max_k))
        result["replays"][path.name] = entry
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
