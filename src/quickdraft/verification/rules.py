"""Acceptance rules for chain verification, behind one interface.

A rule answers four questions for :func:`quickdraft.verification.verify.verify_chain`:

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

The rules
---------
==================  ==========  ============================================================
class               lossless    acceptance
==================  ==========  ============================================================
:class:`Lossless`   yes         u < min(1, p(x)/q(x)); residual on rejection
:class:`Greedy`     yes (T=0)   x = argmax p
:class:`Fuzzy`      T = 0 only  D(p, q) <= T (FSD); ``hybrid``: or the lossless test
:class:`Typical`    no          p(x) > min(ε, δ·exp(−H(p))) (Medusa typical acceptance)
:class:`ExponentialRace`  yes   x = argmin_v E_v / p(v) with shared arrival times E (ERSD)
:class:`Latent`     δ = 0, k = 1  u < min(1, p̃(x)/q(x)), p̃ pooling x's latent neighbours (LANTERN)
:class:`Contrastive`  to CD     the lossless / greedy test against contrastive decoding's p_cd
==================  ==========  ============================================================
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from quickdraft.verification.divergences import DEFAULT_TOP_K, DEFAULT_TOP_P, DIVERGENCES, canonical_name, entropy, get_divergence
from quickdraft.errors import QuickdraftError
from quickdraft.verification.race import race_candidates, race_keys, race_sample
from quickdraft.verification.sampling import argmax, sample


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
        Temperature-1, unwarped distributions with the shapes of ``draft_probs`` / ``target_probs``
        (``[B, K, V]`` / ``[B, K+1, V]``); divergence-based rules use them when present.
    extra:
        Free-form extras. Keys read by the rules: ``"row_ids"`` (``[B]`` int64 stable id of each
        sequence, for :class:`ExponentialRace`; default: the batch index), ``"row_seeds"`` (``[B]``
        int64 race seed of each sequence, :func:`race_seeds`; default: the rule's seed) and ``"rows"`` (set by
        ``verify_chain`` when it hands a rule a subset of the batch: the subset's batch indices).
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
    #: True when, at temperature 0, the rule's decisions read nothing but the draft ids and the argmax
    #: of each target distribution, so the engine may verify on token ids and skip the one-hot
    #: distributions (:func:`quickdraft.verification.verify.verify_greedy_ids`)
    argmax_only: bool = False
    #: True when the rule reads ``ctx.raw_draft_probs`` / ``ctx.raw_target_probs`` (the engine only
    #: computes them when asked)
    needs_raw: bool = False
    #: True when the rule needs the draft's probability of every token of the vocabulary: a draft whose
    #: head was cut to part of it (the openvino backend's ``--draft-vocab``) gives 0 elsewhere, which
    #: would make the rule wrong (e.g. an infinite divergence), so it needs the draft's full head
    needs_full_draft: bool = False

    def propose(self, draft_probs: torch.Tensor, ctx: VerifyContext, offset: int = 0) -> torch.Tensor:
        """Draft one token per row from ``draft_probs [B, V]`` at draft position ``offset``."""
        if self.greedy_drafts:
            return argmax(draft_probs)
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
            return argmax(target_probs)
        return sample(target_probs, ctx.generator)


def _gather_token_probs(probs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return probs.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------------------------
# lossless speculative sampling
# ---------------------------------------------------------------------------------------------


def acceptance_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Elementwise acceptance probability a = min(1, p/q) of speculative sampling.

    Works on gathered token probabilities (``[B, K]``) and on whole distributions (``[..., V]``).
    Where q = 0 (a token the draft cannot have sampled) it is 1 if p > 0 else 0.
    """
    ratio = target_probs / torch.where(draft_probs > 0, draft_probs, torch.ones_like(draft_probs))
    return torch.where(draft_probs > 0, ratio.clamp_max(1.0), (target_probs > 0).to(target_probs.dtype))


def residual(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) row-wise; rows where p ≤ q everywhere (p = q) fall back to p."""
    res = (target_probs - draft_probs).clamp_min(0)
    mass = res.sum(dim=-1, keepdim=True)
    return torch.where(mass > 1e-12, res / mass.clamp_min(1e-30), target_probs)


@dataclass(frozen=True)
class Lossless(Rule):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft token x with probability a(x) = min(1, p(x)/q(x)) (:func:`acceptance_probability`);
    at the first rejection emit a token from the residual r = norm(max(0, p − q)) (:func:`residual`).
    Then for every x, q(x)·a(x) + (1 − Σ_y q(y)·a(y))·r(x) = p(x): the output is distributed
    exactly as p.
    """

    name = "lossless"
    lossless = True
    greedy_drafts = False

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        p = _gather_token_probs(target_probs, draft_ids)
        q = _gather_token_probs(draft_probs, draft_ids)
        u = torch.rand(p.shape, generator=ctx.generator, device=p.device)
        return u < acceptance_probability(p, q), None

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        return sample(residual(target_probs, draft_probs), ctx.generator)


@dataclass(frozen=True)
class Greedy(Rule):
    """Exact match: accept a draft token iff it is the target's argmax; emit the argmax otherwise.

    With greedy drafts this reproduces plain greedy decoding of the target token for token.
    """

    name = "greedy"
    lossless = True
    greedy_drafts = True
    argmax_only = True

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return draft_ids == argmax(target_probs), None

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        return argmax(target_probs)


