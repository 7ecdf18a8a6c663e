"""Draft-length policies: how many tokens to draft before verifying.

A policy is asked three things by the engine, once per verification step:

``begin_step()``
    the most tokens to draft this step (an integer in ``[1, MAX_DRAFT_LENGTH]``). It may be called
    more than once per step (the engine also asks it once before generation to size the context),
    so it must not move the policy's state forward -- only reset the per-step state. The engine
    drafts fewer tokens when fewer are left to generate (:class:`BudgetCap`).
``keep_drafting(i, draft_probs, hidden, token=None)``
    after drafting token ``i`` (0-based) of the step, whether to draft another one. ``draft_probs``
    is ``[B, V]``, the draft's *unwarped* (temperature-1, no top-k/top-p) distribution at the
    position of token ``i`` -- at temperature 0 the sampling distribution is one-hot and says
    nothing about confidence -- ``hidden`` the drafter's last
    hidden state ``[B, H]`` when :attr:`needs_hidden` is set: the state at the *last token fed* to
    the draft model, i.e. the accepted context's last token for ``i = 0`` and draft token ``i - 1``
    for ``i >= 1``, and ``token`` the ``[B]`` ids of draft token ``i`` itself (drawn from the
    processed version of ``draft_probs``; ``None`` if the drafter does not say). One answer for the
    whole batch. A policy that never reads ``draft_probs`` says so (:attr:`needs_probs` false), and
    the drafter then spares the softmax and passes ``None``.
``update(num_drafted, num_accepted)``
    the outcome of the step (``num_accepted`` is ``[B]``, the rows that took part).

Before each step's ``begin_step`` the engine also tells the policy how many rows the step decodes
(``observe_rows(rows)``); only :class:`CostAware` reads it (a draft that pays for one row may not
pay for sixteen).

A policy only decides *how many* tokens are verified, never *whether* they are accepted, so it
cannot change the output distribution of a lossless rule (tested in ``tests/test_policies.py``).

Policies
--------
=================  ==========================================================================
``Constant(k)``    always ``k``
``Heuristic``      ``k += 2`` after a fully accepted draft, ``k -= 1`` otherwise, in
                   ``[min_k, max_k]`` (the schedule of Hugging Face assisted generation)
``Confidence``     stop after a draft token whose top draft probability is below ``p_min``
                   (the ``p_min`` rule of llama.cpp's speculative example, except that the
                   low-confidence token is still verified: it is already drafted and verifying
                   one more token costs almost nothing on a memory-bound target)
``SpecDecPP``      stop once the predicted probability that some drafted token is rejected,
                   ``1 − Π_i P̂_i``, exceeds a threshold ``h`` (Huang, Guo & Wang 2024);
                   ``P̂_i`` from the draft's hidden state at the token (or, for a head that
                   reads the drawing state, the state that drew it) and, if the head reads
                   them, its confidence at the token
``CostAware``      the length ``k`` (0: a plain step) that maximises expected tokens per
                   second, ``E[tokens | k] / cost(k)``, under the backend's measured forward
                   costs (:class:`quickdraft.backends.costs.StepCost`) and a running estimate
                   of the acceptance rate (Leviathan et al. 2023, §3.5, with a measured cost
                   curve for the verification instead of a constant)
=================  ==========================================================================

Batches
-------
All rows draft the same number of tokens (one batched draft forward per token), so a batch needs
one decision. Each row ``b`` has a *risk* ``r_b``: the (predicted) probability that its draft so
far contains a rejected token. :func:`batch_stop` stops when the batch's risk passes ``h``; the
batch risk is, by ``batch_rule``:

``"mean"`` (default)
    the mean of ``r_b`` = the expected share of rows whose draft is already dead. The next draft
    token's value is proportional to the expected number of rows still alive, while its cost (one
    batched draft forward plus one more verified column) is shared by all rows, so the mean is the
    quantity the single-row threshold rule generalises to. With ``B = 1`` all three rules agree.
``"any"``
    ``max_b r_b``: stop as soon as one row is at risk (short drafts, few wasted tokens).
``"all"``
    ``min_b r_b``: draft until every row is at risk (long drafts, many wasted tokens).

References
----------
.. [1] K. Huang, X. Guo, M. Wang, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
   Lengths", arXiv:2405.19715, 2024. Theorem 1: the optimal stopping policy of the MDP is a
   threshold policy on P(at least one drafted token is rejected).
.. [2] Hugging Face transformers, ``AssistedCandidateGenerator``, ``num_assistant_tokens_schedule
   = "heuristic"``.
.. [3] Y. Leviathan, M. Kalman, Y. Matias, "Fast Inference from Transformers via Speculative
   Decoding", ICML 2023, §3.5: the expected tokens of a step, ``(1 − α^(γ+1)) / (1 − α)``, and
   the draft length that maximises them per unit of time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Sequence

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.verification.verify import MAX_DRAFT_LENGTH

if TYPE_CHECKING:  # pragma: no cover
    from quickdraft.backends.costs import StepCost
    from quickdraft.decoding.head import AcceptanceHead

BatchRule = Literal["mean", "any", "all"]
BATCH_RULES: tuple[str, ...] = ("mean", "any", "all")


class Policy:
    """Interface; see the module docstring."""

    name: str = "policy"
    needs_hidden: bool = False
    #: whether ``keep_drafting`` reads ``draft_probs`` (a drafter may pass ``None`` where not)
    needs_probs: bool = True

    def begin_step(self) -> int:
        raise NotImplementedError

    def keep_drafting(self, i: int, draft_probs: torch.Tensor, hidden: torch.Tensor | None,
                      token: torch.Tensor | None = None) -> bool:
        return True

    def update(self, num_drafted: int, num_accepted: torch.Tensor) -> None:
        return None

    def observe_rows(self, rows: int) -> None:
        """The next step decodes ``rows`` batch rows."""
        return None

    def reset(self) -> None:
        """Forget everything learnt from earlier steps (a new, unrelated generation begins)."""
        return None


class BudgetCap(Policy):
    """``policy`` with each step's draft cut to ``cap`` tokens; the engine wraps its policy in one
    per step, with ``cap`` = the tokens left to generate minus the bonus token.

    The cap depends only on how many tokens have been emitted, like any policy's decision, so it
    never changes which tokens a lossless rule emits (at temperature 0 the greedy text is the
    same), only how many draft forwards it takes. ``keep_drafting`` and ``needs_hidden`` are the
    wrapped policy's; ``update`` is the engine's to call on the wrapped policy.

    Attributes
    ----------
    policy: the wrapped policy.
    cap: the most tokens to draft this step (``>= 1``).
    """

    def __init__(self, policy: Policy, cap: int) -> None:
        self.policy = policy
        self.cap = int(cap)
        self.name = policy.name
        self.needs_hidden = policy.needs_hidden
        self.needs_probs = policy.needs_probs

    def begin_step(self) -> int:
        return min(self.policy.begin_step(), self.cap)

    def keep_drafting(self, i: int, draft_probs: torch.Tensor, hidden: torch.Tensor | None,
                      token: torch.Tensor | None = None) -> bool:
        return self.policy.keep_drafting(i, draft_probs, hidden, token=token)


def _check_k(value: int, what: str) -> None:
    """Raise unless ``value`` is an integer in ``[1, MAX_DRAFT_LENGTH]``."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise QuickdraftError(f"{what} must be an integer >= 1, got {value!r}")
    if value > MAX_DRAFT_LENGTH:
        raise QuickdraftError(f"{what} must be at most {MAX_DRAFT_LENGTH} (the maximum draft length), got {value!r}")


