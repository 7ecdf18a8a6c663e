"""Lossless multi-draft verification of one step: ``n`` candidate tokens, one emitted token.

At one position the drafter proposes ``n`` candidate tokens drawn from its distribution ``q``
(``draft_probs``) by a *sampling scheme*, and a *verifier* emits one token whose law is exactly
the target's ``p`` (``target_probs``). The step is **accepted** when the emitted token is one of
the drafts; for the verifiers here that is the same event as "a draft passed its test" (see
each verifier's proof), and it is what lets a tree drafter keep the subtree under that draft.

Valid combinations (anything else raises :class:`~quickdraft.errors.QuickdraftError`):

=====================  =====================================  ===============================
verifier               sampling                               acceptance rate
=====================  =====================================  ===============================
``rrs``                ``with_replacement``                   SpecInfer multi-step sampling
``rrs``                ``without_replacement``                RRS, ``q_i`` = q minus earlier drafts
``rrs``                ``greedy``                             top tokens tested as point masses
``kseq``               ``with_replacement``                   ``1 − (1 − β(ρ))^n`` (SpecTr)
``optimal_greedy``     ``greedy``                             ``p(T) + Σ_{x∉T} min(p(x), q_R(x))``
=====================  =====================================  ===============================

K-SEQ is defined (and its ``ρ`` equation derived) only for i.i.d. drafts; the optimal greedy
verifier only for the greedy draft law. The mathematics and the proofs live in
:mod:`quickdraft.verification.multidraft_verifiers`, the draft schemes in :mod:`quickdraft.verification.multidraft_proposals`.

Example
-------
>>> import torch
>>> from quickdraft.verification.multidraft import sample_step
>>> p = torch.tensor([[0.5, 0.3, 0.2]])
>>> q = torch.tensor([[0.2, 0.3, 0.5]])
>>> out = sample_step(p, q, 2, "greedy", "optimal_greedy", generator=torch.Generator().manual_seed(0))
>>> out.drafts[0, 0].item()     # the draft's top token is always a draft
2
>>> tuple(out.tokens.shape), out.tokens.dtype, out.accepted.dtype
((1,), torch.int64, torch.bool)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.verification.multidraft_proposals import SAMPLERS, Drafts
from quickdraft.verification.multidraft_verifiers import kseq_verify, optimal_greedy_verify, rrs_verify
from quickdraft.verification.sampling import ROW_SUM_TOLERANCE, check_distributions

SamplingName = Literal["with_replacement", "without_replacement", "greedy"]
VerifierName = Literal["rrs", "kseq", "optimal_greedy"]



def _rrs(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: Drafts, generator) -> torch.Tensor:
    return rrs_verify(target_probs, drafts, generator)


def _kseq(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: Drafts, generator) -> torch.Tensor:
    return kseq_verify(target_probs, draft_probs, drafts, generator)


def _optimal_greedy(target_probs: torch.Tensor, draft_probs: torch.Tensor, drafts: Drafts, generator) -> torch.Tensor:
    return optimal_greedy_verify(target_probs, drafts, generator)


#: verifier name -> (function, sampling schemes it is lossless for)
VERIFIERS: dict[str, tuple[Callable[..., torch.Tensor], frozenset[str]]] = {
    "rrs": (_rrs, frozenset({"with_replacement", "without_replacement", "greedy"})),
    "kseq": (_kseq, frozenset({"with_replacement"})),
    "optimal_greedy": (_optimal_greedy, frozenset({"greedy"})),
}


@dataclass
class StepResult:
    """Outcome of one multi-draft step.

    Attributes
    ----------
    tokens:
        ``[B]`` int64 emitted token per row, distributed exactly as ``target_probs``.
    accepted:
        ``[B]`` bool: the emitted token is one of the row's drafts.
    drafts:
        ``[B, n]`` int64 draft tokens in drawing order (greedy: the top ``n − 1`` by decreasing
        draft probability, then the sampled one).
    """

    tokens: torch.Tensor
    accepted: torch.Tensor
    drafts: torch.Tensor


def _as_distribution(probs: object, who: str) -> torch.Tensor:
    """``probs [B, V]`` checked by :func:`quickdraft.verification.sampling.check_distributions`, renormalised in float64."""
    check_distributions(probs, who)
    if probs.dim() != 2:
        raise QuickdraftError(f"{who} must be [B, V], got shape {tuple(probs.shape)}")
    if probs.shape[0] == 0 or probs.shape[1] == 0:
        raise QuickdraftError(f"{who} must have at least one row and one token, got shape {tuple(probs.shape)}")
    probs = probs.to(torch.float64)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample_step(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    num_drafts: int,
    sampling: SamplingName,
    verifier: VerifierName,
    generator: torch.Generator | None = None,
) -> StepResult:
    """Draw ``num_drafts`` drafts from ``draft_probs`` and emit one token distributed as ``target_probs``.

    Parameters
    ----------
    target_probs:
        ``[B, V]`` float target distribution ``p`` (rows sum to 1 within
        :data:`ROW_SUM_TOLERANCE`; renormalised in float64).
    draft_probs:
        ``[B, V]`` float draft distribution ``q``, same shape and device.
    num_drafts:
        ``n ≥ 1`` drafts per row. ``without_replacement`` and ``greedy`` need
        ``n ≤ |supp q|`` in every row; ``with_replacement`` allows any ``n`` (drafts may repeat).
    sampling:
        ``"with_replacement"``, ``"without_replacement"`` or ``"greedy"``
        (see :mod:`quickdraft.verification.multidraft_proposals`).
    verifier:
        ``"rrs"``, ``"kseq"`` or ``"optimal_greedy"`` (see the table in the module docstring).
    generator:
        Random source for drafting and verification (``None``: torch's default generator).

    Returns
    -------
    StepResult
        Emitted tokens ``[B]``, accepted flags ``[B]`` and drafts ``[B, n]``.

    Raises
    ------
    QuickdraftError
        On bad shapes or non-distributions, ``n < 1``, ``n`` above the draft support for
        schemes without replacement, unknown names, or a combination that is not lossless.
    """
    # 1. validate the names and the combination
    if sampling not in SAMPLERS:
        raise QuickdraftError(f"unknown sampling {sampling!r}; choose one of {sorted(SAMPLERS)}")
    if verifier not in VERIFIERS:
        raise QuickdraftError(f"unknown verifier {verifier!r}; choose one of {sorted(VERIFIERS)}")
    verify, schemes = VERIFIERS[verifier]
    if sampling not in schemes:
        raise QuickdraftError(
            f"verifier {verifier!r} is not defined for {sampling!r} drafts; it works with {sorted(schemes)}"
        )
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, numbers.Integral) or num_drafts < 1:
        raise QuickdraftError(f"num_drafts must be an integer >= 1, got {num_drafts!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise QuickdraftError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")

    # 2. validate the distributions
    p = _as_distribution(target_probs, "target_probs")  # [B, V] float64
    q = _as_distribution(draft_probs, "draft_probs")  # [B, V] float64
    if p.shape != q.shape:
        raise QuickdraftError(
            f"target_probs and draft_probs must have the same shape, got {tuple(p.shape)} and {tuple(q.shape)}"
        )
    if p.device != q.device:
        raise QuickdraftError(f"target_probs and draft_probs are on different devices ({p.device}, {q.device})")
    if sampling != "with_replacement":
        support = int((q > 0).sum(dim=-1).min().item())
        if num_drafts > support:
            raise QuickdraftError(
                f"num_drafts={num_drafts} exceeds the draft support ({support} tokens with q > 0 in some row); "
                f"{sampling!r} drafting needs that many distinct tokens"
            )

    # 3. draft, 4. verify
    num_drafts = int(num_drafts)
    drafts = SAMPLERS[sampling](q, num_drafts, generator)
    tokens = verify(p, q, drafts, generator)
    accepted = (drafts.ids == tokens.unsqueeze(-1)).any(dim=-1)
    return StepResult(tokens=tokens, accepted=accepted, drafts=drafts.ids)
