"""Lossless verifiers for one multi-draft step: RRS, K-SEQ and the optimal verifier for greedy drafts.

Every verifier maps the target distribution ``p`` (``target_probs [B, V]``), the drafts and a
random source to one emitted token per row whose law is exactly ``p``. All maths is float64.
Notation (local aliases only): ``p`` target, ``q`` draft, ``q_i`` the law of draft ``x_i`` given
the earlier drafts (see :mod:`quickdraft.verification.multidraft_proposals`), ``(a)^+ = max(0, a)``,
``norm(f) = f / Σ f``.

References
----------
.. [1] Miao et al. 2024, "SpecInfer: Accelerating LLM Serving with Tree-based Speculative
   Inference and Verification" (multi-step speculative sampling = RRS with replacement).
.. [2] Yang et al. 2024, "Multi-Candidate Speculative Decoding"; Jeon et al. 2024, "Recursive
   Speculative Decoding" (RRS without replacement).
.. [3] Sun et al. 2023, "SpecTr: Fast Speculative Decoding via Optimal Transport" (K-SEQ).
.. [4] Hu et al. 2025, "Towards Optimal Multi-draft Speculative Decoding" (greedy drafts,
   optimal acceptance rate).
"""

from __future__ import annotations

import torch

from quickdraft.verification.multidraft_proposals import Drafts
from quickdraft.verification.sampling import sample_rows
from quickdraft.verification.rules import residual