def _check_batch_rule(rule: str) -> None:
    if rule not in BATCH_RULES:
        raise QuickdraftError(f"unknown batch rule {rule!r}; choose one of {', '.join(BATCH_RULES)}")


# ---------------------------------------------------------------------------------------------
# pure mathematics
# ---------------------------------------------------------------------------------------------


def rejection_risk(accept_probs: torch.Tensor) -> torch.Tensor:
    """Probability that at least one of the drafted tokens is rejected.

    .. math::  r = 1 - \\prod_{i=1}^{n} \\hat P_i

    where :math:`\\hat P_i` is the probability that draft token ``i`` is accepted given that all
    before it were (so the product is the probability that all ``n`` are accepted).

    Parameters
    ----------
    accept_probs:
        ``[B, n]`` conditional acceptance probabilities in ``[0, 1]`` (``n = 0`` gives risk 0).

    Returns
    -------
    ``[B]`` risks in ``[0, 1]``.

    >>> [round(r, 6) for r in rejection_risk(torch.tensor([[0.9, 0.5]])).tolist()]
    [0.55]
    """
    if accept_probs.dim() != 2:
        raise QuickdraftError(f"accept_probs must be [B, n], got shape {tuple(accept_probs.shape)}")
    return 1.0 - accept_probs.clamp(0.0, 1.0).prod(dim=-1)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens a step emits when it drafts ``k`` tokens, each accepted with probability
    ``alpha`` once all before it were: ``Σ_{i=0..k} α^i = (1 − α^(k+1)) / (1 − α)`` (the bonus or
    recovered token included; Leviathan et al. 2023, eq. 1).

    >>> expected_tokens(0.5, 2), expected_tokens(1.0, 4), expected_tokens(0.3, 0)
    (1.75, 5.0, 1.0)
    """
    return float(sum(alpha ** i for i in range(int(k) + 1)))


def best_length(expected: Sequence[float], costs: "StepCost", rows: int = 1) -> int:
    """The draft length ``k`` in ``[0, len(expected) - 1]`` that maximises expected tokens per
    second, ``expected[k] / costs.step(k, rows)`` (``expected[k]``: the tokens a step drafting ``k``
    emits on average; every row drafts ``k``); ``0`` (a plain step) wins ties, so a draft is made
    only where it is expected to pay.

    >>> from quickdraft.backends.costs import StepCost
    >>> best_length([1.0, 1.9, 2.2], StepCost((1.0, 1.1, 1.2), draft=0.1)), best_length([1.0, 1.1], StepCost((1.0, 1.2), draft=0.1))
    (1, 0)
    """
    best_k, best_rate = 0, expected[0] / costs.step(0, rows)
    for k in range(1, len(expected)):
        rate = expected[k] / costs.step(k, rows)
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


def best_draft_length(alpha: float, costs: "StepCost", max_k: int, rows: int = 1) -> int:
    """:func:`best_length` for a geometric acceptance at rate ``alpha``: the ``k`` in ``[0, max_k]``
    that maximises ``expected_tokens(alpha, k) / costs.step(k, rows)``.

    >>> from quickdraft.backends.costs import StepCost
    >>> flat = StepCost(tuple(1.0 + 0.0125 * m for m in range(9)), draft=0.1)     # memory-bound target
    >>> steep = StepCost((1.0, 1.7, 2.4, 3.0, 3.7, 4.4, 5.1, 5.9, 6.6), draft=0.3)  # compute-bound target
    >>> best_draft_length(0.8, flat, 8), best_draft_length(0.8, steep, 8), best_draft_length(0.2, flat, 8)
    (5, 0, 1)
    >>> from quickdraft.backends.costs import RowsCost
    >>> served = dataclasses.replace(flat, batched=(RowsCost(16, steep.target, draft=0.3),))  # flat at 1 row, steep at 16
    >>> best_draft_length(0.8, served, 8), best_draft_length(0.8, served, 8, rows=16)
    (5, 0)
    """
    return best_length([expected_tokens(alpha, k) for k in range(int(max_k) + 1)], costs, rows)


def batch_stop(risk: torch.Tensor, threshold: float, rule: BatchRule = "mean") -> bool:
    """Whether a batch stops drafting: its aggregated ``risk [B]`` is above ``threshold``.

    ``"mean"``: ``mean(risk) > h``; ``"any"``: ``max(risk) > h``; ``"all"``: ``min(risk) > h``.
    The comparison is strict, as in SpecDec++: drafting continues while ``1 − Π P̂ <= h``.

    >>> batch_stop(torch.tensor([0.1, 0.9]), 0.5, "mean"), batch_stop(torch.tensor([0.1, 0.9]), 0.5, "any")
    (False, True)
    """
    _check_batch_rule(rule)
    if risk.numel() == 0:
        return False
    if rule == "mean":
        agg = risk.float().mean()
    elif rule == "any":
        agg = risk.max()
    else:
        agg = risk.min()
    return bool(agg > threshold)


def heuristic_next_k(k: int, fully_accepted: bool, min_k: int, max_k: int) -> int:
    """Hugging Face's schedule: ``k + 2`` after a fully accepted draft, else ``k − 1``, clipped."""
    return min(max_k, k + 2) if fully_accepted else max(min_k, k - 1)


