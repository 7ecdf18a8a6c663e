r"""Exponential-race speculative decoding (ERSD) as channel simulation: rank law, token bounds, optimal trees.

Setting and terms
-----------------
Target ``p`` (``target_probs``) and draft ``q`` (``draft_probs``) race with shared arrivals
:math:`E_v \sim \mathrm{Exp}(1)` (:mod:`quickdraft.verification.race`): the target's token is
:math:`Y = \arg\min_v E_v / p(v)`, and the draft ranks every token by :math:`E_v / q(v)`. The *rank*
:math:`R \in \{1, \dots, V\} \cup \{\infty\}` is the position of :math:`Y` in the draft's order
(:math:`\infty` when :math:`q(Y) = 0`: the draft never proposes it). A race tree drafts, at each node,
children by rank: child ``j`` of a node is the draft's ``j + 1``-th earliest arrival, so a tree is a list
of rank paths like Medusa's ``[[0], [0, 0], [1]]`` (0-based ranks). The target's path is accepted down
to the first depth whose rank is not a child of the current node; one more token (recovered or bonus)
is emitted there. *Tokens per call* :math:`T` counts the accepted tokens plus that one.

With the same ``(p, q)`` at every position and independent arrivals across positions (the
*stationary model*; the race keys differ per position), the ranks :math:`R_1, R_2, \dots` along the
target's path are i.i.d. with law :math:`\pi(r) = \Pr[R = r]`, and for a tree with ``k`` nodes

.. math:: \mathbb{E}[T] = 1 + \sum_{u \in \text{tree}} \prod_{i=1}^{|u|} \pi(u_i + 1).     \qquad (1)

A chain of length ``k`` is ``[[0], [0, 0], ...]`` (:math:`\sum_{i \le k} \pi(1)^i`), ``k`` candidates in
one step are ``[[0], [1], ..., [k-1]]`` (:math:`1 + \Pr[R \le k]`).

Bounds
------
Kobus & Gündüz [1] state the upper bound in the form (2) and a lower bound through
:math:`D(p \| q)`. We could retrieve only the paper's abstract and a summary of it, not its theorem
text or equation numbers, so (2) and (3) below are our own formulations with our own proofs
(``docs/theory.md`` §9).

*Upper bound (entropy).* For every tree with ``k`` nodes, in the stationary model,

.. math:: \mathbb{E}[T] \le \frac{\log V + \log(k + 1)}{H[R]}.     \qquad (2)

Proof: the accepted ranks plus the first rejected rank form a word of a complete prefix-free parse of
the i.i.d. rank sequence (walk down the tree until the next rank is not a child); its length is
:math:`T`, a stopping time, so the chain rule gives :math:`H(\text{word}) = \mathbb{E}[T]\, H[R]`, and
there are at most :math:`(k + 1) V` words (a node, then one of at most ``V`` rank outcomes).

*Lower bound (Kullback–Leibler).* Channel-simulation view: the rank is the message an encoder who knows
``p`` sends to a decoder who knows ``q`` and the shared arrivals (the Poisson functional representation
of Li & El Gamal [2]; their index over a Poisson process of draft samples is at least our ``R``). We
prove directly

.. math::

    \mathbb{E}[\log R] \le \sum_v p(v) \log\Bigl(1 + \frac{p(v)}{q(v)}\Bigr)
        \le D(p \,\|\, q) + \log 2,     \qquad (3)

hence, by Markov's inequality on :math:`\log R`, the ``n``-candidate acceptance
:math:`\alpha_n = \Pr[R \le n] \ge 1 - (D(p\|q) + \log 2) / \log(n + 1)`, and the best tree with ``k`` nodes
has :math:`\mathbb{E}[T] \ge \max_{n, d:\ n + \dots + n^d \le k} \sum_{i=0}^{d} \alpha_n^i`, each
:math:`\alpha_n` replaced by that lower bound in :func:`ersd_kl_lower_bound`.

*Optimal tree.* By (1) (and its per-node generalisation, :func:`optimal_draft_tree`) a tree's value is
the sum of its nodes' reach probabilities, and a child never has more than its parent; so the ``k``
nodes of largest reach probability form a tree, and best-first expansion with a heap finds them — Tunstall's
construction of a variable-to-fixed code, with the drafted tree as the dictionary.

Logarithms are natural (the ratio in (2) does not depend on the base).

References
----------
.. [1] S. Kobus, D. Gündüz. "Speculative Sampling via Exponential Races", Findings of ACL 2025,
   arXiv:2504.15475 (channel simulation view, the bound :math:`(\log|\Omega| + \log(k+1))/H[R]`, an
   :math:`O(k \log k)` optimal drafting tree related to Tunstall coding).
.. [2] C. T. Li, A. El Gamal. "Strong Functional Representation Lemma and Applications to Coding
   Theorems", IEEE Trans. Inf. Theory 64(11), 2018 (Poisson functional representation: the selected
   index :math:`K` has :math:`\mathbb{E}[\log K] \le D(P\|Q)` plus a constant).
.. [3] B. P. Tunstall. "Synthesis of Noiseless Compression Codes", PhD thesis, Georgia Tech, 1967.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from quickdraft.errors import QuickdraftError
from quickdraft.theory import _validate

#: Largest vocabulary for :func:`race_rank_distribution` (cost :math:`O(V^3)` per quadrature node).
MAX_V_RANK = 256
_LOG_STEP = 0.25
_S_LO = 1e-14
_S_HI = 60.0
#: Relative difference of p(u)/p(v) and q(u)/q(v) below which the two are a tie.
_TIE_TOL = 1e-12
#: Entropies below this many nats are rounding of a point mass and are returned as 0.
_ENTROPY_TOL = 1e-12
#: Tolerance on conditional child distributions summing to at most 1.
_SUM_TOL = 1e-9


# ----------------------------------------------------------------------------------------------------
# The rank of the target's token in the draft's race
# ----------------------------------------------------------------------------------------------------


def race_rank_distribution(target_probs, draft_probs) -> np.ndarray:
    r"""Law of the rank of the target's race winner in the draft's race.

    .. math::

        \Pr[Y = v,\ R = r] = \int_0^\infty e^{-e / p(v)}\, \Pr[N_v(e) = r - 1]\, de,
        \qquad N_v(e) = \sum_{u} \mathrm{Bern}\bigl(1 - e^{-e\, d_u}\bigr),\quad
        d_u = \Bigl(\frac{q(u)}{q(v)} - \frac{p(u)}{p(v)}\Bigr)^+

    (``docs/theory.md`` §7: given :math:`E_v = e` and that ``v`` wins the target race, each ``u`` beats ``v``
    in the draft race independently). The Poisson-binomial law of :math:`N_v` is computed by recursion at
    every node of a trapezoidal rule in :math:`\log e` (step 0.25, geometric convergence; checked against
    exact inclusion–exclusion to 1e-12 in the tests), then each token's row is scaled to sum to
    :math:`p(v)`. Cost :math:`O(V^3)` per node, about 150 nodes: milliseconds at ``V = 64``, seconds at 256.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` distributions, ``V <= 256``.

    Returns
    -------
    numpy.ndarray
        ``[V]``: entry ``r - 1`` is :math:`\Pr[R = r]`. The entries sum to :math:`1 - p(\{q = 0\})`; the
        rest is :math:`\Pr[R = \infty]` (the target's token is one the draft never proposes).

    Examples
    --------
    >>> race_rank_distribution([0.5, 0.5], [0.5, 0.5]).round(12).tolist()
    [1.0, 0.0]
    """
    p, q = _validate.pair(target_probs, draft_probs)
    v_count = p.shape[0]
    if v_count > MAX_V_RANK:
        raise QuickdraftError(f"race_rank_distribution supports V <= {MAX_V_RANK}, got {v_count}")
    out = np.zeros(v_count)
    vs = np.flatnonzero((p > 0) & (q > 0))
    if vs.size == 0:
        return out
    pv = p[vs][:, None]  # [M, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        q_ratio = q[None, :] / q[vs][:, None]  # [M, V]
        d = q_ratio - p[None, :] / pv  # [M, V]
    # equal ratios are ties (no clock); rounding in the two quotients is not a beater
    rates = np.where(d > _TIE_TOL * q_ratio, d, 0.0) * pv  # [M, V] clock rates in the time scale s = e / p(v)
    n_beat = int((rates > 0).sum(axis=1).max())
    ys = np.arange(math.log(_S_LO / max(1.0, float(rates.sum(axis=1).max()))), math.log(_S_HI), _LOG_STEP)
    acc = np.zeros((vs.size, n_beat + 1))  # [M, ranks]
    for y in ys:
        s = math.exp(y)
        acc += (s * math.exp(-s)) * _poisson_binomial(-np.expm1(-rates * s), n_beat)
    # [M, ranks]: Pr[Y = v, R = r]; each row sums to p(v) up to the quadrature error (< 1e-13), made exact
    joint = acc * (pv / acc.sum(axis=1, keepdims=True))
    out[: n_beat + 1] = joint.sum(axis=0)
    return np.clip(out, 0.0, 1.0)


def _poisson_binomial(b: np.ndarray, max_count: int) -> np.ndarray:
    """``[M, max_count + 1]`` pmf of the number of successes of independent Bernoulli(``b[m, :]``)."""
    pmf = np.zeros((b.shape[0], max_count + 1))
    pmf[:, 0] = 1.0
    for u in np.flatnonzero((b > 0).any(axis=0)):
        bu = b[:, u : u + 1]  # [M, 1]
        pmf[:, 1:] = pmf[:, 1:] * (1.0 - bu) + pmf[:, :-1] * bu
        pmf[:, 0] *= 1.0 - bu[:, 0]
    return pmf


def race_rank_entropy(target_probs, draft_probs) -> float:
    r"""Entropy :math:`H[R]` of the rank (nats), counting :math:`R = \infty` as one outcome.

    Zero iff the draft's winner is always the target's (:math:`p = q`, or both point masses on one token);
    values below 1e-12 nats are rounding and returned as 0.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    return _entropy(_rank_with_never(p, q))


def _rank_with_never(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``[V + 1]``: the rank law with :math:`\\Pr[R = \\infty]` appended."""
    pmf = race_rank_distribution(p, q)
    return np.append(pmf, p[q == 0].sum())


def _entropy(pmf: np.ndarray) -> float:
    nz = pmf[pmf > 0]
    h = float(-(nz * np.log(nz)).sum())
    return h if h > _ENTROPY_TOL else 0.0


def race_log_rank_bound(target_probs, draft_probs) -> float:
    r"""Upper bound on :math:`\mathbb{E}[\log R]`: :math:`D(p \,\|\, q) + \log 2` (nats), eq. (3).

    Proof: given :math:`Y = v` the time :math:`E_v` is exponential with mean :math:`p(v)` and each ``u``
    beats ``v`` in the draft race with probability :math:`1 - e^{-E_v d_u} \le E_v d_u`, so
    :math:`\mathbb{E}[R \mid Y = v] \le 1 + p(v) \sum_u d_u \le 1 + p(v)/q(v)`. Jensen's inequality gives
    :math:`\mathbb{E}[\log R] \le \sum_v p(v) \log(1 + p(v)/q(v)) = D(p\|q) + \sum_v p(v) \log(1 + q(v)/p(v))`,
    and the last sum is at most :math:`\log(1 + q(\mathrm{supp}\, p)) \le \log 2`. The same form (with a
    larger constant) holds for the index of the Poisson functional representation (Li & El Gamal 2018), which
    is at least ``R`` when the races are coupled. ``inf`` if ``p`` puts mass where ``q`` has none.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    return _kl(p, q) + math.log(2.0)


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    on = p > 0
    if (q[on] == 0).any():
        return math.inf
    return float(max(0.0, (p[on] * np.log(p[on] / q[on])).sum()))


# ----------------------------------------------------------------------------------------------------
# Expected tokens per call and its bounds (stationary model)
# ----------------------------------------------------------------------------------------------------


def ersd_expected_tokens(target_probs, draft_probs, tree: Sequence[Sequence[int]]) -> float:
    r"""Exact expected tokens per target call of a race tree in the stationary model, eq. (1).

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` distributions (the same at every position), ``V <= 256``.
    tree:
        Rank paths, 0-based (``[[0], [0, 0], [1]]``: the draft's winner, its winner, the runner-up).
        Every prefix of a path must be in the list.

    Returns
    -------
    float
        :math:`\mathbb{E}[T]` = expected accepted tokens + 1 (the recovered or bonus token).

    Examples
    --------
    A chain of length 2 and two candidates in one step, with :math:`\Pr[R = 1] = \alpha`:

    >>> p, q = [0.6, 0.3, 0.1], [0.3, 0.4, 0.3]
    >>> alpha = race_rank_distribution(p, q)[0]
    >>> bool(abs(ersd_expected_tokens(p, q, [[0], [0, 0]]) - (1 + alpha + alpha**2)) < 1e-12)
    True
    """
    pmf = race_rank_distribution(target_probs, draft_probs)
    return draft_tree_expected_tokens(pmf, tree)


def ersd_upper_bound(target_probs, draft_probs, num_drafted: int) -> float:
    r"""Upper bound (2) on the expected tokens per call of *every* race tree with ``k`` drafted tokens.

    .. math:: \mathbb{E}[T] \le \frac{\log V + \log(k + 1)}{H[R]}

    (Kobus & Gündüz 2025, the bound :math:`(\log|\Omega| + \log(k+1))/H[R]`; proof in the module
    docstring and ``docs/theory.md`` §9.2, stationary model). ``inf`` when :math:`H[R] = 0`. The trivial
    bound :math:`k + 1` is not folded in.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    k = _count(num_drafted, "num_drafted", minimum=0)
    h = race_rank_entropy(p, q)
    if h <= 0.0:
        return math.inf
    return (math.log(p.shape[0]) + math.log(k + 1)) / h


def ersd_kl_lower_bound(target_probs, draft_probs, num_drafted: int) -> float:
    r"""Lower bound on the expected tokens per call of the *best* race tree with ``k`` drafted tokens.

    .. math::

        \max_{n \ge 1,\ d \ge 0:\ \sum_{i=1}^{d} n^i \le k}\ \sum_{i=0}^{d} a_n^i,
        \qquad a_n = \Bigl(1 - \frac{D(p\|q) + \log 2}{\log(n + 1)}\Bigr)^+ \le \alpha_n

    (full ``n``-ary rank trees of depth ``d``, whose value is :math:`\sum_i \alpha_n^i`; :math:`a_n` from
    eq. (3) and Markov's inequality). 1 when :math:`D(p\|q) = \infty` or ``k = 0``.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    k = _count(num_drafted, "num_drafted", minimum=0)
    bound = race_log_rank_bound(p, q)
    best = 1.0
    for n in range(2, k + 1):  # n = 1 gives a_1 <= 0
        a = max(0.0, 1.0 - bound / math.log(n + 1))
        size, depth, level = 0, 0, 1
        while True:
            level *= n
            if size + level > k:
                break
            size += level
            depth += 1
        best = max(best, sum(a**i for i in range(depth + 1)))
    return float(best)


# ----------------------------------------------------------------------------------------------------
# Trees given per-node child distributions: value and the optimal (Tunstall) tree
# ----------------------------------------------------------------------------------------------------

NodeProbs = np.ndarray | Sequence[float] | Callable[[tuple[int, ...]], object]


@dataclass(frozen=True)
class DraftTree:
    """A drafting tree and its value.

    Attributes
    ----------
    paths:
        ``[N]`` child-index paths (``[[0], [0, 0], [1]]``), parents before children, in order of
        non-increasing reach probability.
    reach_probs:
        ``[N]`` probability that the target's path passes through each node (is accepted down to it).
    expected_tokens:
        ``1 + sum(reach_probs)``: expected accepted tokens plus the recovered or bonus token.
    """

    paths: list[list[int]]
    reach_probs: list[float]
    expected_tokens: float


class _ChildProbs:
    """Conditional child-acceptance distributions per node, validated and cached; sorted order on demand."""

    def __init__(self, node_probs: NodeProbs):
        self._fn = node_probs if callable(node_probs) else None
        self._fixed = None if self._fn is not None else self._check(node_probs, ())
        self._cache: dict[tuple[int, ...], np.ndarray] = {}
        self._orders: dict[tuple[int, ...], np.ndarray] = {}

    @staticmethod
    def _check(values, path: tuple[int, ...]) -> np.ndarray:
        try:
            arr = np.asarray(values.detach().cpu() if hasattr(values, "detach") else values, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise QuickdraftError(f"node_probs at path {list(path)} must be a vector of probabilities: {exc}") from None
        if arr.ndim != 1 or arr.size == 0:
            raise QuickdraftError(
                f"node_probs at path {list(path)} must be a non-empty 1-D vector, got shape {arr.shape}"
            )
        if not np.isfinite(arr).all() or (arr < 0).any():
            raise QuickdraftError(f"node_probs at path {list(path)} must be finite and >= 0")
        if arr.sum() > 1.0 + _SUM_TOL:
            raise QuickdraftError(f"node_probs at path {list(path)} sums to {arr.sum():.6g} > 1")
        return arr

    def at(self, path: tuple[int, ...]) -> np.ndarray:
        if self._fixed is not None:
            return self._fixed
        if path not in self._cache:
            self._cache[path] = self._check(self._fn(path), path)
        return self._cache[path]

    def order(self, path: tuple[int, ...]) -> np.ndarray:
        key = () if self._fixed is not None else path
        if key not in self._orders:
            self._orders[key] = np.argsort(-self.at(path), kind="stable")
        return self._orders[key]


def _tree_paths(tree) -> list[tuple[int, ...]]:
    """Validate a list of paths: non-empty integer paths >= 0, no duplicates, prefix-closed."""
    if isinstance(tree, (str, bytes)) or not isinstance(tree, Sequence):
        raise QuickdraftError(f"tree must be a list of paths like [[0], [0, 0], [1]], got {tree!r}")
    paths = []
    for raw in tree:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence) or len(raw) == 0:
            raise QuickdraftError(f"every tree path must be a non-empty list of child indices, got {raw!r}")
        for j in raw:
            if isinstance(j, bool) or not isinstance(j, (int, np.integer)) or j < 0:
                raise QuickdraftError(f"child indices must be integers >= 0, got {raw!r}")
        paths.append(tuple(int(j) for j in raw))
    seen = set(paths)
    if len(seen) != len(paths):
        raise QuickdraftError("tree has a duplicate path")
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise QuickdraftError(f"tree path {list(path)} has no parent {list(path[:-1])} in the tree")
    return paths


def draft_tree_expected_tokens(node_probs: NodeProbs, tree: Sequence[Sequence[int]]) -> float:
    r"""Expected tokens per call of a tree: :math:`1 + \sum_u \prod_{i} c_{u_{<i}}(u_i)`.

    Parameters
    ----------
    node_probs:
        Either one ``[V]`` vector :math:`c` used at every node (i.i.d. positions; for a race tree, the rank
        law of :func:`race_rank_distribution`), or a function ``path -> [V]`` giving, at the node reached by
        ``path`` (a tuple of child indices, ``()`` for the root), the probability that the target's path
        continues to child ``j`` given that it reached the node (e.g. a Markov source's transition row).
        Each vector sums to at most 1.
    tree:
        Child-index paths, prefix-closed.
    """
    probs = _ChildProbs(node_probs)
    reach: dict[tuple[int, ...], float] = {(): 1.0}
    for path in sorted(_tree_paths(tree), key=len):
        c = probs.at(path[:-1])
        if path[-1] >= c.shape[0]:
            raise QuickdraftError(f"tree path {list(path)}: child index {path[-1]} >= {c.shape[0]} children")
        reach[path] = reach[path[:-1]] * float(c[path[-1]])
    return float(sum(reach.values()))


def optimal_draft_tree(node_probs: NodeProbs, num_nodes: int) -> DraftTree:
    r"""The tree of ``k = num_nodes`` nodes with the largest expected tokens per call (Tunstall's greedy).

    The value of a tree is :math:`1 + \sum_u P(u)` with reach probabilities
    :math:`P(u \cdot j) = P(u)\, c_u(j) \le P(u)`. Any ``k``-node tree sums ``k`` reach probabilities, so it
    is worth at most the ``k`` largest; those form a tree (a child never exceeds its parent). Best-first
    search finds them: the heap holds, for each node in the tree, only its best child not yet taken
    and the next sibling of the last child taken, so every pop pushes at most two entries and the popped
    values never increase.

    Cost: :math:`O(k \log k)` heap operations plus one :math:`O(V \log V)` sort of :math:`c` (per expanded
    node when ``node_probs`` is a function). Ties go to the entry pushed first.

    Parameters
    ----------
    node_probs:
        As in :func:`draft_tree_expected_tokens`.
    num_nodes:
        ``k >= 0`` drafted tokens.

    Returns
    -------
    DraftTree
        ``paths`` in pop order, ``reach_probs``, ``expected_tokens``.

    Examples
    --------
    >>> tree = optimal_draft_tree([0.6, 0.3, 0.1], 3)
    >>> tree.paths
    [[0], [0, 0], [1]]
    >>> round(tree.expected_tokens, 12)
    2.26
    """
    k = _count(num_nodes, "num_nodes", minimum=0)
    probs = _ChildProbs(node_probs)
    paths: list[list[int]] = []
    reach: list[float] = []
    reach_of: dict[tuple[int, ...], float] = {(): 1.0}
    counter = 0
    heap: list[tuple[float, int, tuple[int, ...], int]] = []  # (-reach, tie, parent, rank of child in order)

    def push(parent: tuple[int, ...], j: int) -> None:
        nonlocal counter
        order = probs.order(parent)
        if j < order.shape[0]:
            value = reach_of[parent] * float(probs.at(parent)[order[j]])
            heapq.heappush(heap, (-value, counter, parent, j))
            counter += 1

    push((), 0)
    while len(paths) < k and heap:
        neg, _, parent, j = heapq.heappop(heap)
        node = parent + (int(probs.order(parent)[j]),)
        reach_of[node] = -neg
        paths.append(list(node))
        reach.append(-neg)
        push(parent, j + 1)  # next sibling
        push(node, 0)  # best child
    return DraftTree(paths=paths, reach_probs=reach, expected_tokens=float(1.0 + sum(reach)))


def _count(x, name: str, minimum: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < minimum:
        raise QuickdraftError(f"{name} must be an integer >= {minimum}, got {x!r}")
    return int(x)