def _gather(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``probs[b, ids[b]]`` for ``probs [B, V]``, ``ids [B]``."""
    return probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _uniform(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``[B]`` float64 uniforms on [0, 1) for ``like [B, V]``."""
    return torch.rand(like.shape[0], dtype=torch.float64, device=like.device, generator=generator)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs [B, V]`` (non-negative, positive row sums, not necessarily normalised)."""
    return sample_rows(probs, generator)


# --------------------------------------------------------------------------------------------
# Recursive rejection sampling
# --------------------------------------------------------------------------------------------


def rrs_verify(target_probs: torch.Tensor, drafts: Drafts, generator: torch.Generator | None) -> torch.Tensor:
    """Recursive rejection sampling (RRS) over the drafts in drawing order (refs. 1, 2 of the module).

    With ``p_1 = p``, at step ``i = 1 … n`` accept ``x_i`` with probability
    ``min(1, p_i(x_i) / q_i(x_i))``; on rejection set ``p_{i+1} = norm((p_i − q_i)^+)``. If all
    ``n`` drafts are rejected emit a sample of ``p_{n+1}``.

    * with replacement ``q_i = q`` (SpecInfer's multi-step speculative sampling);
    * without replacement ``q_i`` = ``q`` with ``x_1 … x_{i−1}`` removed, renormalised;
    * greedy drafts: a top token is a draw from the point mass ``δ_{x_i}``, so the test accepts it
      with probability ``p_i(x_i)`` and a rejection sets ``p_{i+1} = p_i`` with ``x_i`` removed;
      the last draft is tested against ``q_n = q_R``. (Testing a deterministic top token against
      ``q`` as if it had been sampled would be lossy; the test suite shows it.)

    Proof of losslessness (by backward induction on ``i``). Claim: given the history
    ``H = (x_1 … x_{i−1}`` all rejected``)``, the emitted token has law ``p_i`` (a function of
    ``H``). At ``i = n + 1`` it is sampled from ``p_{n+1}``. At step ``i``, ``x_i ~ q_i`` given
    ``H``, so ``Pr[x_i = x, accepted | H] = min(q_i(x), p_i(x))`` and the rejection probability
    is ``1 − Σ min(q_i, p_i) = Σ (p_i − q_i)^+``; after a rejection the output has law
    ``p_{i+1} = norm((p_i − q_i)^+)`` by induction, whichever ``x_i`` was rejected. Summing,
    ``min(q_i, p_i) + (p_i − q_i)^+ = p_i``. At ``i = 1`` the output is ``p``. ∎

    A rejected draft ``x_i`` has ``p_i(x_i) < q_i(x_i)``, so ``p_{i+1}(x_i) = 0`` and it stays 0;
    hence the emitted token is a draft exactly when some draft passed its test. If
    ``(p_i − q_i)^+ ≡ 0`` then ``p_i = q_i`` and rejection has probability 0; the residual then
    falls back to ``p_i`` (see :func:`quickdraft.verification.rules.residual`) only to stay well defined.

    Parameters
    ----------
    target_probs:
        ``[B, V]`` float64 target distribution ``p``.
    drafts:
        Draft ids ``[B, n]`` and their conditional proposals ``n × [B, V]``.
    generator:
        Random source (``None``: torch's default generator).

    Returns
    -------
    torch.Tensor
        ``[B]`` int64 emitted tokens.
    """
    p_cur = target_probs  # p_i, [B, V]
    tokens = torch.full((target_probs.shape[0],), -1, dtype=torch.long, device=target_probs.device)
    done = torch.zeros(target_probs.shape[0], dtype=torch.bool, device=target_probs.device)
    for i, q_i in enumerate(drafts.proposals):
        x = drafts.ids[:, i]  # [B]
        u = _uniform(target_probs, generator)
        # u < p_i(x)/q_i(x) written without division; q_i(x) > 0 because x was drawn from q_i
        passed = ~done & (u * _gather(q_i, x) < _gather(p_cur, x))
        tokens = torch.where(passed, x, tokens)
        done = done | passed
        p_cur = torch.where(done.unsqueeze(-1), p_cur, residual(p_cur, q_i))
    return torch.where(done, tokens, _sample(p_cur, generator))


# --------------------------------------------------------------------------------------------
# K-SEQ (SpecTr)
# --------------------------------------------------------------------------------------------


def kseq_beta(target_probs: torch.Tensor, draft_probs: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """``β(ρ) = Σ_x min(q(x), p(x)/ρ)`` per row: the probability that one i.i.d. draft passes.

    ``target_probs``, ``draft_probs``: ``[B, V]``; ``rho``: ``[B]``. Returns ``[B]``.
    """
    return torch.minimum(draft_probs, target_probs / rho.unsqueeze(-1)).sum(dim=-1)


def _geometric_sum(beta: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """``f = Σ_{i<n} (1 − β)^i = (1 − (1 − β)^n) / β``, stable at ``β = 0`` (where it is ``n``)."""
    f = torch.zeros_like(beta)
    term = torch.ones_like(beta)
    for _ in range(num_drafts):
        f = f + term
        term = term * (1 - beta)
    return f


def kseq_rho(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, num_drafts: int, iters: int = 60
) -> torch.Tensor:
    """The K-SEQ division factor ``ρ ∈ [1, n]`` per row, by vectorised bisection.

    ``ρ`` is the smallest root of

    .. math::

        h(\\rho) = \\rho\\,\\beta(\\rho) - \\bigl(1 - (1 - \\beta(\\rho))^n\\bigr) = 0,
        \\qquad \\beta(\\rho) = \\sum_x \\min\\bigl(q(x), p(x)/\\rho\\bigr)

    (SpecTr, ref. 3 of the module, K-SEQ). ``ρβ(ρ) = Σ min(ρq, p)`` is non-decreasing and ``β`` non-increasing in
    ``ρ``, so ``h`` is non-decreasing; ``h(1) = β − 1 + (1 − β)^n ≤ 0`` and
    ``h(n) = nβ − 1 + (1 − β)^n ≥ 0`` (Bernoulli). If ``h(1) ≥ 0`` (``n = 1``, ``p = q`` or
    disjoint supports) ``ρ = 1``. Otherwise the returned value is the upper end of the final
    bracket, so ``h(ρ) ≥ 0`` holds, which is all losslessness needs (see :func:`kseq_residual`);
    it lies within ``(n − 1)·2^−iters`` of the root.

    Each bisection step costs ``O(B log V)``, not ``O(BV)``: with the ratios ``t = p/q`` sorted
    once per row, ``β(ρ) = Σ_{t ≥ ρ} q + (1/ρ) Σ_{t < ρ} p`` is a suffix sum of ``q`` plus a
    prefix sum of ``p`` at ``k = #{t < ρ}`` (one ``searchsorted`` per row).

    ``target_probs``, ``draft_probs``: ``[B, V]`` float64. Returns ``[B]`` float64.
    """
    b = target_probs.shape[0]
    ratio = torch.where(
        draft_probs > 0, target_probs / draft_probs, torch.full_like(target_probs, float("inf"))
    )  # t [B, V]
    ratio_sorted, order = torch.sort(ratio, dim=-1)
    zero = torch.zeros(b, 1, dtype=torch.float64, device=target_probs.device)
    p_prefix = torch.cat([zero, target_probs.gather(-1, order).cumsum(dim=-1)], dim=-1)  # [B, V+1]
    q_sorted = draft_probs.gather(-1, order)
    q_suffix = torch.cat([q_sorted.flip(-1).cumsum(dim=-1).flip(-1), zero], dim=-1)  # [B, V+1]

    def h(rho: torch.Tensor) -> torch.Tensor:  # rho [B] -> [B]
        k = torch.searchsorted(ratio_sorted, rho.unsqueeze(-1), right=False)  # #{t < rho}, [B, 1]
        beta = (q_suffix.gather(-1, k) + p_prefix.gather(-1, k) / rho.unsqueeze(-1)).squeeze(-1).clamp(0, 1)
        return rho * beta - 1 + (1 - beta) ** num_drafts

    lo = torch.ones(b, dtype=torch.float64, device=target_probs.device)
    hi = torch.full_like(lo, float(num_drafts))
    at_one = h(lo) >= 0
    if num_drafts > 1 and not bool(at_one.all()):
        for _ in range(iters):
            mid = (lo + hi) / 2
            ok = h(mid) >= 0
            hi = torch.where(ok, mid, hi)
            lo = torch.where(ok, lo, mid)
    return torch.where(at_one, torch.ones_like(hi), hi)


def kseq_residual(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, num_drafts: int, rho: torch.Tensor
) -> torch.Tensor:
    """The distribution K-SEQ emits when all ``n`` drafts are rejected (unnormalised, ``[B, V]``).

    One i.i.d. draft is ``x`` and passes with probability ``min(q(x), p(x)/ρ)``; the first
    passing draft is emitted. So ``Pr[emit x, some draft passed] = f·min(q(x), p(x)/ρ)`` with
    ``f = Σ_{i<n}(1−β)^i`` and ``Pr[all rejected] = (1 − β)^n = 1 − fβ``. The residual must be

    .. math::

        r(x) = \\frac{p(x) - f \\min(q(x), p(x)/\\rho)}{(1-\\beta)^n},

    whose numerator sums to ``1 − fβ = (1 − β)^n`` for *any* ``ρ``; it is non-negative iff
    ``f ≤ ρ``, i.e. ``h(ρ) ≥ 0``. At the root ``f = ρ`` and ``r = norm((p − ρq)^+)``, SpecTr's
    form; computing ``f`` from ``β(ρ)`` keeps the output exact for the bisection's ``ρ`` too.
    Where ``(1 − β)^n = 0`` no row ever reaches the residual; it falls back to ``p``.

    ``target_probs``, ``draft_probs``: ``[B, V]``; ``rho``: ``[B]``. Returns ``[B, V]`` float64
    with positive row sums.
    """
    beta = kseq_beta(target_probs, draft_probs, rho)
    f = _geometric_sum(beta, num_drafts).unsqueeze(-1)  # [B, 1]
    res = (target_probs - f * torch.minimum(draft_probs, target_probs / rho.unsqueeze(-1))).clamp_min(0)
    mass = res.sum(dim=-1, keepdim=True)
    return torch.where(mass > 1e-12, res, target_probs)


def kseq_verify(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    drafts: Drafts,
    generator: torch.Generator | None,
    rho: torch.Tensor | None = None,
) -> torch.Tensor:
    """SpecTr's K-SEQ (ref. 3 of the module) for i.i.d. drafts: accept ``x_i`` w.p. ``min(1, p(x_i)/(ρ q(x_i)))``.

    The drafts are tested in order against the *same* ``p`` (no residual update between them);
    the first that passes is emitted; if none passes, a sample of :func:`kseq_residual` is.
    Lossless by the identity in :func:`kseq_residual`:
    ``f·min(q, p/ρ) + (1 − β)^n · r = p``. Acceptance rate ``1 − (1 − β(ρ))^n``. A draft that
    fails has ``p(x) < ρq(x)``, where the residual is 0 at the root, so (up to the bisection
    tolerance) the emitted token is a draft exactly when a draft passed.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[B, V]`` float64 ``p`` and ``q``.
    drafts:
        i.i.d. drafts ``[B, n]`` from ``q``.
    generator:
        Random source.
    rho:
        ``[B]`` division factor; ``None`` solves it with :func:`kseq_rho`.

    Returns
    -------
    torch.Tensor
        ``[B]`` int64 emitted tokens.
    """
    num_drafts = drafts.ids.shape[1]
    if rho is None:
        rho = kseq_rho(target_probs, draft_probs, num_drafts)
    tokens = torch.full((target_probs.shape[0],), -1, dtype=torch.long, device=target_probs.device)
    done = torch.zeros(target_probs.shape[0], dtype=torch.bool, device=target_probs.device)
    for i in range(num_drafts):
        x = drafts.ids[:, i]
        u = _uniform(target_probs, generator)
        passed = ~done & (u * rho * _gather(draft_probs, x) < _gather(target_probs, x))
        tokens = torch.where(passed, x, tokens)
        done = done | passed
    fallback = _sample(kseq_residual(target_probs, draft_probs, num_drafts, rho), generator)
    return torch.where(done, tokens, fallback)


# --------------------------------------------------------------------------------------------
# Optimal verifier for greedy drafts (Hu et al. 2025)
# --------------------------------------------------------------------------------------------


def optimal_greedy_verify(
    target_probs: torch.Tensor, drafts: Drafts, generator: torch.Generator | None
) -> torch.Tensor:
    """The verifier that attains the optimal acceptance rate for greedy drafts (Hu et al. 2025, ref. 4).

    Drafts: the fixed set ``T`` of the ``n − 1`` top draft tokens and one ``y ~ q_R``,
    ``R = V \\ T``, ``q_R = q·1_R / q(R)``. The verifier is single-draft speculative sampling of
    ``p`` against ``y`` and its law ``q_R``: accept ``y`` w.p. ``min(1, p(y)/q_R(y))``, else emit
    a sample of ``r = norm((p − q_R)^+)``. Because ``q_R = 0`` on ``T``, ``r ∝ p`` on ``T`` and
    ``∝ (p − q_R)^+`` on ``R``.

    *Lossless*: ``Pr[emit x] = min(p, q_R)(x) + (p − q_R)^+(x) = p(x)`` (the standard identity).

    *Acceptance* (emitted token ∈ ``T ∪ {y}``). The residual puts all of ``p``'s mass on ``T``
    onto ``T`` (``y ∉ T``, so nothing on ``T`` is emitted by acceptance), i.e.
    ``Pr[emit ∈ T] = p(T)``. The residual never emits the rejected ``y``: rejection of ``y``
    needs ``p(y) < q_R(y)``, where ``r(y) = 0``. Hence

    .. math::

        \\alpha = p(T) + \\sum_{x \\in R} \\min\\bigl(p(x), q_R(x)\\bigr).

    *Optimality*: for any coupling of the target token ``X ~ p`` with ``y ~ q_R``,
    ``Pr[X ∈ T ∪ {y}] ≤ Pr[X ∈ T] + Σ_{x∈R} Pr[X = x, y = x]
    ≤ p(T) + Σ_{x∈R} min(p(x), q_R(x)) = α``, so no lossless verifier does better. This is Hu et
    al.'s ``α* = 1 − max_{A⊆V} (p(A) − Pr[drafts ∩ A ≠ ∅])`` for this draft law: any ``A`` meeting
    ``T`` gives ``≤ 0``, and ``A ⊆ R`` gives ``p(A) − q_R(A)``, maximised by ``A = {p > q_R} ∩ R``.

    Parameters
    ----------
    target_probs:
        ``[B, V]`` float64 ``p``.
    drafts:
        Greedy drafts (ids ``[B, n]``, last proposal ``q_R``).
    generator:
        Random source.

    Returns
    -------
    torch.Tensor
        ``[B]`` int64 emitted tokens.
    """
    y = drafts.ids[:, -1]  # [B]
    q_rest = drafts.proposals[-1]  # q_R [B, V]
    u = _uniform(target_probs, generator)
    passed = u * _gather(q_rest, y) < _gather(target_probs, y)
    return torch.where(passed, y, _sample(residual(target_probs, q_rest), generator))
