"""The optimal static race tree of a model pair: its rank law, estimated, and Tunstall's tree for it.

ERSD on a token tree (the ``race`` scheme of :mod:`quickdraft.decoding.tree`) drafts, at every node, the
draft's earliest exponential-race arrivals: child ``j`` (0-based) is the draft's ``j + 1``-th earliest
arrival at the child's position. The walk follows the target's race winner, so it goes down to child
``j`` exactly when the winner's *rank* in the draft's race is ``R = j + 1``. In the stationary model of
:mod:`quickdraft.theory.ersd` the ranks along the target's path are i.i.d. with the *rank law*

.. math:: c(j) = \\Pr[R = j + 1], \\qquad j = 0, 1, \\dots

and the expected tokens per target call of a tree (accepted + the recovered or bonus token) is
:math:`1 + \\sum_u \\prod_i c(u_i)`, maximised for ``N`` nodes by Tunstall's best-first tree
(:func:`quickdraft.theory.ersd.optimal_draft_tree`, ``docs/theory.md`` §9).

This module

1. counts ranks on logged distributions of a real pair (:func:`race_ranks`, :func:`greedy_ranks`,
   :func:`estimate_rank_law`): the target generates calibration text, both models read it back in one
   forward each, and at every position the rank of the target's race winner in the draft's race is
   counted over ``draws`` independent arrival-time vectors;
2. stores laws per temperature in a small JSON file (:class:`RankLawFile`); the default pair's file
   ships as ``quickdraft/rank_laws/default-openvino.json`` (made by ``benchmarks/estimate_rank_law.py``);
3. turns a law and a node budget into a static race tree (:func:`optimal_race_tree`,
   :func:`optimal_tree_config`), optionally no deeper than ``max_depth`` layers (the ``N`` nodes of
   largest reach among those at most ``max_depth`` deep still form a tree, so best-first search with
   the children of depth-``max_depth`` nodes given zero probability finds the best depth-capped tree).

At temperature 0 the race order is the draft's order by (temperature-1) probability and the target's
winner is its argmax, so the rank is the argmax's position in the draft's sorted distribution.

A static tree drafts, at a node, the ranks ``0 … c − 1`` (the ``c`` earliest arrivals), so a shape is
only expressible when no rank is skipped. Tunstall's tree on a non-increasing law never skips one; an
estimated law that increases somewhere (sampling noise in its tail) is first made non-increasing by
pooling adjacent violators (:func:`non_increasing`), which keeps its total mass.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import MAX_DRAFT_LENGTH
from quickdraft.verification.race import arrival_times, race_keys
from quickdraft.verification.sampling import GREEDY_TEMPERATURE, SamplingParams, logits_to_probs
from quickdraft.theory.ersd import DraftTree, optimal_draft_tree
from quickdraft.decoding.tree import RACE_SCHEME, TreeConfig

#: tree shapes a user can choose (``--tree-shape``): EAGLE-2-style per-step trees, or the static
#: Tunstall tree of the pair's rank law
TREE_SHAPES: tuple[str, ...] = ("dynamic", "optimal")
#: ranks counted by :func:`estimate_rank_law`; rarer ranks are dropped from the law (a tree of up to
#: 64 nodes never drafts a child of rank > 64)
MAX_RANK = 64
#: rank of a target winner the draft never proposes (draft probability 0)
NEVER = 0
#: the default pair's laws, shipped with the package
DEFAULT_RANK_LAW = "default-openvino.json"
#: |temperature difference| under which a stored law is used for a run's temperature
_TEMPERATURE_TOL = 1e-6
#: positions ranked at once by estimate_rank_law (bounds its float64 [rows, V] temporaries)
_ROWS = 32


# ---------------------------------------------------------------------------------------------
# counting ranks
# ---------------------------------------------------------------------------------------------


def race_ranks(target_probs: torch.Tensor, draft_probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Rank of the target's race winner in the draft's race, per row.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[R, V]`` processed distributions at the same position.
    keys:
        ``[R]`` int64 arrival-time keys (:func:`quickdraft.verification.race.race_keys`), shared by both races.

    Returns
    -------
    torch.Tensor
        ``[R]`` int64: ``1 + #{u : q(u)/E_u > q(Y)/E_Y}`` with ``Y = argmin_v E_v / p(v)``;
        :data:`NEVER` (0) where ``q(Y) = 0``.
    """
    r, v = target_probs.shape
    if draft_probs.shape != (r, v) or keys.shape != (r,):
        raise QuickdraftError(f"race_ranks: want [R, V] probs and [R] keys, got {tuple(target_probs.shape)}, "
                              f"{tuple(draft_probs.shape)}, {tuple(keys.shape)}")
    arrivals = arrival_times(keys, v)  # [R, V]
    winner = (target_probs / arrivals).argmax(dim=-1, keepdim=True)  # [R, 1]
    draft_rates = draft_probs.double() / arrivals  # [R, V], larger arrives earlier
    winner_rate = draft_rates.gather(1, winner)  # [R, 1]
    rank = 1 + (draft_rates > winner_rate).sum(dim=-1)
    return torch.where(winner_rate.squeeze(1) > 0, rank, NEVER)


