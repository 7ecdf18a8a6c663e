"""Draft-length policies: how many tokens to draft before verifying.

A policy is asked three things by the engine, once per verification step:

``begin_step()``
    the most tokens to draft this step (``int >= 1``);
``keep_drafting(i, draft_probs, hidden)``
    after drafting token ``i`` (0-based) of the step, whether to draft another one. ``draft_probs``
    is ``[B, V]`` (the distribution token ``i`` was drawn from), ``hidden`` the drafter's last
    hidden state ``[B, H]`` when :attr:`needs_hidden` is set. One answer for the whole batch.
``update(num_drafted, num_accepted)``
    the outcome of the step (``num_accepted`` is ``[B]``).

A policy only decides *how many* tokens are verified, never *whether* they are accepted, so it
cannot change the output distribution of a lossless rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.errors import QuickdraftError


class Policy:
    """Interface; see the module docstring."""

    name: str = "policy"
    needs_hidden: bool = False

    def begin_step(self) -> int:
        raise NotImplementedError

    def keep_drafting(self, i: int, draft_probs: torch.Tensor, hidden: torch.Tensor | None) -> bool:
        return True

    def update(self, num_drafted: int, num_accepted: torch.Tensor) -> None:
        return None


@dataclass
class Constant(Policy):
    """Always draft ``k`` tokens."""

    k: int = 4
    name = "constant"

    def __post_init__(self) -> None:
        if int(self.k) != self.k or self.k < 1:
            raise QuickdraftError(f"draft length k must be an integer >= 1, got {self.k!r}")

    def begin_step(self) -> int:
        return self.k
