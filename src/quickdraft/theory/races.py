r"""Exponential-race speculative decoding (ERSD, Kobus & Gündüz 2025): exact acceptance rates.

Draft and target share the randomness :math:`E_v \sim \mathrm{Exp}(1)` i.i.d. over the vocabulary.
The target's token is the winner of the race with arrival times :math:`E_v / p(v)`,
:math:`Y = \arg\min_v E_v/p(v) \sim p`; the draft's token is :math:`X = \arg\min_v E_v/q(v) \sim q`
(the Gumbel-max trick in exponential form). With ``n`` candidates the draft proposes its ``n``
earliest arrivals; a position is *accepted* when the target's winner is among them.

Closed form for one candidate (derived in ``docs/theory.md``):

.. math::

    \Pr[X = Y] = \sum_{v:\, p(v) q(v) > 0}
        \frac{p(v)\, q(v)}{\sum_u \max\bigl(p(u) q(v),\ q(u) p(v)\bigr)},

computed in :math:`O(V \log V)` by sorting on :math:`p/q`. It is at most :math:`1 - \mathrm{TV}(p, q)`
(the maximal coupling) and equals 1 iff :math:`p = q`.

With ``n`` candidates, for each :math:`v`, conditioning on :math:`E_v = e`:

.. math::

    \Pr[Y = v,\ v \in \text{draft top-}n] = \int_0^\infty e^{-e / p(v)}\,
        \Pr\bigl[N_v(e) \le n - 1\bigr]\, de,
    \qquad N_v(e) = \sum_{u:\, q(u)/q(v) > p(u)/p(v)} \mathrm{Bern}\bigl(1 - e^{-e\, d_u}\bigr),

with :math:`d_u = q(u)/q(v) - p(u)/p(v)`: a token :math:`u` beats :math:`v` in the draft race while
losing to it in the target race. Small vocabularies use the exact inclusion–exclusion sum; larger ones
a log-time trapezoidal rule (absolute error below ``1e-10`` in the tests) at cost :math:`O(V^2 n)` per
node, so ``V <= 4096``.

References
----------
.. [1] S. Kobus, D. Gündüz. "Speculative Sampling via Exponential Races", Findings of ACL 2025,
   arXiv:2504.15475.
.. [2] C. T. Li, V. Anantharam. "A Unified Framework for One-Shot Achievability via the Poisson Matching
   Lemma", IEEE Trans. Inf. Theory 2021 (exponential races / Poisson functional representation).
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from quickdraft.errors import QuickdraftError
from quickdraft.theory import _validate
from quickdraft.theory.chain import speedup as _chain_speedup

_EXACT_MAX_BEATERS = 10
_LOG_STEP = 0.25
_MAX_V_QUAD = 4096


def race_acceptance(target_probs, draft_probs, num_candidates: int = 1) -> float:
    r"""Probability that the target's race winner is among the draft's ``num_candidates`` earliest arrivals.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` distributions :math:`p` (target) and :math:`q` (draft).
    num_candidates:
        ``n >= 1``. ``n = 1`` is the closed form (any ``V``); ``n >= 2`` needs ``V <= 4096``.

    Returns
    -------
    float
        The acceptance probability in [0, 1].

    Examples
    --------
    >>> round(race_acceptance([0.5, 0.5], [0.5, 0.5]), 12)
    1.0
    """
    p, q = _validate.pair(target_probs, draft_probs)
    n = _validate.num_drafts(num_candidates, "num_candidates")
    if n == 1:
        return _race_one(p, q)
    return _race_many(p, q, n)


def _race_one(p: np.ndarray, q: np.ndarray) -> float:
    # denominator(v) = q(v) * sum_{u: r_u >= r_v} p(u) + p(v) * sum_{u: r_u < r_v} q(u),  r = p/q
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(q > 0, p / q, np.where(p > 0, np.inf, 0.0))
    order = np.argsort(ratio, kind="stable")
    r_sorted = ratio[order]
    p_sorted, q_sorted = p[order], q[order]
    q_below = np.concatenate([[0.0], np.cumsum(q_sorted)])  # q mass of the first i tokens
    p_total_suffix = np.concatenate([np.cumsum(p_sorted[::-1])[::-1], [0.0]])
    # for ties r_u == r_v both terms agree, so the split point within a tie block does not matter
    first = np.searchsorted(r_sorted, r_sorted, side="left")
    denom = q_sorted * p_total_suffix[first] + p_sorted * q_below[first]
    num = p_sorted * q_sorted
    ok = num > 0
    return float(min(1.0, (num[ok] / denom[ok]).sum()))


def _race_many(p: np.ndarray, q: np.ndarray, n: int) -> float:
    v_all = np.flatnonzero((p > 0) & (q > 0))
    total = 0.0
    exact = []
    quad = []
    for v in v_all:
        a = p / p[v]
        b = q / q[v]
        d = b - a
        beaters = np.flatnonzero(d > 0)
        if beaters.size <= n - 1:
            total += p[v]  # v is always in the top n of the draft when it wins the target race
        elif beaters.size <= _EXACT_MAX_BEATERS:
            exact.append((v, d[beaters]))
        else:
            quad.append(v)
    for v, d in exact:
        total += _race_exact_one(p[v], d, n)
    if quad:
        if p.shape[0] > _MAX_V_QUAD:
            raise QuickdraftError(f"race_acceptance with num_candidates={n} supports V <= {_MAX_V_QUAD}, got {p.shape[0]}")
        total += _race_quadrature(p, q, np.asarray(quad), n)
    return float(min(1.0, max(0.0, total)))


def _race_exact_one(p_v: float, d: np.ndarray, n: int) -> float:
    r"""Inclusion–exclusion: :math:`\int_0^\infty e^{-e/p_v} \sum_{|S| \le n-1} \prod_{u \in S}(e^{e d_u} - 1) \prod_{u \notin S} 1\, de`.

    Written as probability: :math:`\Pr[N \le n-1]` with ``N`` a sum of Bernoulli(1 - e^{-e d_u}); each
    term expands to :math:`\sum_{T \subseteq S} (-1)^{|S \setminus T|} / (1/p_v - d(T) - \dots)`.
    """
    # Pr[N <= n-1] * e^{-e/p_v} = e^{-e/p_v} sum_{|S|<=n-1} prod_{S} (1-e^{-e d}) prod_{S^c} e^{-e d}
    m = d.shape[0]
    total = 0.0
    base = 1.0 / p_v
    dsum = d.sum()
    for size in range(n):
        for s in itertools.combinations(range(m), size):
            s = list(s)
            rest = dsum - d[s].sum()
            # prod_{u in S} (1 - e^{-e d_u}) = sum_{T subset S} (-1)^{|T|} e^{-e d(T)}
            for tsize in range(len(s) + 1):
                for t in itertools.combinations(s, tsize):
                    total += (-1) ** tsize / (base + rest + d[list(t)].sum())
    return total


def _race_quadrature(p: np.ndarray, q: np.ndarray, vs: np.ndarray, n: int) -> float:
    r"""Sum over ``vs`` of :math:`p_v (1 - \int_0^\infty e^{-s}\Pr[N_v(p_v s) \ge n]\, ds)` by log-trapezoid."""
    pv = p[vs][:, None]
    d = q[None, :] / q[vs][:, None] - p[None, :] / pv  # [|vs|, V]
    rates = np.where(d > 0, d, 0.0) * pv  # clock rates in the s = e / p_v time scale
    rate_sum = rates.sum(axis=1)
    s_lo = (1e-18 * math.factorial(n)) ** (1.0 / (n + 1)) / max(1.0, float(rate_sum.max()))
    ys = np.arange(math.log(s_lo), math.log(60.0), _LOG_STEP)
    acc = np.zeros(vs.shape[0])
    for y in ys:
        s = math.exp(y)
        at_least = 1.0 - _rows_prob_fewer_than(rates * s, n)
        acc += s * math.exp(-s) * at_least
    integral = _LOG_STEP * acc
    return float((pv[:, 0] * (1.0 - integral)).sum())


def _rows_prob_fewer_than(x: np.ndarray, n: int, sure: float = 36.0) -> np.ndarray:
    r"""``[R]``: :math:`\Pr[\sum_u \mathrm{Bern}(1 - e^{-x_{ru}}) \le n-1]` for each row ``r`` of ``x``."""
    is_sure = x > sure
    n_sure = is_sure.sum(axis=1)
    xs = np.where(is_sure, 0.0, x)
    r = np.expm1(xs)
    log_d0 = -xs.sum(axis=1)
    rows, cols = x.shape
    total = np.ones(rows)
    e_prev = np.ones((rows, cols))  # e_{j-1} of the prefix before each column
    for j in range(1, n):
        shifted = np.zeros((rows, cols))
        if j == 1:
            shifted[:] = 1.0
        else:
            shifted[:, 1:] = e_prev[:, :-1]
        e_j = np.cumsum(r * shifted, axis=1)
        total += np.where(n_sure <= n - 1 - j, e_j[:, -1], 0.0)
        e_prev = e_j
    with np.errstate(under="ignore", over="ignore", invalid="ignore"):
        val = np.exp(log_d0) * total
    val = np.where(np.isfinite(val) & (n_sure <= n - 1), val, 0.0)
    return np.clip(val, 0.0, 1.0)


def race_expected_tokens(acceptances) -> float:
    r"""Expected tokens per target call of a race chain or race tree, given per-depth acceptance.

    Along the target's path the shared races make depth :math:`i` accepted with probability
    :math:`\alpha_i` (``race_acceptance`` of that depth's distributions, with the tree's number of
    candidates per depth), independently of earlier depths given they were accepted, so

    .. math:: \mathbb{E}[\text{tokens}] = \sum_{i=0}^{k} \prod_{j=1}^{i} \alpha_j

    (accepted tokens plus the one recovered-or-bonus token). ``acceptances`` is a sequence
    :math:`(\alpha_1, \dots, \alpha_k)`; for a stationary :math:`\alpha` this is
    :math:`(1-\alpha^{k+1})/(1-\alpha)`.
    """
    alphas = [_validate.probability(a, "acceptance") for a in np.atleast_1d(np.asarray(acceptances, dtype=float))]
    total, run = 1.0, 1.0
    for a in alphas:
        run *= a
        total += run
    return float(total)


def race_tree_size(num_candidates: int, depth: int) -> int:
    r"""Drafted tokens of the full race tree with ``n`` candidates per node and ``depth`` levels: :math:`\sum_{i=1}^{d} n^i`."""
    n = _validate.num_drafts(num_candidates, "num_candidates")
    if isinstance(depth, bool) or not isinstance(depth, (int, np.integer)) or depth < 0:
        raise QuickdraftError(f"depth must be an integer >= 0, got {depth!r}")
    return int(sum(n**i for i in range(1, depth + 1)))


def race_tree_speedup(alpha: float, num_candidates: int, depth: int, cost_ratio: float) -> tuple[int, float]:
    r"""Drafted tokens ``k`` and speed-up of a full race tree (stationary per-depth acceptance ``alpha``).

    Speed-up :math:`S = \mathbb{E}[\text{tokens}] / (1 + k c)` with the draft forwards counted per drafted
    token (an upper bound on the draft cost of a tree drafted level by level is ``depth``; pass
    ``cost_ratio`` accordingly). Large-``k`` relation (``docs/theory.md``): since
    :math:`\mathbb{E}[\text{tokens}] \le d + 1` and :math:`k \ge n^d`,
    :math:`\mathbb{E}[\text{tokens}] \le 1 + \log_n k`, so :math:`S(k) = O(\log k / (c\,k))`.
    """
    k = race_tree_size(num_candidates, depth)
    tokens = race_expected_tokens([alpha] * depth)
    c = float(cost_ratio)
    if not np.isfinite(c) or c < 0:
        raise QuickdraftError(f"cost_ratio must be a finite number >= 0, got {cost_ratio!r}")
    return k, tokens / (1.0 + k * c)


def race_chain_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Speed-up of a race chain of length ``k``: the chain formula with ``alpha = race_acceptance(p, q)``."""
    return _chain_speedup(alpha, k, cost_ratio)