def greedy_ranks(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Temperature-0 ranks: the position of the target's argmax in the draft's order by probability.

    ``target_logits``, ``draft_logits``: ``[R, V]``. Returns ``[R]`` int64, 1-based; :data:`NEVER`
    where the draft gives the argmax probability 0 (a token outside its vocabulary).
    """
    winner = target_logits.argmax(dim=-1, keepdim=True)  # [R, 1]
    draft = draft_logits.float()
    winner_logit = draft.gather(1, winner)  # [R, 1]
    rank = 1 + (draft > winner_logit).sum(dim=-1)
    return torch.where(torch.isfinite(winner_logit.squeeze(1)), rank, NEVER)


def rank_law_from_ranks(ranks: torch.Tensor | np.ndarray, max_rank: int = MAX_RANK) -> np.ndarray:
    """``[max_rank]`` empirical law: entry ``j`` is the share of ranks equal to ``j + 1``
    (:data:`NEVER` and ranks above ``max_rank`` count in the total only)."""
    ranks = np.asarray(ranks).reshape(-1)
    if ranks.size == 0:
        raise QuickdraftError("no ranks to estimate a law from")
    counts = np.bincount(ranks[(ranks >= 1) & (ranks <= max_rank)] - 1, minlength=max_rank)
    return counts / ranks.size


def non_increasing(law: Sequence[float]) -> np.ndarray:
    """The non-increasing sequence closest to ``law`` in least squares (pool adjacent violators);
    the total mass is kept. Unchanged when ``law`` is already non-increasing.

    >>> non_increasing([0.5, 0.1, 0.2, 0.05]).round(3).tolist()
    [0.5, 0.15, 0.15, 0.05]
    """
    blocks: list[list[float]] = []  # [sum, count]
    for x in np.asarray(law, dtype=np.float64):
        blocks.append([x, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    return np.concatenate([np.full(int(n), s / n) for s, n in blocks]) if blocks else np.zeros(0)


# ---------------------------------------------------------------------------------------------
# laws of a real pair
# ---------------------------------------------------------------------------------------------


@dataclass
class RankLaw:
    """The rank law of a pair at one temperature.

    Attributes
    ----------
    temperature: the sampling temperature the ranks were counted at (0: greedy ranks).
    probs: ``[max_rank]`` ``probs[j] = Pr[R = j + 1]``; the rest of the mass is rank > ``max_rank`` or never.
    positions: decoding positions counted.
    draws: arrival-time vectors per position (1 at temperature 0).
    never: share of ranks :data:`NEVER` (the target's token outside the draft's support).
    """

    temperature: float
    probs: list[float]
    positions: int
    draws: int
    never: float = 0.0

    @property
    def law(self) -> np.ndarray:
        return np.asarray(self.probs, dtype=np.float64)


@dataclass
class RankLawFile:
    """Rank laws of one pair, one per temperature, and what they were estimated on.

    Attributes
    ----------
    pair: ``{"target": ..., "draft": ..., "backend": ..., "quantize": ...}`` as given to the estimate.
    prompts: ids of the calibration prompts.
    max_new_tokens: calibration tokens the target generated per prompt.
    command: the command that made the file.
    laws: one :class:`RankLaw` per temperature.
    """

    pair: dict[str, Any]
    prompts: list[str]
    max_new_tokens: int
    command: str
    laws: list[RankLaw] = field(default_factory=list)

    def at(self, temperature: float) -> RankLaw:
        """The law counted at ``temperature`` (greedy temperatures match the greedy law)."""
        greedy = temperature < GREEDY_TEMPERATURE
        for law in self.laws:
            if (greedy and law.temperature < GREEDY_TEMPERATURE) or abs(law.temperature - temperature) < _TEMPERATURE_TOL:
                return law
        have = ", ".join(f"{law.temperature:g}" for law in self.laws) or "none"
        raise QuickdraftError(
            f"no rank law at temperature {temperature:g} (the file has {have}); estimate one with "
            "benchmarks/estimate_rank_law.py --temperatures ...")

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path | None = None) -> "RankLawFile":
        """Load ``path``; ``None`` or ``""``: the default pair's shipped file."""
        if not path:
            text = resources.files("quickdraft").joinpath("rank_laws", DEFAULT_RANK_LAW).read_text(encoding="utf-8")
        else:
            try:
                text = Path(path).read_text(encoding="utf-8")
            except OSError as exc:
                raise QuickdraftError(f"cannot read the rank law {path}: {exc}") from None
        try:
            raw = json.loads(text)
            laws = [RankLaw(**law) for law in raw.pop("laws")]
            return cls(**raw, laws=laws)
        except (ValueError, TypeError, KeyError) as exc:
            raise QuickdraftError(f"{path or DEFAULT_RANK_LAW} is not a rank-law file: {exc}") from None


@torch.inference_mode()
def estimate_rank_law(target, draft, sequences: Sequence[tuple[Sequence[int], int]], sampling: SamplingParams,
                      *, seed: int = 0, draws: int = 16, max_rank: int = MAX_RANK) -> RankLaw:
    """Count ranks on logged distributions of a pair.

    Parameters
    ----------
    target, draft:
        Model runners (``reset(1)``, ``forward(tokens [1, L]) -> logits [1, L, V]``); the draft's
        logits have the target's width (the runners pad a smaller draft vocabulary with ``-inf``).
    sequences:
        ``(token_ids, prompt_len)`` pairs: a prompt and the target's continuation. Every position from
        ``prompt_len − 1`` on (the distributions decoding saw) is counted.
    sampling:
        Processing of both distributions (temperature, top-k, top-p); greedy: :func:`greedy_ranks`.
    seed, draws:
        Arrival times: ``draws`` vectors per position, keyed by (seed, draw, position).
    """
    ranks = []
    for ids, prompt_len in sequences:
        if not 1 <= prompt_len <= len(ids):
            raise QuickdraftError(f"prompt_len {prompt_len} outside 1 … {len(ids)}")
        tokens = torch.tensor([list(ids)], dtype=torch.long)  # [1, L]
        logits = []
        for runner in (target, draft):
            runner.reset(1)
            logits.append(runner.forward(tokens).logits[0, prompt_len - 1 :].float())  # [P, V]
        target_logits, draft_logits = logits
        v = target_logits.shape[-1]
        draft_logits = draft_logits[:, :v]
        if sampling.greedy:
            ranks.append(greedy_ranks(target_logits, draft_logits))
            continue
        target_probs = logits_to_probs(target_logits, sampling)
        draft_probs = logits_to_probs(draft_logits, sampling)
        positions = torch.arange(prompt_len, len(ids) + 1)  # [P] absolute position of the predicted token
        for d in range(draws):
            keys = race_keys(seed, torch.full_like(positions, d), positions)
            for start in range(0, positions.shape[0], _ROWS):  # [rows, V] float64 at a time
                rows = slice(start, start + _ROWS)
                ranks.append(race_ranks(target_probs[rows], draft_probs[rows], keys[rows]))
    all_ranks = torch.cat(ranks).numpy()
    n_draws = 1 if sampling.greedy else draws
    return RankLaw(
        temperature=0.0 if sampling.greedy else float(sampling.temperature),
        probs=[float(x) for x in rank_law_from_ranks(all_ranks, max_rank)],
        positions=int(all_ranks.size // n_draws), draws=n_draws, never=float((all_ranks == NEVER).mean()),
    )


# ---------------------------------------------------------------------------------------------
# the optimal static race tree
# ---------------------------------------------------------------------------------------------


def optimal_race_tree(rank_law: Sequence[float], budget: int, max_depth: int = MAX_DRAFT_LENGTH) -> DraftTree:
    """Tunstall's tree of ``budget`` nodes for the rank law, at most ``max_depth`` layers deep.

    The law is made non-increasing first (:func:`non_increasing`; no change for an exact race law on
    the ranks that matter), so every node's children are ranks ``0 … c − 1`` and the paths are a
    valid static tree (:func:`quickdraft.decoding.tree.compile_paths`).

    >>> optimal_race_tree([0.6, 0.3, 0.1], 3).paths
    [[0], [0, 0], [1]]
    >>> optimal_race_tree([0.6, 0.3, 0.1], 3, max_depth=1).paths
    [[0], [1], [2]]
    """
    for name, value, low in (("budget", budget, 1), ("max_depth", max_depth, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise QuickdraftError(f"optimal tree {name} must be an integer >= {low}, got {value!r}")
    max_depth = min(int(max_depth), MAX_DRAFT_LENGTH)
    law = non_increasing(rank_law)
    if law.size == 0 or law[0] <= 0:
        raise QuickdraftError("the rank law gives rank 1 probability 0: no tree is worth drafting")
    leaf = np.zeros_like(law)
    tree = optimal_draft_tree(lambda path: law if len(path) < max_depth else leaf, int(budget))
    kept = [i for i, r in enumerate(tree.reach_probs) if r > 0]  # a law too short for the budget
    paths, reach = [tree.paths[i] for i in kept], [tree.reach_probs[i] for i in kept]
    return DraftTree(paths=paths, reach_probs=reach, expected_tokens=float(1.0 + sum(reach)))


def optimal_tree_config(rank_law: Sequence[float], budget: int, max_depth: int = MAX_DRAFT_LENGTH) -> TreeConfig:
    """The static race :class:`~quickdraft.decoding.tree.TreeConfig` of :func:`optimal_race_tree`."""
    paths = optimal_race_tree(rank_law, budget, max_depth).paths
    width = max(p[-1] for p in paths) + 1
    depth = max(len(p) for p in paths)
    return TreeConfig(depth=depth, topk=width, budget=len(paths), scheme=RACE_SCHEME,
                      paths=tuple(tuple(p) for p in paths))


def chain_paths(k: int) -> list[list[int]]:
    """The paths of a chain of ``k`` drafts (chain ERSD): ``[[0], [0, 0], …]``."""
    return [[0] * d for d in range(1, k + 1)]


def describe(law: Sequence[float], ranks: int = 4) -> str:
    """``c(1..4) = 0.712 0.091 0.036 0.019`` for logs and docs."""
    head = " ".join(f"{x:.3f}" for x in list(law)[:ranks])
    return f"c(1..{min(ranks, len(law))}) = {head}" if len(law) else "empty law"
