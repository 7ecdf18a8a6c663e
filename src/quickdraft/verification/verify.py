"""Chain verification as a pure, batched function.

Terms, used with these meanings everywhere in quickdraft (code, CLI, results, docs):

draft tokens
    The K tokens a drafter proposes after the current sequence, ``x_1 … x_K``.
accepted tokens
    The longest prefix ``x_1 … x_n`` (0 ≤ n ≤ K) of draft tokens that the rule accepts, each
    accepted given that all earlier ones were. ``num_accepted`` is n.
recovered token
    When n < K, the token the rule emits in place of the first rejected draft token ``x_{n+1}``
    (for the lossless rule, a sample of the residual distribution norm(max(0, p − q))).
bonus token
    When n = K, the extra token sampled from the target's distribution after the last draft token,
    which the verifying forward computed anyway.
acceptance length
    Tokens emitted per verification step: n + 1 (the accepted tokens plus the one recovered or
    bonus token). Its mean over steps is the *mean acceptance length*, which equals the number of
    new tokens per target forward.
acceptance rate at draft position i
    Among steps that drafted at least i tokens and accepted the first i − 1, the share that accepted
    the i-th (1-based).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.verification.rules import Rule, VerifyContext
from quickdraft.verification.sampling import check_distributions

#: the longest draft any policy may ask for in one step (``--k`` and every ``max_k``): one draft
#: forward per token makes a longer draft cost more than it can save, and the verifying target
#: forward grows with it
MAX_DRAFT_LENGTH = 64


@dataclass
class Verification:
    """Result of one chain verification step.

    Attributes
    ----------
    output_ids:
        ``[B, K+1]`` int64: the accepted tokens, then the recovered-or-bonus token, then ``-1``.
    num_accepted:
        ``[B]`` int64 number of accepted draft tokens n (the row emits n + 1 tokens).
    num_lossy:
        ``[B]`` int64 how many of the accepted tokens were accepted by a lossy criterion (for
        example a fuzzy acceptance of FSD); zeros for lossless rules.
    """

    output_ids: torch.Tensor
    num_accepted: torch.Tensor
    num_lossy: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1


def _check_inputs(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                  check_probs: bool = True) -> None:
    for who, t in (("draft_ids", draft_ids), ("draft_probs", draft_probs), ("target_probs", target_probs)):
        if not isinstance(t, torch.Tensor):
            raise QuickdraftError(f"{who} must be a torch.Tensor, got {type(t).__name__}")
    if draft_ids.dim() != 2:
        raise QuickdraftError(f"draft_ids must be [B, K], got shape {tuple(draft_ids.shape)}")
    b, k = draft_ids.shape
    if draft_probs.dim() != 3 or draft_probs.shape[:2] != (b, k):
        raise QuickdraftError(f"draft_probs must be [B={b}, K={k}, V], got shape {tuple(draft_probs.shape)}")
    if target_probs.dim() != 3 or target_probs.shape[:2] != (b, k + 1):
        raise QuickdraftError(f"target_probs must be [B={b}, K+1={k + 1}, V], got shape {tuple(target_probs.shape)}")
    if draft_probs.shape[-1] != target_probs.shape[-1]:
        raise QuickdraftError(
            f"draft and target vocabularies differ in size: {draft_probs.shape[-1]} vs {target_probs.shape[-1]}"
        )
    if draft_ids.dtype != torch.int64:
        raise QuickdraftError(f"draft_ids must be int64, got {draft_ids.dtype}")
    v = draft_probs.shape[-1]
    if k and (draft_ids.min() < 0 or draft_ids.max() >= v):
        raise QuickdraftError(f"draft_ids out of range [0, {v})")
    if check_probs:
        check_distributions(draft_probs, "draft_probs")
        check_distributions(target_probs, "target_probs")


def verify_chain(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    rule: Rule,
    generator: torch.Generator | None = None,
    *,
    ctx: VerifyContext | None = None,
    draft_lengths: torch.Tensor | None = None,
    check_probs: bool = True,
) -> Verification:
    """Verify a chain of K draft tokens per row against the target, in one batched call.

    Parameters
    ----------
    draft_ids:
        ``[B, K]`` int64 draft tokens.
    draft_probs:
        ``[B, K, V]`` the distributions the draft tokens were drawn from.
    target_probs:
        ``[B, K+1, V]`` the target's distributions at the same positions; the last row is the
        distribution of the bonus token. Both must be distributions: finite, non-negative, each
        summing to 1 within :data:`quickdraft.verification.sampling.ROW_SUM_TOLERANCE`
        (:func:`quickdraft.verification.sampling.check_distributions`).
    rule:
        An acceptance rule from :mod:`quickdraft.verification.rules`.
    generator:
        Random source (overrides ``ctx.generator`` when given).
    ctx:
        Optional side information (raw distributions, absolute positions) for rules that use it.
    draft_lengths:
        Optional ``[B]`` int64: row ``b`` drafted only its first ``draft_lengths[b]`` tokens (the
        rest is padding that is never accepted); a row that accepts all of its own drafts gets
        its bonus token from ``target_probs[b, draft_lengths[b]]``.
    check_probs:
        Check that both inputs are distributions (default). The engine, which builds them itself
        with :func:`quickdraft.verification.sampling.logits_to_probs` from logits its runners have checked,
        skips the check: over ``[B, K+1, V]`` it costs a few passes over the vocabulary per step.

    Returns
    -------
    Verification
    """
    _check_inputs(draft_ids, draft_probs, target_probs, check_probs)
    ctx = ctx or VerifyContext()
    if generator is not None:
        ctx.generator = generator
    b, k = draft_ids.shape
    device = draft_ids.device
    rows = torch.arange(b, device=device)

    if k > 0:
        accepted, lossy = rule.accept(draft_ids, draft_probs, target_probs[:, :k], ctx)
        if draft_lengths is not None:
            accepted = accepted & (torch.arange(k, device=device).unsqueeze(0) < draft_lengths.unsqueeze(1))
        prefix = accepted.long().cumprod(dim=-1)
        num_accepted = prefix.sum(dim=-1)
        num_lossy = (prefix.bool() & lossy).long().sum(dim=-1) if lossy is not None else torch.zeros_like(num_accepted)
    else:
        num_accepted = torch.zeros(b, dtype=torch.long, device=device)
        num_lossy = torch.zeros_like(num_accepted)

    p_next = target_probs[rows, num_accepted]
    full = num_accepted == (k if draft_lengths is None else draft_lengths)
    last = torch.empty(b, dtype=torch.long, device=device)
    if full.any():
        idx = full.nonzero().squeeze(-1)
        last[idx] = rule.bonus(p_next[idx], _subset(ctx, idx), num_accepted[idx])
    if (~full).any():
        idx = (~full).nonzero().squeeze(-1)
        pos = num_accepted[idx].clamp_max(max(k - 1, 0))
        last[idx] = rule.correct(
            draft_ids[idx, pos], draft_probs[idx, pos], p_next[idx], _subset(ctx, idx), pos
        )

    out = torch.full((b, k + 1), -1, dtype=torch.long, device=device)
    cols = torch.arange(k + 1, device=device).unsqueeze(0)
    keep = cols < num_accepted.unsqueeze(1)
    if k > 0:
        out[:, :k] = torch.where(keep[:, :k], draft_ids, out[:, :k])
    out[rows, num_accepted] = last
    return Verification(output_ids=out, num_accepted=num_accepted, num_lossy=num_lossy)


def verify_greedy_ids(draft_ids: torch.Tensor, target_ids: torch.Tensor,
                      draft_lengths: torch.Tensor | None = None) -> Verification:
    """:func:`verify_chain` with the :class:`~quickdraft.verification.rules.Greedy` rule at temperature 0,
    on token ids: the same result from the target's argmax ids instead of its one-hot distributions.

    ``draft_ids [B, K]``; ``target_ids [B, K+1]`` the argmax of the target's logits after each draft
    prefix; ``draft_lengths`` as for :func:`verify_chain`. A draft token is accepted while it equals
    the target's argmax; the first mismatch (or, after a fully accepted draft, the last column)
    emits the target's argmax. Nothing here reads the vocabulary, so a step costs ``O(B·K)``.
    """
    if draft_ids.dim() != 2 or target_ids.dim() != 2 or target_ids.shape != (draft_ids.shape[0], draft_ids.shape[1] + 1):
        raise QuickdraftError(f"draft_ids must be [B, K] and target_ids [B, K+1], got shapes "
                              f"{tuple(draft_ids.shape)} and {tuple(target_ids.shape)}")
    b, k = draft_ids.shape
    device = draft_ids.device
    rows = torch.arange(b, device=device)
    cols = torch.arange(k + 1, device=device).unsqueeze(0)
    accepted = draft_ids == target_ids[:, :k]
    if draft_lengths is not None:
        accepted = accepted & (cols[:, :k] < draft_lengths.unsqueeze(1))
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)
    out = torch.where(cols < num_accepted.unsqueeze(1), torch.cat([draft_ids, target_ids[:, -1:]], dim=1), -1)
    out[rows, num_accepted] = target_ids[rows, num_accepted]
    return Verification(output_ids=out, num_accepted=num_accepted, num_lossy=torch.zeros_like(num_accepted))


def _subset(ctx: VerifyContext, idx: torch.Tensor) -> VerifyContext:
    """The context restricted to the rows ``idx`` (raw distributions stay full: rules index them)."""
    return VerifyContext(
        generator=ctx.generator,
        positions=None if ctx.positions is None else ctx.positions[idx],
        raw_draft_probs=None if ctx.raw_draft_probs is None else ctx.raw_draft_probs[idx],
        raw_target_probs=None if ctx.raw_target_probs is None else ctx.raw_target_probs[idx],
        extra={**ctx.extra, "rows": idx},
    )
