"""Acceptance rules for chain verification, behind one interface.

A rule answers four questions for :func:`quickdraft.verify.verify_chain`:

``propose``
    which token the drafter emits from its distribution at one position (sampling from it for the
    lossless rule, its argmax for greedy rules). The engine drafts through the rule, so a draft can
    never be sampled one way and verified as if it had been sampled another way.
``accept``
    for every draft position, is the drafted token accepted, assuming all earlier ones were? Only
    the longest all-accepted prefix is used.
``correct``
    the token emitted at the first rejected position (the *recovered* token).
``bonus``
    the token emitted after a fully accepted draft, from the target's last distribution.

Rules are small frozen dataclasses; their parameters are validated on construction. Rules that
need more than the processed distributions (raw temperature-1 distributions, absolute positions
for shared randomness) receive them through :class:`VerifyContext`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch

from quickdraft.sampling import sample


@dataclass
class VerifyContext:
    """Side information a rule may use.

    Attributes
    ----------
    generator:
        Random source for uniform draws and sampling (``None``: torch's global generator).
    positions:
        ``[B]`` int64 absolute position (tokens before it in the sequence) of the first draft token
        of each row; rules with shared randomness key their noise on it.
    raw_draft_probs, raw_target_probs:
        Temperature-1, unwarped distributions with the shapes of ``draft_probs`` / ``target_probs``;
        divergence-based rules use them when present.
    """

    generator: torch.Generator | None = None
    positions: torch.Tensor | None = None
    raw_draft_probs: torch.Tensor | None = None
    raw_target_probs: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)


class Rule(abc.ABC):
    """Interface of an acceptance rule (see the module docstring)."""

    #: name used in the CLI, in results and in docs
    name: str = "rule"
    #: True when the emitted tokens are distributed exactly as the target's (processed) distribution
    lossless: bool = True
    #: True when drafts are the drafter's argmax rather than samples
    greedy_drafts: bool = False

    def propose(self, draft_probs: torch.Tensor, ctx: VerifyContext, offset: int = 0) -> torch.Tensor:
        """Draft one token per row from ``draft_probs [B, V]`` at draft position ``offset``."""
        if self.greedy_drafts:
            return draft_probs.argmax(dim=-1)
        return sample(draft_probs, ctx.generator)

    @abc.abstractmethod
    def accept(
        self,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor,
        target_probs: torch.Tensor,
        ctx: VerifyContext,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-position decisions ``[B, K]`` bool, and optionally a ``[B, K]`` bool mask of the
        positions accepted by a lossy criterion (``None`` when the rule has none)."""

    def correct(
        self,
        rejected_ids: torch.Tensor,
        draft_probs: torch.Tensor,
        target_probs: torch.Tensor,
        ctx: VerifyContext,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        """Token ``[B]`` emitted at the first rejection (rows ``[B, V]``; ``offsets`` = draft index)."""
        return sample(target_probs, ctx.generator)

    def bonus(self, target_probs: torch.Tensor, ctx: VerifyContext, offsets: torch.Tensor) -> torch.Tensor:
        """Token ``[B]`` emitted after a fully accepted draft, from ``target_probs [B, V]``."""
        if self.greedy_drafts:
            return target_probs.argmax(dim=-1)
        return sample(target_probs, ctx.generator)


def _gather_token_probs(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class Lossless(Rule):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft token x with probability min(1, p(x)/q(x)); at the first rejection emit a token
    from the residual norm(max(0, p − q)). Then for every x,
    q(x)·a(x) + (1 − Σ_y q(y)·a(y))·r(x) = p(x): the output is distributed exactly as p.
    """

    name = "lossless"
    lossless = True
    greedy_drafts = False

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        p = _gather_token_probs(target_probs, draft_ids)
        q = _gather_token_probs(draft_probs, draft_ids)
        u = torch.rand(p.shape, generator=ctx.generator, device=p.device)
        # u < p/q written without division; q > 0 for every token that was actually drafted
        return u * q < p, None

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        return sample(residual(target_probs, draft_probs), ctx.generator)


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) row-wise; rows where p ≤ q everywhere (p = q) fall back to p."""
    res = (target_probs - draft_probs).clamp_min(0)
    mass = res.sum(dim=-1, keepdim=True)
    return torch.where(mass > 1e-12, res / mass.clamp_min(1e-30), target_probs)


@dataclass(frozen=True)
class Greedy(Rule):
    """Exact match: accept a draft token iff it is the target's argmax; emit the argmax otherwise.

    With greedy drafts this reproduces plain greedy decoding of the target token for token.
    """

    name = "greedy"
    lossless = True
    greedy_drafts = True

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return draft_ids == target_probs.argmax(dim=-1), None

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        return target_probs.argmax(dim=-1)