# ---------------------------------------------------------------------------------------------
# Fuzzy Speculative Decoding
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fuzzy(Rule):
    """Fuzzy Speculative Decoding (FSD; Holsman, Huang & Dhingra 2025, arXiv:2502.20704).

    For each draft position i, D_i = Div(target_i, draft_i) between the target's and the draft's
    next-token distributions for the same prefix (:mod:`quickdraft.verification.divergences`). The longest
    prefix of positions with D_i ≤ T is accepted — a deterministic decision, independent of the
    drafted token, no uniform draw. At the first rejected position a token is *sampled from the
    target's* (processed) distribution, not from the residual; after a fully accepted draft the
    bonus token is sampled from the target as usual.

    ``T = 0`` disables the fuzzy criterion (nothing is accepted by it, even where D = 0, so the
    limit is plain target sampling, lossless but with no accepted draft); ``T = inf`` accepts
    every draft. FSD's reference code tests
    ``D <= T``, which at T = 0 would still accept positions whose distributions are identical.

    ``hybrid=True``: positions with D_i ≤ T are accepted outright, the others go through the
    lossless test u < min(1, p(x)/q(x)); at the first rejection (D_i > T *and* the lossless test
    failed) the token comes from the residual norm(max(0, p − q)). With T = 0 this is, step for
    step and draw for draw, :class:`Lossless`. The lossless part needs drafts sampled from q, so
    hybrid FSD always drafts by sampling (``greedy_drafts=True`` with ``hybrid=True`` is an error).

    The lossy mask returned by :meth:`accept` (counted by ``verify_chain`` as ``num_lossy``) marks
    the *fuzzy acceptances*: every acceptance in plain FSD; in hybrid FSD the positions accepted
    by D_i ≤ T that the lossless test (same uniform draw) would have rejected.

    Attributes
    ----------
    divergence:
        Name in :data:`quickdraft.verification.divergences.DIVERGENCES` (``js``, ``jsd``, ``kl``, ``tv``, …);
        the default ``js`` is FSD's "JS" (KL from the mixture, unbounded), the quantity FSD's
        thresholds refer to; ``jsd`` is the textbook Jensen–Shannon divergence (≤ ln 2).
        A deprecated name (``js_fsd``) warns and is stored as its replacement.
    threshold:
        T ≥ 0 (``math.inf`` allowed), in the divergence's units (nats for KL/JS); thresholds of
        different divergences are not comparable (``js`` and ``jsd`` included).
    top_k:
        k of the ``topk_*`` divergences (FSD's code uses 50); ignored by the others.
    top_p:
        Nucleus mass of the ``topp_*`` divergences, in (0, 1]; ignored by the others.
    use_raw:
        Compute D on the raw temperature-1, unwarped distributions (``ctx.raw_*_probs``), as FSD
        does; falls back to the processed ones when the context has no raw distributions.
        ``False``: always the processed (temperature / top-k / top-p) distributions.
    hybrid:
        See above.
    greedy_drafts:
        Draft the drafter's argmax (as in FSD's experiments) instead of sampling. ``None``
        (default): greedy for plain FSD, sampled for hybrid FSD.
    """

    divergence: str = "js"
    threshold: float = 0.4
    top_k: int = DEFAULT_TOP_K
    top_p: float = DEFAULT_TOP_P
    use_raw: bool = True
    hybrid: bool = False
    greedy_drafts: bool | None = None  # type: ignore[assignment]

    name = "fsd"

    def __post_init__(self) -> None:
        object.__setattr__(self, "divergence", canonical_name(self.divergence))
        if self.divergence not in DIVERGENCES:
            raise QuickdraftError(f"unknown divergence {self.divergence!r}; choose one of {', '.join(DIVERGENCES)}")
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or math.isnan(t) or t < 0:
            raise QuickdraftError(f"FSD threshold must be a number >= 0 (inf allowed), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise QuickdraftError(f"FSD top_k must be an integer >= 1, got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise QuickdraftError(f"FSD top_p must be a number in (0, 1], got {p!r}")
        if self.hybrid and self.greedy_drafts:
            raise QuickdraftError(
                "hybrid FSD needs sampled drafts (its lossless test assumes x ~ q); drop greedy_drafts=True"
            )
        if self.greedy_drafts is None:
            object.__setattr__(self, "greedy_drafts", not self.hybrid)

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """True at ``T = 0``, for every divergence: the fuzzy criterion then accepts nothing (no
        divergence is computed), so plain FSD emits one sample of the target per step and hybrid
        FSD is :class:`Lossless` draw for draw."""
        return self.threshold == 0

    @property
    def needs_raw(self) -> bool:  # type: ignore[override]
        return self.use_raw and self.threshold > 0

    @property
    def needs_full_draft(self) -> bool:  # type: ignore[override]
        """FSD's ``js`` and ``kl_reverse`` (plain, ``topk_``, ``topp_``) are infinite wherever the
        target has mass and the draft none, so a draft head cut to part of the vocabulary would make
        every token fail the threshold; ``jsd``, ``kl`` and ``tv`` stay finite (measured against the
        cut draft's distribution, the one that drafts)."""
        return self.threshold > 0 and self.divergence.rsplit("_", 1)[-1] in ("js", "reverse")

    def divergences(self, draft_probs: torch.Tensor, target_probs: torch.Tensor, ctx: VerifyContext) -> torch.Tensor:
        """D_i for every draft position, ``[B, K]``, on the raw or processed distributions.

        ``draft_probs [B, K, V]``, ``target_probs [B, K, V]`` (the target's first K positions).
        """
        k = draft_probs.shape[1]
        if self.use_raw and ctx.raw_draft_probs is not None and ctx.raw_target_probs is not None:
            draft_probs = ctx.raw_draft_probs[:, :k]
            target_probs = ctx.raw_target_probs[:, :k]
        return get_divergence(self.divergence, self.top_k, self.top_p)(target_probs, draft_probs)

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        if self.threshold > 0:
            fuzzy = self.divergences(draft_probs, target_probs, ctx) <= self.threshold
        else:
            fuzzy = torch.zeros(draft_ids.shape, dtype=torch.bool, device=draft_ids.device)
        if not self.hybrid:
            return fuzzy, fuzzy
        # the lossless test draws its uniforms exactly as Lossless does (same generator stream)
        exact, _ = Lossless().accept(draft_ids, draft_probs, target_probs, ctx)
        return fuzzy | exact, fuzzy & ~exact

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        if self.hybrid:
            return sample(residual(target_probs, draft_probs), ctx.generator)
        return sample(target_probs, ctx.generator)

    def bonus(self, target_probs, ctx, offsets):
        return sample(target_probs, ctx.generator)


# ---------------------------------------------------------------------------------------------
# typical acceptance
# ---------------------------------------------------------------------------------------------


def typical_threshold(target_probs: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """min(ε, δ·exp(−H(p))) over the last dim of ``target_probs [..., V]``; returns ``[...]``.

    H is the exact entropy (0 log 0 = 0); Medusa and vLLM add 1e-5 inside the logarithm.
    """
    return torch.clamp(delta * torch.exp(-entropy(target_probs)), max=epsilon)


@dataclass(frozen=True)
class Typical(Rule):
    """Typical acceptance (Medusa, Cai et al. 2024, arXiv:2401.10774, §3.3.1; vLLM's former
    ``TypicalAcceptanceSampler``).

    Accept draft token x iff p(x) > min(ε, δ·exp(−H(p))), p the target's processed distribution
    (:func:`typical_threshold`). Confident targets (low entropy) demand p(x) close to ε; uncertain
    ones accept less likely tokens. At the first rejection emit the target's argmax
    (``recover="argmax"``, as Medusa and vLLM) or a sample of p (``recover="sample"``). The bonus
    token is a sample of p (the argmax at temperature 0). Lossy; every acceptance is counted as a
    lossy one.

    Attributes
    ----------
    epsilon:
        ε ∈ (0, 1], the posterior threshold (Medusa's ``posterior_threshold``, default 0.09).
    delta:
        δ > 0, the posterior alpha (Medusa's ``posterior_alpha``, default 0.3 = √0.09).
    recover:
        ``"argmax"`` or ``"sample"``.
    greedy_drafts:
        Draft the drafter's argmax (Medusa's top candidates) instead of sampling (vLLM's proposers).
    """

    epsilon: float = 0.09
    delta: float = 0.3
    recover: Literal["argmax", "sample"] = "argmax"
    greedy_drafts: bool = False

    name = "typical"
    lossless = False

    def __post_init__(self) -> None:
        e, d = self.epsilon, self.delta
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise QuickdraftError(f"typical acceptance epsilon must be in (0, 1], got {e!r}")
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not (d > 0 and math.isfinite(d)):
            raise QuickdraftError(f"typical acceptance delta must be a finite number > 0, got {d!r}")
        if self.recover not in ("argmax", "sample"):
            raise QuickdraftError(f"recover must be 'argmax' or 'sample', got {self.recover!r}")

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        ok = _gather_token_probs(target_probs, draft_ids) > typical_threshold(target_probs, self.epsilon, self.delta)
        return ok, ok

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        if self.recover == "argmax":
            return argmax(target_probs)
        return sample(target_probs, ctx.generator)

    def bonus(self, target_probs, ctx, offsets):
        return sample(target_probs, ctx.generator)


# ---------------------------------------------------------------------------------------------
# exponential-race speculative decoding
# ---------------------------------------------------------------------------------------------


def _per_row(ctx: VerifyContext, name: str, b: int, device: torch.device) -> torch.Tensor | None:
    """``ctx.extra[name]`` as int64 ``[b]`` for the rows a rule was handed (indexed by
    ``ctx.extra["rows"]`` when verify_chain passed a subset and the values are still the full
    batch's), or ``None`` where not given."""
    values = ctx.extra.get(name)
    if values is None:
        return None
    values = torch.as_tensor(values, dtype=torch.long, device=device)
    rows = ctx.extra.get("rows")
    if values.shape[0] != b and rows is not None:
        values = values[rows]
    if values.shape != (b,):
        raise QuickdraftError(f"ctx.extra[{name!r}] must be [B={b}], got shape {tuple(values.shape)}")
    return values


def _row_ids(ctx: VerifyContext, b: int, device: torch.device) -> torch.Tensor:
    """Stable ids ``[b]`` of the rows a rule was handed: ``ctx.extra["row_ids"]`` if given, else the
    batch index (of the full batch where ``ctx.extra["rows"]`` names a subset)."""
    ids = _per_row(ctx, "row_ids", b, device)
    if ids is not None:
        return ids
    rows = ctx.extra.get("rows")
    if rows is not None:
        return torch.as_tensor(rows, dtype=torch.long, device=device)
    return torch.arange(b, device=device)


def race_seeds(ctx: VerifyContext, seed: int, b: int, device: torch.device) -> int | torch.Tensor:
    """The race seed of each row a rule was handed: ``ctx.extra["row_seeds"]`` (int64 ``[B]``, the
    64-bit patterns of :func:`quickdraft.verification.race.seed_words`) where the caller keys rows by
    seeds of their own, else the rule's ``seed`` for every row."""
    seeds = _per_row(ctx, "row_seeds", b, device)
    return seed if seeds is None else seeds


@dataclass(frozen=True)
class ExponentialRace(Rule):
    """Exponential-race speculative decoding, ERSD (Kobus & Gündüz 2025, arXiv:2504.15475).

    The draft and the target race with the same arrival times E_v ~ Exp(1), regenerated from
    (``seed``, row id, absolute position) by :mod:`quickdraft.verification.race`. The draft proposes its winner
    argmin_v E_v/q(v) at each position; a draft token is accepted iff it equals the target's
    winner argmin_v E_v/p(v) at that position; at the first mismatch (and for the bonus) the
    target's winner is emitted. No uniform draw, no residual.

    Every emitted token is the target's race winner at its position given the emitted prefix, so
    the output is lossless and, for a given seed, token for token the same as race sampling the
    target alone — whatever the drafter and K (drafter invariance).

    Needs ``ctx.positions`` (absolute position of the first draft token); row ids come from
    ``ctx.extra["row_ids"]`` (default: the batch index), and a row keyed by a seed of its own takes it
    from ``ctx.extra["row_seeds"]`` (:func:`race_seeds`): a row's draws, and so its text, then depend on
    its (seed, row id) and its prompt only, whatever else shares its batch. Processed distributions are raced, so at
    temperature 0 (one-hot) ERSD is exact-match greedy decoding.

    Attributes
    ----------
    seed:
        Seed of the shared arrival times.
    candidates:
        n ≥ 1 draft candidates per position (the draft's n earliest arrivals,
        :meth:`propose_candidates`). With n > 1 the method ``ersd`` runs on the tree machinery:
        a race tree of depth K with n children per node (the ``race`` scheme of
        :mod:`quickdraft.decoding.tree`, verified by :func:`quickdraft.decoding.tree_decoding.verify_tree` with the
        target's race winners; :func:`quickdraft.verification.race.accept_race_branches` is the same rule for
        n explicit branches). Chain verification drafts and checks candidate 0 only: in a chain,
        accepting another candidate gains nothing, because the target's winner is emitted at the
        first mismatch anyway and the later draft positions were conditioned on candidate 0.
    """

    seed: int = 0
    candidates: int = 1

    name = "ersd"
    lossless = True
    greedy_drafts = False

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise QuickdraftError(f"ERSD seed must be an integer, got {self.seed!r}")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 1:
            raise QuickdraftError(f"ERSD candidates must be an integer >= 1, got {self.candidates!r}")

    def keys(self, ctx: VerifyContext, b: int, offsets: torch.Tensor | int, device: torch.device) -> torch.Tensor:
        """Race keys of the positions ``ctx.positions + offsets`` (``offsets`` ``[b]``, ``[b, K]`` or int)."""
        if ctx.positions is None:
            raise QuickdraftError("ERSD needs the absolute positions of the draft tokens (ctx.positions)")
        positions = ctx.positions.to(device).long()
        offsets = torch.as_tensor(offsets, dtype=torch.long, device=device)
        if offsets.dim() == 2:
            positions = positions.unsqueeze(1)
        row_ids, seeds = _row_ids(ctx, b, device), race_seeds(ctx, self.seed, b, device)
        if offsets.dim() == 2:
            row_ids = row_ids.unsqueeze(1)
            seeds = seeds.unsqueeze(1) if isinstance(seeds, torch.Tensor) else seeds
        return race_keys(seeds, row_ids, positions + offsets)

    def propose(self, draft_probs, ctx, offset=0):
        return race_sample(draft_probs, self.keys(ctx, draft_probs.shape[0], offset, draft_probs.device))

    def propose_candidates(self, draft_probs: torch.Tensor, ctx: VerifyContext, offset: int = 0) -> torch.Tensor:
        """The draft's ``candidates`` earliest arrivals ``[B, n]`` at draft position ``offset``."""
        keys = self.keys(ctx, draft_probs.shape[0], offset, draft_probs.device)
        return race_candidates(draft_probs, keys, self.candidates)

    def target_winners(self, target_probs: torch.Tensor, ctx: VerifyContext) -> torch.Tensor:
        """The target's winners ``[B, K]`` at draft positions ``0..K-1`` from ``target_probs [B, K, V]``."""
        b, k, _ = target_probs.shape
        offsets = torch.arange(k, device=target_probs.device).expand(b, k)
        return race_sample(target_probs, self.keys(ctx, b, offsets, target_probs.device))

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return draft_ids == self.target_winners(target_probs, ctx), None

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        return race_sample(target_probs, self.keys(ctx, target_probs.shape[0], offsets, target_probs.device))

    def bonus(self, target_probs, ctx, offsets):
        return race_sample(target_probs, self.keys(ctx, target_probs.shape[0], offsets, target_probs.device))


# ---------------------------------------------------------------------------------------------
# LANTERN: relaxed acceptance over latent neighbourhoods
# ---------------------------------------------------------------------------------------------


def _check_neighbourhood_args(embeddings: torch.Tensor, k: int) -> int:
    """V, after checking ``embeddings [V, D]`` (floating) and ``k`` in [1, V]."""
    if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2 or not embeddings.is_floating_point():
        raise QuickdraftError(f"embeddings must be a floating [V, D] tensor, got {_describe(embeddings)}")
    v = embeddings.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= v:
        raise QuickdraftError(f"neighbourhood size k must be an integer in [1, V={v}], got {k!r}")
    return v


def _similarity_operands(embeddings: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``embeddings [V, D]`` as float32 (the same tensor when it is float32 already) and ``[V]`` the
    inverse of each row's norm (a zero row gets a large finite one, so its similarities are 0)."""
    matrix = embeddings.detach().float()
    return matrix, 1 / matrix.norm(dim=-1).clamp_min(1e-12)


def _nearest(matrix: torch.Tensor, inverse_norms: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """``[c, k]`` int64: each of ``rows [c]`` first, then its k − 1 nearest tokens by cosine similarity.

    Column i of ``matrix @ matrix[rows].T`` scaled by ``inverse_norms [V]`` is cos(·, i) times
    |e_i|, a positive factor that leaves its order alone. 2·c·V·D flops and one read of the matrix;
    a [V, D] x [D, c] product (then transposed) is faster on a CPU than [c, D] x [D, V] for small c.
    """
    similarity = (matrix @ matrix[rows].T).mul_(inverse_norms[:, None]).T.contiguous()  # [c, V] cosines times |e_i|
    similarity[torch.arange(len(rows), device=matrix.device), rows] = math.inf  # a token is nearest to itself
    return similarity.topk(k, dim=-1).indices


def latent_neighbourhoods(embeddings: torch.Tensor, k: int, chunk_size: int = 512) -> torch.Tensor:
    """The ``k`` tokens nearest to every token by cosine similarity of their embeddings: the full table.

    It costs 2·V²·D flops — for a 151,936 x 1536 embedding 7·10¹³, minutes on a small CPU — of
    which a verification step needs the rows of the drafted tokens only: :class:`LatentNeighbourhoods`
    computes those rows on demand, identical to this table's.

    Parameters
    ----------
    embeddings:
        ``[V, D]`` token embeddings (a model's input embedding matrix or its output head's rows).
    k:
        Neighbourhood size, 1 ≤ k ≤ V, the token itself included.
    chunk_size:
        Rows of the similarity matrix computed at a time: memory is ``chunk_size · V`` floats
        instead of V² (for V = 151,936: 0.3 GB at the default 512 against 92 GB).

    Returns
    -------
    ``[V, k]`` int64: row v is v itself (its own nearest neighbour, even where another token has
    the same embedding or v's embedding is zero), then the k − 1 other tokens of highest cosine
    similarity to v, most similar first.

    >>> latent_neighbourhoods(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]]), 2).tolist()
    [[0, 2], [1, 2], [2, 0]]
    """
    v = _check_neighbourhood_args(embeddings, k)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise QuickdraftError(f"chunk_size must be an integer >= 1, got {chunk_size!r}")
    matrix, inverse_norms = _similarity_operands(embeddings)
    table = torch.empty(v, k, dtype=torch.long, device=matrix.device)
    for start in range(0, v, chunk_size):
        rows = torch.arange(start, min(start + chunk_size, v), device=matrix.device)
        table[rows] = _nearest(matrix, inverse_norms, rows, k)
    return table


class LatentNeighbourhoods:
    """The rows of :func:`latent_neighbourhoods` ``(embeddings, k)``, each computed when first asked for.

    ``table[token_ids]`` (or ``table.rows(token_ids)``) for ``token_ids [...]`` gives ``[..., k]``
    int64, as indexing the full ``[V, k]`` table would: the rows not computed yet are computed in one
    ``[c, D] x [D, V]`` matmul and top-k (2·V·D flops per new token; c distinct new tokens) and
    kept, so that a token drafted again costs a lookup. Shares :func:`latent_neighbourhoods`'
    arithmetic, so its rows are the same.

    The state: a float32 view of the embedding (the tensor itself when it is float32, else one
    float32 copy), the ``[V]`` inverse row norms, an int32 ``[V, k]`` row cache and its ``[V]``
    filled mask (on the embedding's device; on a CPU the cache's untouched pages are never
    allocated).

    >>> table = LatentNeighbourhoods(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1]]), 2)
    >>> table[torch.tensor([2, 0, 2])].tolist(), table.computed
    ([[2, 0], [0, 2], [2, 0]], 2)
    """

    def __init__(self, embeddings: torch.Tensor, k: int) -> None:
        v = _check_neighbourhood_args(embeddings, k)
        self.k = k
        self._matrix, self._inverse_norms = _similarity_operands(embeddings)  # [V, D], [V]
        self._rows = torch.empty(v, k, dtype=torch.int32, device=self._matrix.device)  # [V, k] valid where filled
        self._filled = torch.zeros(v, dtype=torch.bool, device=self._matrix.device)  # [V]

    @property
    def shape(self) -> torch.Size:
        """``(V, k)``, the shape of the full table."""
        return torch.Size((self._rows.shape[0], self.k))

    @property
    def device(self) -> torch.device:
        return self._matrix.device

    @property
    def computed(self) -> int:
        """How many rows have been computed so far."""
        return int(self._filled.sum())

    def rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` int64 neighbourhoods of ``token_ids [...]`` (int64, any device; returned on it)."""
        ids = token_ids.to(self.device)
        flat = ids.reshape(-1)
        missing = flat[~self._filled[flat]].unique()  # [c] distinct tokens not computed yet
        if missing.numel():
            self._rows[missing] = _nearest(self._matrix, self._inverse_norms, missing, self.k).to(torch.int32)
            self._filled[missing] = True
        return self._rows[ids].long().to(token_ids.device)

    __getitem__ = rows

    def __repr__(self) -> str:
        return f"LatentNeighbourhoods(V={self.shape[0]}, k={self.k}, computed={self.computed})"


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def latent_mass(target_probs: torch.Tensor, token_ids: torch.Tensor,
                neighbours: torch.Tensor | LatentNeighbourhoods, delta: float) -> torch.Tensor:
    """m_δ(x): the target mass LANTERN pools onto token x from its latent neighbours.

    A_{k,δ}(x) is the longest prefix of x's neighbourhood ``neighbours[x]`` (x first, then the
    others nearest first) whose tokens other than x hold target mass ≤ δ; m_δ(x) is that mass.
    The relaxed target p̃_x moves it onto x — p̃_x(x) = p(x) + m_δ(x) = Σ_{v ∈ A_{k,δ}(x)} p(v),
    p̃_x(v) = 0 for the other v of A_{k,δ}(x), p̃_x = p elsewhere — so TV(p, p̃_x) = m_δ(x) ≤ δ.

    ``target_probs [..., V]``, ``token_ids [...]`` int64, ``neighbours``: the ``[V, k]`` table of
    :func:`latent_neighbourhoods` or a :class:`LatentNeighbourhoods` (both give ``[..., k]`` rows
    for ``neighbours[ids]``); returns ``[...]``, zeros when k = 1.
    """
    if neighbours.shape[1] == 1:
        return torch.zeros(token_ids.shape, dtype=target_probs.dtype, device=target_probs.device)
    rows = neighbours[token_ids.to(neighbours.device)].to(target_probs.device)  # [..., k]
    others = rows[..., 1:]  # [..., k-1] nearest first
    mass = target_probs.gather(-1, others).cumsum(dim=-1)  # [..., k-1] non-decreasing
    return torch.where(mass <= delta, mass, torch.zeros_like(mass)).amax(dim=-1)


@dataclass(frozen=True)
class Latent(Rule):
    r"""LANTERN's relaxed acceptance (Jang et al., ICLR 2025, arXiv:2410.03355).

    Tokens close in embedding space are near-interchangeable (LANTERN's *latent proximity*). For a
    drafted token x ~ q, the target mass of x's nearest neighbours is pooled onto x, as far as
    total variation δ allows (:func:`latent_mass`):

    .. math::

        \tilde p_x(x) = p(x) + m_\delta(x) = \sum_{v \in A_{k,\delta}(x)} p(v),
        \qquad \mathrm{TV}(p, \tilde p_x) = m_\delta(x) \le \delta

    and x is accepted with probability min(1, p̃_x(x)/q(x)). At the first rejection the recovered
    token is a sample of the residual norm(max(0, p − q)) (:func:`residual`), as in
    :class:`Lossless`; the bonus token is a sample of p. The uniforms are drawn as
    :class:`Lossless` draws them, so δ = 0 or k = 1 (m_δ ≡ 0) is :class:`Lossless` draw for draw.

    *What δ bounds.* LANTERN's δ bounds each relaxed target p̃_x, not the output. One step emits
    token y with probability π(y) = min(q(y), p̃_y(y)) + (1 − β)·r(y), β the acceptance
    probability, r the residual. Writing the lossless rule's p(y) = min(q(y), p(y)) + (p(y) − q(y))₊,
    the extra acceptance e(y) = min(q(y), p̃_y(y)) − min(q(y), p(y)) = min((q(y) − p(y))₊, m_δ(y))
    lives where q > p and the residual's loss where p > q, so exactly

    .. math::

        \mathrm{TV}(\pi, p) = \sum_y \min\big((q(y) - p(y))_+,\ m_\delta(y)\big)
        = \beta - \beta_{\text{lossless}}
        \le \min\big(\mathrm{TV}(p, q),\ \delta \cdot |\{y : q(y) > p(y)\}|\big):

    the distortion of a step equals the acceptance probability gained over :class:`Lossless`,
    never exceeds the draft's own distance from the target, and is at most δ per token the draft
    over-proposes — within δ when it over-proposes one token, but not within δ in general.

    The lossy mask returned by :meth:`accept` marks the acceptances the lossless test with the same
    uniform would have rejected.

    Attributes
    ----------
    k:
        Neighbourhood size, x included (k = 1: lossless). LANTERN's image models use 1000 of
        16,384 codes.
    delta:
        δ ∈ [0, 1], the most target mass pooled onto a drafted token (δ = 0: lossless).
    neighbours:
        The neighbourhoods: a :class:`LatentNeighbourhoods` of k columns (min(k, V)), which computes
        the rows of the drafted tokens as they come, or the full ``[V, ≥k]`` int64 table of
        :func:`latent_neighbourhoods` (its first k columns are used; all V where k > V); ``None``
        until attached (``Pipeline.generate`` attaches the target's). Not part of equality or the repr.
    """

    k: int = 100
    delta: float = 0.1
    neighbours: LatentNeighbourhoods | torch.Tensor | None = field(default=None, compare=False, repr=False)

    name = "lantern"
    greedy_drafts = False

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise QuickdraftError(f"LANTERN neighbourhood size k must be an integer >= 1, got {self.k!r}")
        d = self.delta
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1:
            raise QuickdraftError(f"LANTERN delta must be a total-variation budget in [0, 1], got {d!r}")
        table = self.neighbours
        if table is None:
            return
        if isinstance(table, LatentNeighbourhoods):
            if table.k != min(self.k, table.shape[0]):  # a k beyond V is the whole vocabulary
                raise QuickdraftError(f"LANTERN neighbours computes {table.k} columns, k={self.k} needs "
                                      f"{min(self.k, table.shape[0])}")
            return
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or table.dtype != torch.long:
            raise QuickdraftError(f"LANTERN neighbours must be an int64 [V, k] table, got {_describe(table)}")
        if table.shape[1] < min(self.k, table.shape[0]):  # a k beyond V is the whole vocabulary
            raise QuickdraftError(f"LANTERN neighbours has {table.shape[1]} columns, fewer than k={self.k}")
        if not torch.equal(table[:, 0], torch.arange(table.shape[0], device=table.device)):
            raise QuickdraftError("LANTERN neighbours must list every token first in its own row "
                                  "(use quickdraft.verification.rules.latent_neighbourhoods)")
        object.__setattr__(self, "neighbours", table[:, : self.k])

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """True at δ = 0 or k = 1: nothing is pooled and the rule is :class:`Lossless`."""
        return self.delta == 0 or self.k == 1

    def table(self, vocab_size: int) -> LatentNeighbourhoods | torch.Tensor:
        """The ``[V, k]`` neighbourhoods, checked against the distributions' vocabulary."""
        if self.neighbours is None:
            raise QuickdraftError("the LANTERN rule has no neighbourhood table: pass "
                                  "neighbours=LatentNeighbourhoods(embeddings, k), or run it "
                                  "through Pipeline.generate, which attaches the target's")
        if self.neighbours.shape[0] != vocab_size:
            raise QuickdraftError(f"LANTERN neighbours cover {self.neighbours.shape[0]} tokens, the "
                                  f"distributions {vocab_size}")
        return self.neighbours

    def relaxed_probability(self, target_probs: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
        """p̃_x(x) = p(x) + m_δ(x) for ``draft_ids [...]`` under ``target_probs [..., V]``."""
        table = self.table(target_probs.shape[-1])
        p = _gather_token_probs(target_probs, draft_ids)
        if self.delta == 0:  # nothing is pooled: no neighbourhood needed
            return p
        return p + latent_mass(target_probs, draft_ids, table, self.delta)

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        p = _gather_token_probs(target_probs, draft_ids)
        q = _gather_token_probs(draft_probs, draft_ids)
        relaxed_p = self.relaxed_probability(target_probs, draft_ids)
        u = torch.rand(p.shape, generator=ctx.generator, device=p.device)  # as Lossless draws them
        accepted = u < acceptance_probability(relaxed_p, q)
        return accepted, accepted & ~(u < acceptance_probability(p, q))

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        return sample(residual(target_probs, draft_probs), ctx.generator)

    def bonus(self, target_probs, ctx, offsets):
        return sample(target_probs, ctx.generator)


# ---------------------------------------------------------------------------------------------
# speculative contrastive decoding
# ---------------------------------------------------------------------------------------------


def contrastive_scores(target_logits: torch.Tensor, amateur_logits: torch.Tensor, alpha: float,
                       beta: float) -> torch.Tensor:
    r"""Contrastive decoding's token scores (Li et al., ACL 2023, arXiv:2210.15097), the target as
    the expert and the draft model as the amateur.

    .. math::

        s(x) = \begin{cases} \log p_{exp}(x) - \beta \log p_{ama}(x) & x \in V_{head} \\
        -\infty & \text{otherwise} \end{cases}
        \qquad V_{head} = \{x : p_{exp}(x) \ge \alpha \max_v p_{exp}(v)\}

    with p_exp and p_ama the temperature-1 softmax of ``target_logits`` and ``amateur_logits``. They
    are logits like any others: greedy contrastive decoding takes their argmax, sampling at
    temperature T the softmax of s / T (then top-k / top-p), p_cd ∝ p_exp^{1/T} p_ama^{−β/T} on
    V_head. An amateur temperature τ is β → β / τ (a constant shift of s changes nothing).

    ``target_logits`` and ``amateur_logits`` ``[..., V]`` at the same positions; returns ``[..., V]``
    float32. The target's most likely token is always in V_head; with ``beta = 0`` the scores
    are the target's log-probabilities on V_head (``alpha = 0``: the target itself).

    >>> scores = contrastive_scores(torch.tensor([0.6, 0.36, 0.04]).log(), torch.tensor([0.9, 0.05, 0.05]).log(),
    ...                             alpha=0.1, beta=1.0)   # token 2 is below 0.1 x 0.6: implausible
    >>> [round(s, 3) for s in scores.exp().tolist()]       # p_exp / p_ama on V_head
    [0.667, 7.2, 0.0]
    """
    expert = target_logits.float().log_softmax(dim=-1)
    scores = expert if beta == 0 else expert - beta * amateur_logits.float().log_softmax(dim=-1)
    if alpha == 0:
        return scores
    head = expert >= expert.amax(dim=-1, keepdim=True) + math.log(alpha)  # [..., V] V_head
    return scores.masked_fill(~head, -math.inf)


@dataclass(frozen=True)
class Contrastive(Rule):
    """Speculative contrastive decoding, SCD (Yuan et al., ACL 2024, arXiv:2311.08981): the draft
    model drafts and, as contrastive decoding's amateur, turns the target's logits into the
    contrastive scores of :func:`contrastive_scores` at every verified position, which are then
    processed (temperature, top-k, top-p) into p_cd and verified against as the target's would be:
    exact match with the argmax of p_cd at temperature 0 (``greedy_drafts``), speculative
    sampling (:class:`Lossless`: u < min(1, p_cd(x)/q(x)), residual norm(max(0, p_cd − q)))
    otherwise.

    The rule sees processed distributions only; the scores are computed by the proposal of the
    ``cd`` and ``scd`` methods (:class:`quickdraft.decoding.contrastive.ContrastiveProposal`), which runs the
    amateur one token beyond the draft so that the bonus token is from p_cd as well. So every
    emitted token follows p_cd: ``scd`` is lossless *with respect to contrastive decoding* —
    greedy ``scd`` equals greedy ``cd`` token for token — and lossy with respect to the target
    (:attr:`lossless` is the target's: only β = 0 with α = 0).

    Attributes
    ----------
    alpha:
        α ∈ [0, 1], the plausibility cut: tokens below α times the target's largest probability
        are excluded (Li et al.: 0.1; 0: none; 1: only the target's argmax).
    beta:
        β ≥ 0, the weight of the amateur's log-probability (Li et al.'s contrastive decoding: 1;
        0: the target cut to V_head).
    greedy_drafts:
        Draft the amateur's argmax and accept by exact match (temperature 0), instead of
        sampling and the lossless test.
    """

    alpha: float = 0.1
    beta: float = 0.5
    greedy_drafts: bool = False

    name = "contrastive"
    needs_full_draft = True  # log q of every token: the amateur's whole distribution

    def __post_init__(self) -> None:
        a, b = self.alpha, self.beta
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise QuickdraftError(f"contrastive decoding alpha must be a plausibility cut in [0, 1], got {a!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not (b >= 0 and math.isfinite(b)):
            raise QuickdraftError(f"contrastive decoding beta must be a finite number >= 0, got {b!r}")

    @property
    def lossless(self) -> bool:  # type: ignore[override]
        """With respect to the target: only at β = 0 and α = 0, where p_cd is the target's."""
        return self.beta == 0 and self.alpha == 0

    def scores(self, target_logits: torch.Tensor, amateur_logits: torch.Tensor) -> torch.Tensor:
        """:func:`contrastive_scores` with this rule's α and β (``[..., V]`` both)."""
        return contrastive_scores(target_logits, amateur_logits, self.alpha, self.beta)

    @property
    def test(self) -> Rule:
        """The test against p_cd: :class:`Greedy` with greedy drafts, else :class:`Lossless`."""
        return Greedy() if self.greedy_drafts else Lossless()

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return self.test.accept(draft_ids, draft_probs, target_probs, ctx)

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        return self.test.correct(rejected_ids, draft_probs, target_probs, ctx, offsets)


#: rule classes by their CLI / results name
RULES: dict[str, type[Rule]] = {
    rule.name: rule for rule in (Lossless, Greedy, Fuzzy, Typical, ExponentialRace, Latent, Contrastive)
}

__all__ = [
    "RULES",
    "VerifyContext",
    "Rule",
    "Lossless",
    "Greedy",
    "Fuzzy",
    "Typical",
    "ExponentialRace",
    "Latent",
    "LatentNeighbourhoods",
    "Contrastive",
    "contrastive_scores",
    "acceptance_probability",
    "latent_mass",
    "latent_neighbourhoods",
    "residual",
    "typical_threshold",
]
