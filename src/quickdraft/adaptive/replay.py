"""Exact replay of drafter-invariant speculative decoding: draft-length policies compared without decoding.

At temperature 0 speculative decoding emits the target's greedy text whatever the draft length, so
a step that starts after ``j`` emitted tokens always sees the same context and the draft always
proposes the same chain ``y_0, y_1, ...`` from there. The same holds at any temperature for ERSD
(:class:`quickdraft.verification.rules.ExponentialRace`): every emitted token is the target's race
winner at its position, and the draft's proposal is its own race winner under the arrival times of
that position, so the output and the chain from every start are fixed by the seed whatever the draft
length (``propose`` in :func:`draft_chains`). Given the output ``x`` and, for every start ``j``,

* ``match[j]``: how many leading chain tokens equal ``x[j], x[j+1], ...`` (at most ``max_k``), and
* ``stop[j]``: how many tokens a policy drafts from there (its decision reads only the chain),

a run of any policy is a walk ``j -> j + min(match[j], stop[j]) + 1`` from ``j = 1`` (the
engine's prefill emits the first token) whose steps, drafted and
accepted tokens are *exactly* those of the engine (``tests/test_replay.py`` checks them against
:func:`quickdraft.decoding.engine.generate`). With the measured cost of a draft forward and of a target
forward over ``m`` tokens (:class:`quickdraft.backends.costs.StepCost`) the walk also gives the decode time, so every fixed K,
every threshold of every policy and the clairvoyant optimum (:func:`clairvoyant`: the draft length
chosen per step knowing ``match``) are compared on the same texts, free of the run-to-run noise of
wall-clock benchmarks. The time is a model (forwards only, plus a fixed per-step overhead); the
step counts are not.

Pure functions: :func:`walk`, :func:`clairvoyant`. Model side: :func:`draft_chains` (one
teacher-forced draft pass over prompt + output, then the chain from every start, driving the real
policy objects exactly as :class:`quickdraft.decoding.drafters.ModelDrafter` does; greedy, or
:func:`race_proposer` for ERSD); :func:`quickdraft.backends.costs.measure_step_cost` times the forwards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from quickdraft.backends.costs import StepCost
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Policy
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.race import race_keys, race_sample
from quickdraft.verification.sampling import SamplingParams, logits_to_probs, raw_probs


@dataclass
class ReplayResult:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    lengths: list[int] = field(default_factory=list)  # drafted tokens per step

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "new_tokens": self.new_tokens, "seconds": self.seconds}


def _check_match(match: Sequence[int], n_tokens: int) -> None:
    if len(match) < n_tokens:
        raise QuickdraftError(f"need a match length for each of the {n_tokens} starts, got {len(match)}")


def walk(
    n_tokens: int,
    match: Sequence[int],
    choose: Callable[[int], int],
    cost: StepCost | None = None,
    update: Callable[[int, int], None] | None = None,
    first: int = 1,
) -> ReplayResult:
    """Replay one generation of ``n_tokens`` tokens (greedy, or ERSD at any temperature).

    Parameters
    ----------
    n_tokens: length of the output (``max_new_tokens`` or up to EOS).
    match: ``match[j]``, leading draft tokens from start ``j`` equal to the output.
    choose: ``choose(j) -> k``, the draft length of the step that starts at ``j``; 0 is a plain
        step (a policy that may skip drafting, :class:`~quickdraft.decoding.policies.CostAware`).
    cost: optional; without it ``seconds`` stays 0.
    update: optional ``update(k, accepted)`` after each step (stateful policies such as Heuristic
        and CostAware; after a plain step the policy chose, ``update(0, 0)``).
    first: tokens emitted before the first step: the engine's prefill emits one.

    A step drafts ``k = min(choose(j), n_tokens - j - 1)`` tokens (as the engine, it drafts no more
    than the tokens left after the bonus token), accepts ``a = min(match[j], k)`` tokens and emits
    ``a + 1`` (the last one the target's correction or bonus token).

    >>> r = walk(5, [2, 0, 2, 1, 0], lambda j: 2)
    >>> r.steps, r.drafted, r.accepted, r.lengths
    (2, 4, 2, [2, 2])
    """
    _check_match(match, n_tokens)
    res = ReplayResult()
    j = min(int(first), n_tokens)
    while j < n_tokens:
        chosen = int(choose(j))
        if chosen < 0:
            raise QuickdraftError(f"a draft length must be >= 0 (0: a plain step), got {chosen} at start {j}")
        k = min(chosen, n_tokens - j - 1)
        a = min(int(match[j]), k)
        res.steps += 1
        res.drafted += k
        res.accepted += a
        res.lengths.append(k)
        if cost is not None:
            res.seconds += cost.step(k)
        if update is not None and (k > 0 or chosen == 0):  # a draft cut to nothing by the end does not
            update(k, a)
        j += a + 1
    res.new_tokens = n_tokens
    return res


def clairvoyant(n_tokens: int, match: Sequence[int], cost: StepCost, max_k: int, min_k: int = 1) -> ReplayResult:
    """The least decode time any draft-length policy with ``min_k <= k <= max_k`` can reach on this
    output: a dynamic programme over starts that knows ``match`` (how far the draft is right).
    ``min_k = 0`` admits plain steps (the choices of a policy that may skip drafting).

    ``V(j) = min_k cost(k') + V(min(n, j + min(match[j], k') + 1))``, ``V(n) = 0``, with
    ``k' = min(k, n - j - 1)`` the draft :func:`walk` (and the engine) makes; the walk starts at
    ``j = 1``, after the prefill's token. It is a bound, not a policy: no rule that sees only the
    draft can do better (its choices are among those tried).
    """
    _check_match(match, n_tokens)
    if not 0 <= min_k <= max_k:
        raise QuickdraftError(f"need 0 <= min_k <= max_k, got {min_k} and {max_k}")
    best = [0.0] * (n_tokens + 1)
    choice = [min_k] * n_tokens
    for j in range(n_tokens - 1, 0, -1):
        options = []
        for k in range(min_k, max_k + 1):
            drafted = min(k, n_tokens - j - 1)  # walk's cap by the tokens left
            options.append((cost.step(drafted) + best[min(n_tokens, j + min(int(match[j]), drafted) + 1)], k))
        best[j], choice[j] = min(options)
    res = walk(n_tokens, match, lambda j: choice[j], cost)
    assert abs(res.seconds - best[min(1, n_tokens)]) <= 1e-9 * max(1.0, best[min(1, n_tokens)])
    return res


# ---------------------------------------------------------------------------------------------
# model side
# ---------------------------------------------------------------------------------------------


@dataclass
class ChainTable:
    """Per start ``j``: ``match[j]`` and, per policy name, ``stops[name][j]``; ``forwards`` is the
    number of draft forwards it took to build (teacher-forced pass excluded)."""

    match: list[int]
    stops: dict[str, list[int]]
    forwards: int = 0


def draft_chains(
    draft: ModelRunner,
    prompt: Sequence[int],
    output: Sequence[int],
    policies: dict[str, Callable[[], Policy]],
    max_k: int,
    vocab_size: int,
    propose: Callable[[torch.Tensor, int], int] | None = None,
    rows: int = 1,
) -> ChainTable:
    """Draft chains from every start of ``output`` and where each policy stops them.

    The chain is greedy by default; ``propose(logits [1, V], position) -> token`` gives the draft's
    token at an absolute sequence position otherwise (:func:`race_proposer` for ERSD).

    ``policies`` maps names to factories of policies whose stop depends only on the current step's
    chain (``Confidence``, ``SpecDecPP``, ``Constant``; not ``Heuristic``, whose length comes from
    earlier steps -- replay it with :func:`walk`'s ``update``). Each is driven through
    ``begin_step`` / ``keep_drafting(i, raw_probs, hidden, token)`` exactly as
    :class:`quickdraft.decoding.drafters.ModelDrafter` drives it: ``hidden`` is the state whose logits drew
    token ``i``. A chain is extended until every policy has stopped and it has left the output
    (or reached ``max_k`` tokens).

    ``rows`` chains are drafted at once, one batch row per start, each a fork of the teacher-forced
    context rolled back to its start (:meth:`ModelRunner.select_rows`); row 0 keeps that context.
    A batched forward may round differently from a one-row one, so ``rows = 1`` (one chain at a
    time, as the engine drafts at B = 1) is the exact default; check a larger value against it.
    """
    if not prompt:
        raise QuickdraftError("draft_chains needs a non-empty prompt")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise QuickdraftError(f"rows must be an integer >= 1, got {rows!r}")
    n = len(output)
    if n == 0:
        return ChainTable(match=[], stops={name: [] for name in policies})
    p = len(prompt)
    draft.reset(1)
    full = torch.tensor([list(prompt) + list(output[:-1])], dtype=torch.long)
    tf = draft.forward(full, logits_to_keep=n, output_hidden=True)  # column j predicts output[j]
    tf_logits = tf.logits[0, :, :vocab_size]
    tf_hidden = tf.hidden[0]
    match: list[int] = []
    stops: dict[str, list[int]] = {name: [] for name in policies}
    forwards = 0
    context = list(prompt) + list(output)
    for first in range(0, n, rows):
        starts = list(range(first, min(n, first + rows)))
        g = len(starts)
        # Row 0 carries the teacher-forced context; rows 1..g fork it and keep the first p + j - 1
        # positions, the true context before start j: the first extension re-feeds context token
        # p + j - 1 with y_0 (as after a step of the engine, whose bonus token is fed with the draft).
        draft.select_rows([0] * (g + 1))
        draft.truncate(torch.tensor([int(draft.lengths[0])] + [p + j - 1 for j in starts]))
        live = [{name: make() for name, make in policies.items()} for _ in starts]
        length = [{name: pol.begin_step() for name, pol in pols.items()} for pols in live]
        for name, k in length[0].items():
            if k > max_k:
                raise QuickdraftError(f"policy {name} drafts up to {k} tokens, more than max_k = {max_k}")
        stopped = [{name: None for name in policies} for _ in starts]
        done = [False] * g
        m, on_output = [0] * g, [True] * g
        logits = tf_logits[first:first + g]
        hidden = tf_hidden[first:first + g]
        for i in range(max_k):
            raw = raw_probs(logits)  # [g, V]
            if propose is None:
                tokens = raw.argmax(dim=-1)  # [g]
            else:
                tokens = torch.tensor([int(propose(logits[r:r + 1], p + j + i)) for r, j in enumerate(starts)],
                                      dtype=torch.long)
            for r, j in enumerate(starts):
                if done[r]:
                    continue
                token = tokens[r:r + 1]
                if on_output[r] and j + i < n and int(token) == output[j + i]:
                    m[r] += 1
                else:
                    on_output[r] = False
                for name, pol in live[r].items():
                    if stopped[r][name] is None:
                        if i + 1 >= length[r][name]:
                            stopped[r][name] = length[r][name]
                        elif not pol.keep_drafting(i, raw[r:r + 1], hidden[r:r + 1], token=token):
                            stopped[r][name] = i + 1
                done[r] = i + 1 == max_k or (not on_output[r] and all(v is not None for v in stopped[r].values()))
            if all(done):
                break
            # row 0 (the context) and finished rows take padding columns: holes in their caches
            if i == 0:
                block = torch.stack([torch.tensor([context[p + j - 1] for j in starts]), tokens], dim=1)
            else:
                block = tokens.unsqueeze(1)
            block = torch.cat([torch.zeros(1, block.shape[1], dtype=torch.long), block])
            valid = torch.tensor([False] + [not d for d in done]).unsqueeze(1).expand_as(block)
            out = draft.forward(block, valid, output_hidden=True)
            forwards += sum(not d for d in done)
            logits, hidden = out.logits[1:, -1, :vocab_size], out.hidden[1:, -1]
        match.extend(m)
        for r in range(g):
            for name in policies:
                v = stopped[r][name]
                stops[name].append(v if v is not None else length[r][name])
        draft.select_rows([0])
    return ChainTable(match=match, stops=stops, forwards=forwards)


def race_proposer(seed: int, sampling: SamplingParams, row: int = 0) -> Callable[[torch.Tensor, int], int]:
    """The draft's ERSD proposal at an absolute position: its race winner over the processed
    distribution with the arrival times of (``seed``, ``row``, position), as
    :class:`quickdraft.verification.rules.ExponentialRace` proposes it in the engine."""
    def propose(logits: torch.Tensor, position: int) -> int:
        probs = logits_to_probs(logits, sampling)
        keys = race_keys(seed, torch.tensor([row]), torch.tensor([position]))
        return int(race_sample(probs, keys)[0])
    return propose
