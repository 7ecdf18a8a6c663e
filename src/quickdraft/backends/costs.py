"""What one speculative step costs on a backend: a target forward over ``m`` tokens and a draft
forward, measured on the runners themselves.

A step that drafts ``k`` tokens makes ``k`` draft forwards and one target forward over ``k + 1``
tokens. On a memory-bound target the second costs about one token's forward whatever ``k`` is; on
a compute-bound one (llama.cpp or OpenVINO on two AVX2 cores) it grows with ``k``, and a draft of
``k`` tokens pays only when it is accepted often enough. :class:`StepCost` holds the costs,
:func:`measure_step_cost` measures them; the exact replay of draft-length policies
(:mod:`quickdraft.adaptive.replay`) models decode time with them, and
:class:`quickdraft.decoding.policies.CostAware` drafts the length that maximises tokens per second
under them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from statistics import median
from typing import Sequence

import torch

from quickdraft.errors import QuickdraftError


@dataclass(frozen=True)
class StepCost:
    """Seconds of one speculative step that drafts ``k`` tokens: ``k`` draft forwards, one target
    forward over ``k + 1`` tokens (the drafted ones and the token before them), plus ``overhead``.

    ``target[m - 1]`` is the target forward time over ``m`` tokens, ``m = 1 .. len(target)``.
    """

    target: tuple[float, ...]
    draft: float
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if not self.target or min(self.target) <= 0 or self.draft < 0 or self.overhead < 0:
            raise QuickdraftError(f"step cost needs positive target times and non-negative draft/overhead, got {self}")

    def step(self, k: int) -> float:
        if not 1 <= k + 1 <= len(self.target):
            raise QuickdraftError(f"no target time for a {k + 1}-token verification (have 1..{len(self.target)})")
        return k * self.draft + self.target[k] + self.overhead

    def without_draft(self) -> "StepCost":
        """The same step for a drafter without a model (prompt lookup, retrieval): free drafts."""
        return dataclasses.replace(self, draft=0.0)


def measure_step_cost(target, draft, context: Sequence[int], max_k: int, repeats: int = 5) -> StepCost:
    """Median forward times after ``context``: the target over ``m = 1 .. max_k + 1`` tokens and the
    draft (a runner, or ``None``: cost 0) over one token, each rolled back after timing (so every one
    sees the same cache). The sizes are timed round-robin, ``repeats`` rounds after a warm-up, so a
    slow phase of the machine spreads over all; the runners are left holding ``context``."""
    if len(context) < max_k + 1:
        raise QuickdraftError(f"measure_step_cost needs a context of at least max_k + 1 = {max_k + 1} tokens")
    runners = [r for r in (target, draft) if r is not None]
    ctx = torch.tensor([list(context)], dtype=torch.long)
    for runner in runners:
        runner.reset(1)
        runner.forward(ctx.to(getattr(runner, "device", "cpu")), logits_to_keep=1)
    base = torch.tensor([len(context)])

    def run(runner, m: int) -> float:
        block = ctx[:, -m:].to(getattr(runner, "device", "cpu"))
        t0 = time.perf_counter()
        runner.forward(block, logits_to_keep=m)
        seconds = time.perf_counter() - t0
        runner.truncate(base.to(runner.lengths.device))
        return seconds

    for runner in runners:  # warm-up
        run(runner, 1)
    target_times: list[list[float]] = [[] for _ in range(max_k + 1)]
    draft_times: list[float] = []
    for _ in range(repeats):
        for m in range(1, max_k + 2):
            target_times[m - 1].append(run(target, m))
        if draft is not None:
            draft_times.append(run(draft, 1))
    return StepCost(target=tuple(median(t) for t in target_times), draft=median(draft_times) if draft_times else 0.0)