# ---------------------------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------------------------


@dataclass
class Constant(Policy):
    """Always draft ``k`` tokens."""

    k: int = 4
    name = "constant"
    needs_probs = False

    def __post_init__(self) -> None:
        _check_k(self.k, "draft length k")

    def begin_step(self) -> int:
        return self.k


@dataclass
class Heuristic(Policy):
    """``k ← k + 2`` after a fully accepted draft, ``k ← k − 1`` otherwise, ``min_k <= k <= max_k``.

    A batch counts as fully accepted when at least half of its rows accepted every drafted token
    (for ``B = 1``: the row did), so one unlucky row does not shrink the draft for all.

    Attributes
    ----------
    initial_k: the draft length of the first step (and after :meth:`reset`).
    min_k: the smallest draft length.
    max_k: the largest draft length.
    """

    initial_k: int = 4
    min_k: int = 1
    max_k: int = 16
    name = "heuristic"
    needs_probs = False
    k: int = field(init=False)

    def __post_init__(self) -> None:
        for value, what in ((self.initial_k, "initial_k"), (self.min_k, "min_k"), (self.max_k, "max_k")):
            _check_k(value, what)
        if not self.min_k <= self.initial_k <= self.max_k:
            raise QuickdraftError(
                f"need min_k <= initial_k <= max_k, got {self.min_k}, {self.initial_k}, {self.max_k}"
            )
        self.k = self.initial_k

    def begin_step(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: torch.Tensor) -> None:
        if num_accepted.numel() == 0 or num_drafted == 0:
            return
        share_full = (num_accepted >= num_drafted).float().mean().item()
        self.k = heuristic_next_k(self.k, share_full >= 0.5, self.min_k, self.max_k)

    def reset(self) -> None:
        self.k = self.initial_k


