r"""Optimal and achieved acceptance rates of multi-draft speculative decoding (one position).

Setting and terms
-----------------
At one position the draft proposes ``n`` tokens :math:`x_1, \dots, x_n` (the *drafts*), drawn from the
draft distribution :math:`q` (``draft_probs``, ``[V]``) under one of three *sampling* schemes:

``"with_replacement"``
    :math:`x_1, \dots, x_n` i.i.d. from :math:`q`.
``"without_replacement"``
    Sequentially without replacement: :math:`x_i` is drawn from :math:`q` restricted to the tokens not
    drawn yet, renormalised (equivalently Gumbel-top-``n`` of :math:`\log q`). Tokens with
    :math:`q = 0` are never drafted: if :math:`q` has fewer than ``n`` positive entries the drafts are
    its whole support (fewer than ``n`` distinct drafts).
``"greedy"`` (Hu et al. 2025, §5)
    The ``n - 1`` most likely draft tokens deterministically (ties broken towards the lower token id,
    i.e. ``np.argsort(-q, kind="stable")[: n - 1]``; zero-probability tokens can be among them), plus one
    token drawn from :math:`q` restricted to the remaining vocabulary and renormalised. If that
    remainder has zero mass there is no sampled draft.

A *verifier* maps the drafts (and its own randomness) to one emitted token whose law must be the
target distribution :math:`p` (``target_probs``, ``[V]``). Its *acceptance rate* is the probability
that the emitted token is one of the drafts.

Optimal acceptance rate (Hu et al. 2025, §3: the dual of the transport LP)
----------------------------------------------------------------------
.. math::

    \alpha^* = \max_{\pi \in \Pi(Q, p)} \Pr_\pi[Y \in \{x_1, \dots, x_n\}]
             = 1 - \max_{A \subseteq [V]} \bigl( \Pr_Q[\text{all drafts} \in A] - p(A) \bigr),

where :math:`Q` is the law of the draft tuple and :math:`Y \sim p`. The dual follows from max-flow /
min-cut (see ``docs/theory.md``). With :math:`H = A^c` it reads
:math:`\alpha^* = 1 + \min_H [\Pr(\text{some draft} \in H) - p(H)]`.

Structure used for speed (derived and verified in ``docs/theory.md`` and ``tests/theory``):

* with replacement, :math:`\Pr[\text{all} \in A] = q(A)^n`; a maximiser is a prefix of the tokens
  sorted by :math:`q/p` in decreasing order, so :math:`O(V \log V)`;
* without replacement, the same prefix order is optimal (proved in ``docs/theory.md`` §3.1 from an
  exchange lemma, and checked by brute force over all subsets); :math:`\Pr[\text{all} \in A]` is the
  Laplace transform of the ``n``-th arrival time of an exponential race, evaluated for the prefixes by
  :mod:`quickdraft.theory._wor` (log-time quadrature, light tokens through precomputed moments, branch
  and bound over prefixes using the convexity of :math:`g` in the cumulative draft mass);
* greedy: closed form :math:`\alpha^* = p(G) + \sum_{x \notin G} \min(p(x), q'(x))` with :math:`G` the
  top ``n - 1`` tokens and :math:`q'` the renormalised remainder.

References
----------
.. [1] Z. Hu, T. Zheng, V. Viswanathan, Z. Chen, R. A. Rossi, Y. Wu, D. Manocha, H. Huang. "Towards
   Optimal Multi-draft Speculative Decoding", ICLR 2025, arXiv:2502.18779.
.. [2] Z. Sun, A. T. Suresh, J. H. Ro, A. Beirami, H. Jain, F. Yu. "SpecTr: Fast Speculative Decoding
   via Optimal Transport", NeurIPS 2023, arXiv:2310.15141.
.. [3] X. Miao et al. "SpecInfer: Accelerating Generative LLM Serving with Tree-based Speculative
   Inference and Verification", ASPLOS 2024, arXiv:2305.09781.
.. [4] W. Kool, H. van Hoof, M. Welling. "Stochastic Beams and Where to Find Them: The Gumbel-Top-k
   Trick", ICML 2019 (sampling without replacement as an exponential race).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, sparse

from quickdraft.errors import QuickdraftError
from quickdraft.theory import _validate, _wor
from quickdraft.theory._ratio import RatioProfile

#: Above this many ordered draft tuples the exact enumeration gives way to the quadrature.
_EXACT_TUPLE_LIMIT = 20_000


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def optimal_acceptance(target_probs, draft_probs, num_drafts: int, sampling: str) -> float:
    r"""Optimal multi-draft acceptance rate :math:`\alpha^*` (Hu et al. 2025), fast and exact.

    .. math::

        \alpha^* = 1 - \max_{A \subseteq [V]} \bigl( \Pr[x_1, \dots, x_n \in A] - p(A) \bigr)

    Parameters
    ----------
    target_probs:
        ``[V]`` target distribution :math:`p`.
    draft_probs:
        ``[V]`` draft distribution :math:`q`.
    num_drafts:
        ``n >= 1`` drafts per position.
    sampling:
        ``"with_replacement"``, ``"without_replacement"`` or ``"greedy"`` (see the module docstring).

    Returns
    -------
    float
        :math:`\alpha^* \in [0, 1]`. For ``n = 1`` every scheme gives :math:`1 - \mathrm{TV}(p, q)`
        (greedy with ``n = 1`` is a single sampled draft).

    Notes
    -----
    Cost: ``O(V log V)`` for every scheme (one sort). ``"without_replacement"`` is exact by enumeration
    when ``|supp q|`` has at most 20,000 ordered ``n``-tuples, otherwise a quadrature with absolute
    error below ``1e-13`` in the tests; at ``V = 151,936``, ``n = 8`` it takes about 20-30 ms of CPU
    time (``benchmarks/bench_theory.py``). Very flat draft distributions (every token within a factor
    of ~200 of the ``n``-th largest) are slower (about 1.5 s), still exact.

    Examples
    --------
    >>> optimal_acceptance([0.5, 0.5], [0.9, 0.1], 1, "with_replacement")  # 1 - TV
    0.6
    """
    p, q = _validate.pair(target_probs, draft_probs)
    n = _validate.num_drafts(num_drafts)
    s = _validate.sampling(sampling)
    if s == "greedy":
        return _alpha_greedy_dual(p, q, n)
    # the maximising set A is a prefix of the q/p order (docs/theory.md §2-3); tokens with q = 0 come
    # after every q > 0 token and only add target mass, so only the first m = |supp q| prefixes count
    order = _ratio_order(p, q)
    m = int(np.count_nonzero(q))
    qs, ps = q[order[:m]], p[order[:m]]
    p_cum = np.concatenate([[0.0], np.cumsum(ps)])
    if s == "with_replacement":
        gap = float(np.max(np.concatenate([[0.0], np.cumsum(qs)]) ** n - p_cum))
    else:
        gap = _wor_max_gap(qs, ps, p_cum, n)
    return float(min(1.0, max(0.0, 1.0 - max(0.0, gap))))


def optimal_acceptance_lp(target_probs, draft_probs, num_drafts: int, sampling: str) -> float:
    r"""Reference :math:`\alpha^*` by brute force: the transport LP over all ordered draft tuples.

    The transport problem :math:`\max_{\pi \in \Pi(Q, p)} \sum_{\bar x} \sum_{y \in \bar x} \pi(\bar x, y)`
    is solved in its equivalent max-flow form: variables :math:`\pi(\bar x, y) \ge 0` for every draft
    tuple :math:`\bar x` with :math:`Q(\bar x) > 0` and every token :math:`y` *in* the tuple, with
    :math:`\sum_y \pi(\bar x, y) \le Q(\bar x)` and :math:`\sum_{\bar x} \pi(\bar x, y) \le p(y)`.
    (Any coupling's accepted part is such a flow; any flow extends to a coupling by pairing the equal
    leftover masses arbitrarily, so the optima agree; the inequality form stays feasible under
    floating-point rounding of the marginals.) Solved by HiGHS
    (``scipy.optimize.linprog(method="highs")``). Only for small ``V ** n``.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    n = _validate.num_drafts(num_drafts)
    s = _validate.sampling(sampling)
    tuples, probs = draft_tuple_distribution(q, n, s)
    v = p.shape[0]
    rows, cols = [], []
    var = 0
    for i, tup in enumerate(tuples):
        for y in sorted(set(tup)):
            rows += [i, len(tuples) + y]
            cols += [var, var]
            var += 1
    if var > 5_000_000:
        raise QuickdraftError(f"LP too large: {var} variables")
    a_ub = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(tuples) + v, var))
    b_ub = np.concatenate([probs, p])
    res = optimize.linprog(-np.ones(var), A_ub=a_ub, b_ub=b_ub, bounds=(0, None), method="highs",
        options={"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10},
    )
    if res.status != 0:
        raise QuickdraftError(f"transport LP failed: {res.message}")
    return float(min(1.0, max(0.0, -res.fun)))


def draft_tuple_distribution(draft_probs, num_drafts: int, sampling: str) -> tuple[list[tuple[int, ...]], np.ndarray]:
    r"""All ordered draft tuples with positive probability and their probabilities (small ``V`` only).

    This is the definition of the three sampling schemes written out, used by the LP and the tests.
    """
    q = _validate.as_distribution(draft_probs, "draft_probs")
    n = _validate.num_drafts(num_drafts)
    s = _validate.sampling(sampling)
    v = q.shape[0]
    supp = [int(i) for i in np.flatnonzero(q > 0)]
    out: list[tuple[int, ...]] = []
    probs: list[float] = []
    if s == "with_replacement":
        for tup in itertools.product(supp, repeat=n):
            out.append(tup)
            probs.append(float(np.prod(q[list(tup)])))
    elif s == "without_replacement":
        k = min(n, len(supp))
        for tup in itertools.permutations(supp, k):
            pr, left = 1.0, q.copy()
            for x in tup:
                pr *= q[x] / left.sum()
                left[x] = 0.0
            out.append(tup)
            probs.append(pr)
    else:
        top = tuple(int(i) for i in _greedy_top(q, n))
        rest_mass = 1.0 - q[list(top)].sum() if top else 1.0
        rest = [x for x in supp if x not in top]
        if not rest or rest_mass <= 0:
            out.append(top)
            probs.append(1.0)
        else:
            for x in rest:
                out.append(top + (x,))
                probs.append(float(q[x] / rest_mass))
    del v
    arr = np.asarray(probs)
    return out, arr / arr.sum()


# ----------------------------------------------------------------------------------------------------
# Order and the three "all drafts in A" functions
# ----------------------------------------------------------------------------------------------------


def _ratio_order(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Token order by ``q/p`` decreasing (``p = 0 < q`` first, ``q = 0`` last).

    Ties may come in any order: the prefix theorem (``docs/theory.md``) holds for every order with
    non-increasing ``q/p``, so the faster unstable sort is used.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(p > 0, q / p, np.where(q > 0, np.inf, -1.0))
    return np.argsort(-ratio)


def _greedy_top(q: np.ndarray, n: int) -> np.ndarray:
    """The ``n - 1`` deterministic greedy drafts: top ``q``, ties towards the lower token id."""
    k = min(max(0, n - 1), q.shape[0])
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if k == q.shape[0]:
        return np.argsort(-q, kind="stable")
    thr = np.partition(q, q.shape[0] - k)[q.shape[0] - k]  # k-th largest value
    above = np.flatnonzero(q > thr)
    ties = np.flatnonzero(q == thr)[: k - above.size]  # lowest ids among ties
    top = np.concatenate([above, ties])
    return top[np.argsort(-q[top], kind="stable")]  # same as np.argsort(-q, kind="stable")[:k]


def _greedy_split(p: np.ndarray, q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, float, float]:
    """The greedy scheme's partition: the deterministic drafts ``G`` (:func:`_greedy_top`), the mask
    ``in_top`` of ``G``, the target mass :math:`p(G)` and the draft mass left for the sampled draft."""
    top = _greedy_top(q, n)
    in_top = np.zeros(q.shape[0], dtype=bool)
    in_top[top] = True
    return top, in_top, float(p[in_top].sum()), float(q[~in_top].sum())


def _alpha_greedy_dual(p: np.ndarray, q: np.ndarray, n: int) -> float:
    r"""Dual of the greedy scheme: :math:`1 - \max(0, \sum_{x \notin G} (q'(x) - p(x))^+ - p(G))`."""
    _, in_top, p_top, rest_mass = _greedy_split(p, q, n)
    if rest_mass <= 0:
        # no sampled draft: the drafts are exactly G, all in A iff G subset of A
        return float(min(1.0, p_top))
    q_rest = np.where(in_top, 0.0, q / rest_mass)
    gap = np.maximum(q_rest - p, 0.0)[~in_top].sum() - p_top
    return float(min(1.0, max(0.0, 1.0 - max(0.0, gap))))


def _wor_all_in(qs: np.ndarray, n: int) -> np.ndarray:
    r"""``[m]``: :math:`g_k = \Pr[\text{all drafts} \in A_k]`, ``k = 1..m``, without replacement.

    ``qs`` are the ``m`` positive draft probabilities in prefix order. Exact enumeration for small ``m``,
    else the quadrature of :mod:`quickdraft.theory._wor`.
    """
    m = qs.shape[0]
    if m <= n:  # the drafts are the whole support
        return (np.arange(1, m + 1) == m).astype(np.float64)
    if n == 1:
        return np.cumsum(qs)
    if math.perm(m, n) <= _EXACT_TUPLE_LIMIT:
        return _wor_exact(qs, n)
    return _wor.WorPrefixes(qs, n).all()


def _wor_max_gap(qs: np.ndarray, ps: np.ndarray, p_cum: np.ndarray, n: int) -> float:
    r""":math:`\max_{0 \le k \le m} (g_k - p(A_k))` without replacement (``p_cum``: ``[m+1]`` prefix target mass)."""
    m = qs.shape[0]
    if m > n and n > 1 and math.perm(m, n) > _EXACT_TUPLE_LIMIT:
        return _wor.WorPrefixes(qs, n).max_gap(ps)
    g = np.concatenate([[0.0], _wor_all_in(qs, n)])
    return float(np.max(g - p_cum))


def _wor_exact(qs: np.ndarray, n: int) -> np.ndarray:
    r"""Exact :math:`\Pr[D \subseteq A_k]` for every prefix by enumerating ordered tuples.

    ``g[k]`` is the probability that the largest prefix position among the drafts is ``<= k``.
    """
    m = qs.shape[0]
    tup = np.array(list(itertools.permutations(range(m), n)), dtype=np.int64)  # [T, n]
    vals = qs[tup]
    # mass left before each draw, summed over the tokens not drawn yet (not 1 - used: no cancellation)
    left = np.broadcast_to(qs, (tup.shape[0], m)).copy()
    rem = np.empty_like(vals)
    rows = np.arange(tup.shape[0])
    for i in range(n):
        rem[:, i] = left.sum(axis=1)
        left[rows, tup[:, i]] = 0.0
    prob = np.prod(vals / rem, axis=1)
    last = tup.max(axis=1)
    return np.cumsum(np.bincount(last, weights=prob, minlength=m))


# ----------------------------------------------------------------------------------------------------
# Verifiers
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GreedyPlan:
    r"""The optimal verifier for greedy drafts (Hu et al. 2025, §5), ready for a sampler.

    With :math:`G` the ``n - 1`` deterministic drafts and :math:`y \sim q'` the sampled draft:

    1. emit :math:`y` with probability ``accept_probs[y]`` :math:`= \min(1, p(y)/q'(y))`;
    2. otherwise emit a token drawn from ``residual_probs``
       :math:`\propto p \cdot 1_G + (p - q')^+ \cdot 1_{G^c}`.

    The emitted token has law :math:`p` exactly, and it is a draft with probability
    :math:`p(G) + \sum_{x \notin G} \min(p(x), q'(x)) = \alpha^*_{\text{greedy}}`.

    Attributes
    ----------
    top_ids:
        ``[n-1]`` int64 deterministic drafts :math:`G` (``np.argsort(-q, kind="stable")[: n-1]``).
    sample_probs:
        ``[V]`` :math:`q'`, the law of the sampled draft (zeros on :math:`G`); all zeros if there is no
        sampled draft.
    accept_probs:
        ``[V]`` acceptance probability of the sampled draft (0 where :math:`q' = 0`).
    residual_probs:
        ``[V]`` law of the token emitted after a rejection (all zeros if rejection is impossible).
    acceptance:
        The acceptance rate of this verifier, :math:`\alpha^*_{\text{greedy}}`.
    """

    top_ids: np.ndarray
    sample_probs: np.ndarray
    accept_probs: np.ndarray
    residual_probs: np.ndarray
    acceptance: float


def greedy_optimal_plan(target_probs, draft_probs, num_drafts: int) -> GreedyPlan:
    """Build the :class:`GreedyPlan` (optimal verifier for ``sampling="greedy"``)."""
    p, q = _validate.pair(target_probs, draft_probs)
    n = _validate.num_drafts(num_drafts)
    top, in_top, p_top, rest_mass = _greedy_split(p, q, n)
    top = top.astype(np.int64)
    if rest_mass <= 0:
        zeros = np.zeros_like(q)
        residual = np.where(in_top, p, 0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else zeros
        return GreedyPlan(top, zeros, zeros.copy(), residual, min(1.0, p_top))
    q_rest = np.where(in_top, 0.0, q / rest_mass)
    with np.errstate(divide="ignore", invalid="ignore"):
        accept = np.where(q_rest > 0, np.minimum(1.0, p / q_rest), 0.0)
    residual = np.where(in_top, p, np.maximum(p - q_rest, 0.0))
    mass = residual.sum()
    residual = residual / mass if mass > 0 else np.zeros_like(q)
    acceptance = p_top + float(np.minimum(p, q_rest)[~in_top].sum())
    return GreedyPlan(top, q_rest, accept, residual, float(min(1.0, acceptance)))


def kseq_rho(target_probs, draft_probs, num_drafts: int) -> float:
    r"""The K-SEQ division factor :math:`\rho \in [1, n]` of SpecTr (Sun et al. 2023, Alg. 2).

    :math:`\rho` is the smallest root in :math:`[1, n]` of

    .. math::

        h(\rho) = 1 - (1 - \beta(\rho))^n - \rho\, \beta(\rho), \qquad
        \beta(\rho) = \sum_x \min\bigl(q(x), p(x)/\rho\bigr).

    :math:`h` is non-increasing (:math:`\beta` decreases, :math:`\rho\beta = \sum_x \min(\rho q, p)`
    increases), :math:`h(1) = \mathrm{TV} - \mathrm{TV}^n \ge 0` and :math:`h(n) \le 0`, so the root is
    found by bisection to machine precision.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    n = _validate.num_drafts(num_drafts)
    return _kseq_rho(p, q, n)



def _kseq_rho(p: np.ndarray, q: np.ndarray, n: int, prof: RatioProfile | None = None) -> float:
    r"""Bisection for the smallest root of :math:`h`; :math:`\rho\beta(\rho) = 1 - f(\rho)` from the ratio profile.

    With :math:`f(\lambda) = \sum_x (p(x) - \lambda q(x))^+`, :math:`\rho \beta(\rho) = \sum_x \min(\rho q, p) = 1 - f(\rho)`,
    so each evaluation of :math:`h` is one binary search after one sort (``prof``, built if not given).
    """
    if n == 1:
        return 1.0
    prof = RatioProfile(p, q) if prof is None else prof

    def h(rho: float) -> float:
        rho_beta = 1.0 - prof.f(rho)
        return 1.0 - (1.0 - rho_beta / rho) ** n - rho_beta

    lo, hi = 1.0, float(n)
    if h(lo) <= 0.0:
        return lo
    if h(hi) > 0.0:  # cannot happen mathematically; guard against rounding
        return hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        if h(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return hi


def _kseq_rate(prof: RatioProfile, n: int) -> float:
    r"""K-SEQ acceptance :math:`1 - (1 - \beta(\rho))^n` with :math:`\beta(\rho) = (1 - f(\rho))/\rho`."""
    rho = _kseq_rho(None, None, n, prof)
    beta = (1.0 - prof.f(rho)) / rho
    return float(min(1.0, max(0.0, 1.0 - (1.0 - beta) ** n)))


def _rrs_wr_reject_all(prof: RatioProfile, n: int) -> float:
    r"""Probability that RRS with i.i.d. drafts rejects all ``n``: :math:`f(\lambda_{n+1})`.

    Every residual is :math:`p_i = (p - \lambda_i q)^+ / f(\lambda_i)` with :math:`\lambda_1 = 0`,
    :math:`\lambda_{i+1} = \lambda_i + f(\lambda_i)` (``docs/theory.md`` §5), and
    :math:`\mathrm{TV}(p_i, q) = f(\lambda_{i+1}) / f(\lambda_i)`, so the product telescopes.
    """
    lam, fl = 0.0, 1.0
    for _ in range(n):
        if fl <= 0.0:
            return 0.0
        lam = lam + fl
        fl = prof.f(lam)
    return float(min(1.0, max(0.0, fl)))


def _greedy_optimal_rate(p: np.ndarray, q: np.ndarray, n: int) -> float:
    r"""Rate of the optimal greedy verifier, :math:`p(G) + \sum_{x \notin G} \min(p(x), q'(x))` (no plan arrays)."""
    _, in_top, p_top, rest_mass = _greedy_split(p, q, n)
    if rest_mass <= 0:
        return float(min(1.0, p_top))
    rate = p_top + float(np.minimum(p[~in_top], q[~in_top] / rest_mass).sum())
    return float(min(1.0, max(0.0, rate)))


def verifier_acceptance(target_probs, draft_probs, num_drafts: int, sampling: str, verifier: str) -> float:
    r"""Exact acceptance rate of a multi-draft verifier (probability that a draft is accepted).

    Verifiers and the sampling schemes they accept:

    ``"rrs"`` with ``"with_replacement"`` (SpecInfer, Miao et al. 2024)
        Drafts i.i.d. from :math:`q`; :math:`p_1 = p`; for :math:`i = 1..n` accept :math:`x_i` with
        probability :math:`\min(1, p_i(x_i)/q(x_i))`, on rejection
        :math:`p_{i+1} = \mathrm{norm}((p_i - q)^+)`; if all are rejected emit a sample of
        :math:`p_{n+1}`. The residuals do not depend on which token was rejected, so the rate is
        :math:`1 - \prod_{i=1}^n \mathrm{TV}(p_i, q) = 1 - f(\lambda_{n+1})` with
        :math:`f(\lambda) = \sum_x (p - \lambda q)^+`, :math:`\lambda_{i+1} = \lambda_i + f(\lambda_i)`
        (``docs/theory.md`` §5): one sort and ``n`` binary searches.
    ``"rrs"`` with ``"without_replacement"``
        Drafts drawn sequentially without replacement; at step :math:`i` the proposal is
        :math:`q_i` = :math:`q` without the earlier drafts, renormalised; accept :math:`x_i` with
        :math:`\min(1, p_i(x_i)/q_i(x_i))`, on rejection :math:`p_{i+1} = \mathrm{norm}((p_i - q_i)^+)`.
        Exact recursion over the ordered draft prefixes when ``V ** n <= 2e6``. Beyond that the rate is
        taken from the certified interval of
        :func:`quickdraft.theory.rrs_wor.rrs_without_replacement_interval` (512 expansions) if the
        interval is at most :data:`RRS_WOR_TOL` wide; otherwise a :class:`QuickdraftError` states the
        interval (use that function directly to get bounds). Never a silent approximation.
    ``"kseq"`` with ``"with_replacement"`` (SpecTr K-SEQ, Sun et al. 2023)
        Accept :math:`x_i` with :math:`\min(1, p(x_i)/(\rho q(x_i)))`, the first accepted draft is
        emitted; if all are rejected emit from :math:`\mathrm{norm}((p - \rho q)^+)` (the residual that
        makes the output law exactly :math:`p`, see ``docs/theory.md``). Rate
        :math:`1 - (1 - \beta(\rho))^n = \rho \beta(\rho)` with :math:`\rho` = :func:`kseq_rho`.
    ``"rrs"`` with ``"greedy"`` (the convention of :func:`quickdraft.verification.multidraft.sample_step`)
        The ``n - 1`` deterministic drafts :math:`G = (g_1, \dots, g_{n-1})` (decreasing ``q``) are draws
        from point masses :math:`\delta_{g_i}`, so RRS accepts :math:`g_i` with probability
        :math:`p_i(g_i)` and a rejection removes :math:`g_i` from :math:`p_i` (renormalised). The
        probability that all of them are rejected telescopes to :math:`1 - p(G)`, after which
        :math:`p_n = p|_{G^c} / (1 - p(G))` is tested against the sampled draft's law :math:`q'`:

        .. math::

            \alpha_{\text{rrs,greedy}} = p(G) + \sum_{x \notin G} \min\bigl(p(x), (1 - p(G))\, q'(x)\bigr)
            \;\le\; \alpha^*_{\text{greedy}}.

        If :math:`q(G^c) = 0` there is no sampled draft and the rate is :math:`p(G)`.
    ``"optimal_greedy"`` with ``"greedy"`` (Hu et al. 2025, §5)
        The plan of :func:`greedy_optimal_plan`; rate :math:`p(G) + \sum_{x \notin G}\min(p, q')`.

    "Accepted" means: one of the drafts passed the verifier's test (for ``"optimal_greedy"``: the
    emitted token is a draft, which includes a residual sample that lands in :math:`G`). For RRS the
    two notions coincide, because a rejected draft :math:`x_i` has :math:`p_i(x_i) < q_i(x_i)` and so
    zero mass in every later residual; for K-SEQ the residual may by chance emit a rejected draft id,
    which is *not* counted.

    Raises
    ------
    QuickdraftError
        For a verifier/sampling pair not listed above.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    n = _validate.num_drafts(num_drafts)
    s = _validate.sampling(sampling)
    ver = _validate.verifier(verifier)
    allowed = {
        "rrs": ("with_replacement", "without_replacement", "greedy"),
        "kseq": ("with_replacement",),
        "optimal_greedy": ("greedy",),
    }
    if s not in allowed[ver]:
        raise QuickdraftError(f"verifier {ver!r} is not defined for sampling {s!r} (use {', '.join(allowed[ver])})")
    if ver == "kseq":
        return _kseq_rate(RatioProfile(p, q), n)
    if ver == "optimal_greedy":
        return _greedy_optimal_rate(p, q, n)
    if s == "greedy":
        return _rrs_greedy_rate(p, q, n)
    if s == "with_replacement":
        return float(min(1.0, max(0.0, 1.0 - _rrs_wr_reject_all(RatioProfile(p, q), n))))
    return _rrs_wor_rate(p, q, n)


def _rrs_greedy_rate(p: np.ndarray, q: np.ndarray, n: int) -> float:
    """RRS over greedy drafts, top tokens as point masses (see :func:`verifier_acceptance`)."""
    _, in_top, p_top, rest_mass = _greedy_split(p, q, n)
    if rest_mass <= 0:
        return float(min(1.0, p_top))
    q_rest = q[~in_top] / rest_mass
    rate = p_top + float(np.minimum(p[~in_top], max(0.0, 1.0 - p_top) * q_rest).sum())
    return float(min(1.0, max(0.0, rate)))


def _rrs_wor_reject(p: np.ndarray, q: np.ndarray, n: int) -> float:
    """Probability that RRS without replacement rejects every draft (recursion over draft prefixes)."""
    v = p.shape[0]
    if v ** min(n, v) > 2_000_000:
        raise QuickdraftError(f"exact RRS without replacement needs V**n <= 2e6 states, got V={v}, n={n}")

    def rec(cur: np.ndarray, removed: np.ndarray, depth: int) -> float:
        if depth == n:
            return 1.0
        q_i = np.where(removed, 0.0, q)
        mass = q_i.sum()
        if mass <= 0:
            return 1.0  # support exhausted: no more drafts, the rest is a residual sample
        q_i = q_i / mass
        resid = np.maximum(cur - q_i, 0.0)
        tv = resid.sum()
        if tv <= 0:
            return 0.0
        nxt = resid / tv
        with np.errstate(divide="ignore", invalid="ignore"):
            rej = np.where(q_i > 0, 1.0 - np.minimum(1.0, cur / q_i), 0.0)
        total = 0.0
        for x in np.flatnonzero(q_i * rej > 0):
            removed2 = removed.copy()
            removed2[x] = True
            total += q_i[x] * rej[x] * rec(nxt, removed2, depth + 1)
        return total

    return rec(p, np.zeros(v, dtype=bool), 0)


#: ``verifier_acceptance(..., "without_replacement", "rrs")`` runs the exact recursion up to this many
#: ``V ** n`` states; above it the certified interval of :mod:`quickdraft.theory.rrs_wor` is used.
_RRS_WOR_EXACT_STATES = 2_000_000
#: Above the recursion limit the interval must be at most this wide to be returned as "the" rate.
RRS_WOR_TOL = 1e-9


def _rrs_wor_rate(p: np.ndarray, q: np.ndarray, n: int) -> float:
    """RRS without replacement: the exact recursion for small ``V ** n``, else a certified interval of width <= RRS_WOR_TOL."""
    v = p.shape[0]
    if v ** min(n, v) <= _RRS_WOR_EXACT_STATES:
        return float(min(1.0, max(0.0, 1.0 - _rrs_wor_reject(p, q, n))))
    from quickdraft.theory.rrs_wor import rrs_without_replacement_interval

    iv = rrs_without_replacement_interval(p, q, n, max_expansions=512, max_children=16)
    lo, hi = float(iv.lower[n - 1]), float(iv.upper[n - 1])
    if hi - lo > RRS_WOR_TOL:
        raise QuickdraftError(
            f"RRS without replacement at V={v}, n={n}: the certified interval after {iv.expansions} tree expansions is "
            f"[{lo:.12f}, {hi:.12f}] (width {hi - lo:.2e} > {RRS_WOR_TOL:g}); use "
            "quickdraft.theory.rrs_wor.rrs_without_replacement_interval with a larger budget to get bounds"
        )
    return 0.5 * (lo + hi)
