"""What one speculative step costs on a backend: target forwards over blocks of ``m`` tokens and a
draft forward, measured on the runners themselves.

A step that drafts ``k`` tokens makes ``k`` draft forwards and one target forward over ``k + 1``
tokens. On a memory-bound target the second costs about one token's forward whatever ``k`` is; on
a compute-bound one (llama.cpp or OpenVINO on two AVX2 cores) it grows with ``k``, and a draft of
``k`` tokens pays only when it is accepted often enough. :class:`StepCosts` holds the measured
costs, :func:`measure_step_costs` measures them, and
:class:`quickdraft.decoding.policies.CostAware` drafts the length that maximises tokens per second
under them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from quickdraft.errors import QuickdraftError

#: target blocks measured by default (longer ones are extrapolated from the last two)
DEFAULT_BLOCKS: tuple[int, ...] = (1, 2, 3, 5, 9)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of the forwards of one step.

    Attributes
    ----------
    blocks: the measured target block sizes ``m``, increasing, starting at 1.
    verify_seconds: one target forward over ``m`` new tokens, per block.
    draft_seconds: one draft forward of one token (0 for a drafter without a model).
    """

    blocks: tuple[int, ...]
    verify_seconds: tuple[float, ...]
    draft_seconds: float = 0.0

    def __post_init__(self) -> None:
        if len(self.blocks) < 2 or self.blocks[0] != 1 or list(self.blocks) != sorted(set(self.blocks)):
            raise QuickdraftError(f"StepCosts needs at least two blocks, increasing from 1, got {self.blocks!r}")
        if len(self.verify_seconds) != len(self.blocks):
            raise QuickdraftError(f"{len(self.blocks)} blocks but {len(self.verify_seconds)} verify_seconds")
        if not all(s > 0 for s in self.verify_seconds) or not self.draft_seconds >= 0:
            raise QuickdraftError("forward costs must be positive (draft_seconds may be 0)")

    def verify(self, m: int) -> float:
        """Seconds of one target forward over ``m >= 1`` tokens: linear between measured blocks,
        extrapolated from the last two beyond them, never below the cost of one token.

        >>> StepCosts((1, 3), (1.0, 2.0)).verify(2), StepCosts((1, 3), (1.0, 2.0)).verify(5)
        (1.5, 3.0)
        """
        blocks, secs = self.blocks, self.verify_seconds
        if m <= 1:
            return secs[0]
        i = next((j for j in range(1, len(blocks)) if blocks[j] >= m), len(blocks) - 1)
        m0, m1, s0, s1 = blocks[i - 1], blocks[i], secs[i - 1], secs[i]
        return max(secs[0], s0 + (s1 - s0) * (m - m0) / (m1 - m0))

    def step(self, k: int) -> float:
        """Seconds of a step that drafts ``k`` tokens: ``k`` draft forwards and one target forward
        over ``k + 1`` tokens (``k = 0``: a plain step)."""
        return self.verify(k + 1) + k * self.draft_seconds

    def without_draft(self) -> "StepCosts":
        """The same costs for a drafter without a model (prompt lookup, retrieval)."""
        return StepCosts(self.blocks, self.verify_seconds, 0.0)


def _timed_forward(runner, block: torch.Tensor) -> float:
    block = block.to(getattr(runner, "device", "cpu"))
    start = time.perf_counter()
    runner.forward(block, logits_to_keep=block.shape[1])
    return time.perf_counter() - start


def measure_step_costs(target, draft=None, context: list[int] | None = None,
                       blocks: tuple[int, ...] = DEFAULT_BLOCKS, repeats: int = 2) -> StepCosts:
    """Time target forwards over each of ``blocks`` new tokens after ``context`` (and a one-token
    draft forward), the fastest of ``repeats`` after one warm-up, made non-decreasing in the block
    size; the runners are left reset to one empty row.

    ``target`` and ``draft`` are runners (``reset``, ``forward``, ``truncate``, ``lengths``); the
    default context is 128 arbitrary token ids, about the length of a short prompt.
    """
    if len(blocks) < 2 or blocks[0] != 1:
        raise QuickdraftError(f"blocks must start at 1 and name at least two sizes, got {blocks!r}")
    vocab = int(target.model.config.vocab_size)
    context = list(context) if context is not None else [(7 * i + 11) % min(vocab, 1000) for i in range(128)]
    if len(context) < max(blocks):
        raise QuickdraftError(f"a context of {len(context)} tokens cannot supply a block of {max(blocks)}")
    best: dict[tuple[str, int], float] = {}
    roles = [("target", target, blocks)] + ([("draft", draft, (1,))] if draft is not None else [])
    for role, runner, sizes in roles:
        runner.reset(1)
        runner.forward(torch.tensor([context]).to(getattr(runner, "device", "cpu")), logits_to_keep=1)
        base = runner.lengths.clone()
        for rep in range(repeats + 1):
            for m in sizes:
                seconds = _timed_forward(runner, torch.tensor([context[-m:]]))
                runner.truncate(base)
                if rep:  # the first round warms the runtime up
                    best[(role, m)] = min(best.get((role, m), seconds), seconds)
        runner.reset(1)
    verify = [best[("target", m)] for m in blocks]
    for i in range(1, len(verify)):  # a longer block never costs less: timing noise is not a saving
        verify[i] = max(verify[i], verify[i - 1])
    return StepCosts(tuple(blocks), tuple(verify), best[("draft", 1)] if draft is not None else 0.0)