@dataclass
class CostAware(Policy):
    """Draft :func:`best_draft_length` tokens: the length (0: a plain step) that maximises expected
    tokens per second under ``costs``, the backend's measured forward costs, and ``alpha``, a
    running estimate of the per-token acceptance rate.

    ``alpha`` is ``A / (A + R)``: ``A`` the accepted draft tokens and ``R`` the rejections seen
    (a row that accepted ``n < k`` of its ``k`` tokens rejected one; one that accepted all ``k``
    rejected none: the maximum-likelihood estimate of a geometric acceptance), both decayed by
    ``memory`` each drafting step and started from ``prior`` with the weight of ``prior_weight``
    tokens; the prior is optimistic, so that a generation learns its acceptance from its first
    drafts rather than from sparse probes. A plain step teaches nothing about acceptance, so after ``probe_every`` plain steps in a
    row the policy drafts one token again, where a draft could pay at all (at an acceptance rate of
    ``probe_alpha``); where even that could not (a draft model as slow as the target's extra
    verification), it never drafts.

    The length is a decision made before the step's draft, from earlier steps only, so the output
    distribution of a lossless rule is untouched.

    In a batch every row drafts the same length, and the length is chosen under the costs at the
    batch's rows (``observe_rows``; :meth:`quickdraft.backends.costs.StepCost.step`): where the
    costs were measured over batches, a server drafts less, or not at all, when many rows share a
    step.

    Attributes
    ----------
    max_k: the longest draft.
    costs: :class:`quickdraft.backends.costs.StepCost` over at least ``max_k + 1`` target tokens;
        ``None`` until the pipeline measures them (:meth:`quickdraft.pipeline.Pipeline.ready_policy`).
    rows: the rows the next step decodes (the engine says, ``observe_rows``).
    """

    max_k: int = 8
    costs: "StepCost | None" = None
    prior: float = 0.8
    prior_weight: float = 2.0
    memory: float = 0.9
    probe_every: int = 16
    probe_alpha: float = 0.9
    rows: int = 1
    name = "cost"
    needs_probs = False
    #: begin_step may answer 0: the engine makes a plain step
    may_skip = True

    def __post_init__(self) -> None:
        _check_k(self.max_k, "longest draft length max_k")
        for value, what in ((self.prior, "prior"), (self.probe_alpha, "probe_alpha")):
            if not 0.0 < value < 1.0:
                raise QuickdraftError(f"{what} must be in (0, 1), got {value!r}")
        if not 0.0 <= self.memory < 1.0 or not self.prior_weight > 0:
            raise QuickdraftError(f"need 0 <= memory < 1 and prior_weight > 0, got {self.memory!r}, {self.prior_weight!r}")
        if isinstance(self.probe_every, bool) or int(self.probe_every) != self.probe_every or self.probe_every < 1:
            raise QuickdraftError(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        self.reset()

    @property
    def alpha(self) -> float:
        """The running estimate of the per-token acceptance rate."""
        return self.accepted / (self.accepted + self.rejected)

    @property
    def never_drafts(self) -> bool:
        """Whether no draft can pay under ``costs`` at the acceptance rate known or probed for, at
        any measured batch size: the policy then makes plain steps only (the estimate moves only
        with drafts), and the engine spares the draft model its prefill."""
        if self.costs is None:
            return False
        alpha = max(self.alpha, self.probe_alpha)
        return all(best_draft_length(alpha, self.costs, self.max_k, rows) == 0
                   for rows in (1, *(r.rows for r in self.costs.batched)))

    def begin_step(self) -> int:
        if self.costs is None:
            raise QuickdraftError("the cost policy needs the backend's forward costs: run it through "
                                  "Pipeline.generate, or set CostAware.costs (quickdraft.backends.costs)")
        if len(self.costs.target) < self.max_k + 1:
            raise QuickdraftError(f"the cost policy drafts up to {self.max_k} tokens but its costs cover target "
                                  f"forwards of up to {len(self.costs.target)} tokens, not {self.max_k + 1}")
        k = best_length(self.expected_by_length(), self.costs, self.rows)
        if k == 0 and self.plain_steps >= self.probe_every and best_draft_length(
                self.probe_alpha, self.costs, self.max_k, self.rows):
            return 1
        return k

    def expected_by_length(self) -> list[float]:
        """The tokens a step emits on average when it drafts ``k = 0 … max_k``, under the running
        estimate (:func:`expected_tokens` at ``alpha``)."""
        return [expected_tokens(self.alpha, k) for k in range(self.max_k + 1)]

    def observe_rows(self, rows: int) -> None:
        self.rows = max(1, int(rows))

    def update(self, num_drafted: int, num_accepted: torch.Tensor) -> None:
        if num_drafted == 0 or num_accepted.numel() == 0:
            self.plain_steps += 1
            return
        self.plain_steps = 0
        n = num_accepted.clamp(0, num_drafted)
        self.accepted = self.memory * self.accepted + float(n.sum())
        self.rejected = self.memory * self.rejected + float((n < num_drafted).sum())

    def reset(self) -> None:
        self.accepted = self.prior * self.prior_weight
        self.rejected = (1.0 - self.prior) * self.prior_weight
        self.plain_steps = 0


@dataclass
class Confidence(Policy):
    """Stop drafting after a token whose draft distribution has top probability below ``p_min``.

    The confidence is read from the temperature-1 distribution, which :class:`ModelDrafter` hands
    every policy as ``draft_probs`` (the *processed* distribution would be one-hot at temperature 0
    and never stop the draft). For a drafter that hands over a processed distribution, give
    ``output_head`` (the draft model's ``lm_head``): the policy then recomputes
    ``softmax(lm_head(h))`` from the hidden state that produced the token, at the price of one more
    ``lm_head`` product per draft token.

    A row is *at risk* (risk 1) from its first low-confidence token on; the batch stops by
    :func:`batch_stop` with threshold 1/2 (``"mean"``: when more than half the rows are at risk).

    Attributes
    ----------
    p_min: confidence threshold in ``[0, 1]`` (0 never stops early: ``Constant(max_k)``).
    max_k: the most tokens per step.
    batch_rule: see the module docstring.
    output_head: optional ``[B, H] -> [B, V]`` logits map of the draft model (see above).
    """

    p_min: float = 0.5
    max_k: int = 10
    batch_rule: BatchRule = "mean"
    output_head: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False)
    name = "confidence"
    _dead: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0.0 <= float(self.p_min) <= 1.0):
            raise QuickdraftError(f"p_min must be in [0, 1], got {self.p_min!r}")
        _check_k(self.max_k, "longest draft length max_k")
        _check_batch_rule(self.batch_rule)
        self.needs_hidden = self.output_head is not None

    def begin_step(self) -> int:
        self._dead = None
        return self.max_k

    def keep_drafting(self, i: int, draft_probs: torch.Tensor, hidden: torch.Tensor | None,
                      token: torch.Tensor | None = None) -> bool:
        # draft_probs: [B, V]; hidden: [B, H] (the state whose logits drew token i); token unused
        if self.output_head is not None and hidden is not None:
            with torch.inference_mode():
                top = torch.softmax(self.output_head(hidden).float(), dim=-1).max(dim=-1).values
        else:
            top = draft_probs.max(dim=-1).values
        low = top < self.p_min  # [B]
        self._dead = low if self._dead is None or self._dead.shape != low.shape else self._dead | low
        return not batch_stop(self._dead.float(), 0.5, self.batch_rule)


@dataclass
class SpecDecPP(Policy):
    """SpecDec++ (Huang, Guo & Wang 2024): keep drafting while ``1 − Π_i P̂_i <= threshold``.

    ``P̂_i = head(h_i)`` is the acceptance head's probability that draft token ``i`` is accepted
    given that all before it were, read from the draft model's last hidden state *at that token*
    (the state computed when the token is fed back to draft the next one). As in the paper's
    implementation, the token drafted last in a step is therefore not yet scored when the decision
    is taken: after drafting token ``i`` the product runs over tokens ``0 .. i−1``, and at ``i = 0``
    (hidden state of the already-accepted context) it is empty, so at least ``min(2, max_k)``
    tokens are drafted.

    A head that reads the *drawing* state (``head.reads == "drawing"``) scores token ``i`` at call
    ``i`` from ``hidden`` (the state whose logits drew it) and ``s_i``: the product then runs over
    tokens ``0 .. i`` and the policy may stop after a single token.

    A head with confidence inputs (``head.num_stats > 0``) also reads
    ``s_i = baseline_design(confidence_features(draft_probs_i, token_i))``, the draft's own
    confidence at token ``i``: the policy computes it at call ``i`` (which hands over token ``i``
    and the unwarped distribution it was drawn from), keeps it, and at call ``i + 1`` scores token
    ``i`` with ``head.accept_prob(hidden, s_i)``. Such a head needs ``token``; a head without them
    (``num_stats = 0``) ignores ``token`` and behaves as the paper's.

    Attributes
    ----------
    head: a trained :class:`quickdraft.decoding.head.AcceptanceHead` for this draft model.
    threshold: ``h`` in ``[0, 1]``; larger drafts longer.
    min_k: always draft at least this many tokens.
    max_k: never draft more than this many tokens.
    batch_rule: see the module docstring.
    """

    head: "AcceptanceHead"
    threshold: float = 0.5
    min_k: int = 1
    max_k: int = 10
    batch_rule: BatchRule = "mean"
    name = "specdecpp"
    needs_hidden = True
    _accept: list[torch.Tensor] = field(default_factory=list, init=False, repr=False)
    _stats: torch.Tensor | None = field(default=None, init=False, repr=False)  # s of the last token drafted

    def __post_init__(self) -> None:
        if not (0.0 <= float(self.threshold) <= 1.0):
            raise QuickdraftError(f"threshold h must be in [0, 1], got {self.threshold!r}")
        _check_k(self.min_k, "min_k")
        _check_k(self.max_k, "longest draft length max_k")
        if self.min_k > self.max_k:
            raise QuickdraftError(f"need min_k <= max_k, got {self.min_k} > {self.max_k}")
        _check_batch_rule(self.batch_rule)

    @classmethod
    def from_file(cls, path: str, *, draft_name: str | None = None, **kwargs) -> "SpecDecPP":
        """Load the head saved at ``path`` (see :func:`quickdraft.decoding.head.load_head`)."""
        from quickdraft.decoding.head import load_head

        return cls(load_head(path, draft_name=draft_name), **kwargs)

    def begin_step(self) -> int:
        self._accept = []
        self._stats = None
        return self.max_k

    def risk(self) -> torch.Tensor | None:
        """``[B]`` predicted rejection risk of the tokens scored so far this step (None: none yet)."""
        if not self._accept:
            return None
        return rejection_risk(torch.stack(self._accept, dim=1))

    def keep_drafting(self, i: int, draft_probs: torch.Tensor, hidden: torch.Tensor | None,
                      token: torch.Tensor | None = None) -> bool:
        if hidden is None:
            raise QuickdraftError("the specdecpp policy needs the drafter's hidden states (needs_hidden)")
        stats = None
        if self.head.num_stats:
            if token is None:
                raise QuickdraftError(
                    "this specdecpp head reads the draft's confidence at each drafted token: the drafter "
                    "must pass token= to keep_drafting"
                )
            from quickdraft.decoding.head import baseline_design, confidence_features

            stats = baseline_design(confidence_features(draft_probs, token))  # [B, num_stats], token i's
        if self.head.reads == "drawing":  # hidden drew token i: score it now
            self._accept.append(self.head.accept_prob(hidden, stats))  # [B]
        elif i >= 1:  # hidden is draft token i-1's state; at i = 0 it is the accepted context's
            if self.head.num_stats and self._stats is None:
                raise QuickdraftError(f"specdecpp: keep_drafting({i}) without the call for token {i - 1} this step")
            self._accept.append(self.head.accept_prob(hidden, self._stats))  # [B]
        self._stats = stats
        if i + 1 < self.min_k:
            return True
        risk = self.risk()
        return risk is None or not batch_stop(risk, self.threshold, self.batch_rule)
