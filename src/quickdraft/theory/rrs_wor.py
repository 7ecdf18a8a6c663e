r"""Acceptance rate of RRS with drafts sampled without replacement: a certified interval at any ``V``.

Setting (as in :func:`quickdraft.theory.verifier_acceptance`, ``verifier="rrs"``,
``sampling="without_replacement"``): the draft proposes :math:`x_i \sim q_i`, :math:`q` without the
earlier drafts, renormalised; RRS accepts :math:`x_i` with :math:`\min(1, p_i(x_i)/q_i(x_i))` and on a
rejection moves to :math:`p_{i+1} = \mathrm{norm}((p_i - q_i)^+)`, with :math:`p_1 = p`.

Reduction to one scalar per step (derived in ``docs/theory.md`` §5.1)
--------------------------------------------------------------------
Let :math:`f(\lambda) = \sum_x (p(x) - \lambda q(x))^+` and :math:`S_i` the draft mass of the first
:math:`i` (rejected) drafts. Every residual is :math:`p_i = (p - \lambda_i q)^+ / f(\lambda_i)` with

.. math::

    \lambda_1 = 0, \qquad \lambda_{i+1} = \lambda_i + \frac{f(\lambda_i)}{1 - S_{i-1}},

and given the history, step :math:`i` rejects token :math:`x \notin D` (the earlier drafts) with probability
:math:`w_i(x) = \bigl(q(x)/(1 - S_{i-1}) - (p(x) - \lambda_i q(x))^+/f(\lambda_i)\bigr)^+`, in total
:math:`f(\lambda_{i+1})/f(\lambda_i)`. So the probability that the first :math:`j` drafts are all rejected is

.. math::

    R_j = \mathbb{E}\bigl[f(\lambda_{j+1})\bigr],

an expectation over the (random) rejected prefixes, which enter only through :math:`S_1, \dots, S_{j-2}`.
:math:`R_1 = \mathrm{TV}` and :math:`R_2` are exact in :math:`O(V \log V)`; :math:`R_j` for larger
:math:`j` needs the tree of rejected prefixes, :math:`O(V^{j-2})` nodes.

Certified pruning
-----------------
The tree is expanded best-first (largest remaining uncertainty) up to ``max_expansions`` steps. Expanding
a node computes the exact share of every child in the next :math:`R_j` in one vectorised pass (only
tokens with :math:`p/q < \lambda_{i+1}` can be rejected: a suffix of the :math:`p/q` order) and keeps
the children as a *lump*; splitting a lump (also one step) turns its ``max_children`` heaviest members
into nodes and re-bounds the rest. For a subtree that is not expanded, every later :math:`\lambda` is
bounded without knowing the path: :math:`\lambda \mapsto \lambda + f(\lambda)/(1 - S)` is non-decreasing
in :math:`\lambda` (its slope is :math:`1 - q(\{p/q > \lambda\})/(1 - S) \ge 0`, the earlier drafts all
having :math:`p/q \le \lambda`) and increasing in :math:`S`, so freezing :math:`S` gives a lower bound
:math:`\Lambda^{lo}` of every later :math:`\lambda`; an upper bound :math:`\Lambda^{hi}` adds to :math:`S`
the largest draft masses of the tokens that can still be rejected. Since :math:`f` is non-increasing
and convex, the subtree's share of :math:`R_j` (probability :math:`m`) lies in
:math:`[m \max(f(\Lambda^{hi}), f(\Lambda^{E})), m \min(r, f(\Lambda^{lo}))] / f(\lambda)`, where
:math:`\Lambda^E \ge \mathbb{E}_\nu \lambda` (Jensen) is propagated with the chord of :math:`1/(1-S)` and
a bound on the expected mass of a rejected draft, and :math:`r` is the exact next-step rejection.
The returned interval therefore contains the exact rate (up to floating-point rounding, guarded by a
relative margin on :math:`1 - S`); with enough expansions it collapses to it (tested against the full
recursion on small ``V``, and against Monte Carlo at ``V = 400``).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from quickdraft.errors import QuickdraftError
from quickdraft.theory import _validate
from quickdraft.theory._ratio import RatioProfile

#: Relative margin taken off ``1 - S`` in the upper bounds of lambda, so rounding cannot make them too small
#: (``1 - S`` is kept to a relative accuracy of about ``1e-14``, see :meth:`_Tree._expand`).
_REM_MARGIN = 1e-12
#: How many of the largest-``q`` tokens are scanned first for the upper bound of the rejected mass.
_TOP_SCAN = 4096


@dataclass(frozen=True)
class RrsWorInterval:
    """Certified bounds on the acceptance rate of RRS without replacement for ``n = 1 .. max_drafts``.

    Attributes
    ----------
    lower, upper:
        ``[max_drafts]`` bounds on the acceptance rate (index ``n - 1``); ``lower <= exact <= upper``.
    expansions:
        Tree nodes expanded.
    exact:
        True if nothing was pruned (``lower == upper`` up to rounding).
    """

    lower: np.ndarray
    upper: np.ndarray
    expansions: int
    exact: bool


def rrs_without_replacement_interval(
    target_probs, draft_probs, max_drafts: int, max_expansions: int = 64, max_children: int = 8, profile=None
) -> RrsWorInterval:
    r"""Certified interval for the acceptance rate of RRS with drafts sampled without replacement.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` target distribution :math:`p` and draft distribution :math:`q`.
    max_drafts:
        Largest ``n``; the rates for every ``n = 1 .. max_drafts`` come from one tree.
    max_expansions:
        Budget of tree nodes expanded (each :math:`O(V \log V)`) or lumps split; one expansion (the
        root) makes ``n <= 2`` exact.
    max_children:
        Children kept individually per expansion (the rest are bounded as a group).
    profile:
        Optional :class:`~quickdraft.theory._ratio.RatioProfile` of the same (validated) ``p, q``, to
        share its sort with other computations.

    Returns
    -------
    RrsWorInterval
        ``lower[n-1] <= rate(n) <= upper[n-1]``.

    Examples
    --------
    >>> iv = rrs_without_replacement_interval([0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 2)
    >>> bool(iv.exact), round(float(iv.lower[0]), 6)  # n = 1: 1 - TV
    (True, 0.7)
    """
    p, q = _validate.pair(target_probs, draft_probs)
    n_max = _validate.num_drafts(max_drafts, "max_drafts")
    if isinstance(max_expansions, bool) or not isinstance(max_expansions, (int, np.integer)) or max_expansions < 0:
        raise QuickdraftError(f"max_expansions must be an integer >= 0, got {max_expansions!r}")
    max_children = _validate.num_drafts(max_children, "max_children")
    tree = _Tree(p, q, n_max, max_children, profile)
    expansions = tree.run(int(max_expansions))
    r_lo = tree.exact + tree.pending_lo  # [N+1] P(first j drafts all rejected), j = 0..N
    r_hi = tree.exact + tree.pending_hi
    r_hi = np.minimum.accumulate(np.minimum(r_hi, 1.0))  # R_j <= R_{j-1}
    r_lo = np.clip(r_lo, 0.0, None)
    lower = np.clip(1.0 - r_hi[1:], 0.0, 1.0)
    upper = np.clip(1.0 - r_lo[1:], 0.0, 1.0)
    return RrsWorInterval(lower, upper, expansions, exact=not tree.pruned)


@dataclass
class _Node:
    depth: int  # k: number of rejected drafts so far
    mass: float  # probability of this ordered rejected prefix
    lam: float  # lambda_{k+1}: the current residual is (p - lam q)^+ / fl
    fl: float  # f(lam)
    rem: float  # 1 - S_k, the draft mass not drafted yet
    drafted: tuple[int, ...]  # the k rejected drafts
    lam1: float  # lambda_{k+2} = lam + fl / rem
    fl1: float  # f(lam1); fl1 / fl = probability that the next draft is rejected
    lo: np.ndarray  # [N+1] lower bound of this subtree's share of R_j, j >= k + 2 (0 elsewhere)
    hi: np.ndarray  # [N+1] upper bound


@dataclass
class _Lump:
    """Children of an expanded node that are not expanded individually yet, bounded as a group.

    Their exact share of ``R_{k+2}`` is already counted; ``lo``/``hi`` bound their shares of ``R_j``,
    ``j >= k + 3``. Splitting a lump registers its heaviest members as nodes and re-bounds the rest
    (tighter, because the largest draft mass among the members shrinks).
    """

    parent: _Node
    ids: np.ndarray  # [M] member tokens (the child's rejected draft)
    w: np.ndarray  # [M] probability of the child prefix
    r: np.ndarray  # [M] its next-step rejection probability f(lambda_{k+3}) / f(lambda_{k+2})
    rem: np.ndarray  # [M] 1 - S_{k+1} of each child
    lo: np.ndarray
    hi: np.ndarray


class _Tree:
    """Best-first expansion of the tree of rejected draft prefixes (see the module docstring)."""

    def __init__(self, p: np.ndarray, q: np.ndarray, n_max: int, max_children: int, profile=None):
        self.p, self.q, self.n_max, self.max_children = p, q, n_max, max_children
        self.prof = RatioProfile(p, q) if profile is None else profile
        with np.errstate(divide="ignore", invalid="ignore"):
            self.ratio = np.where(q > 0, p / np.where(q > 0, q, 1.0), np.inf)  # [V] p/q per token
        self.n_supp = int(np.count_nonzero(q))
        k = min(_TOP_SCAN, q.shape[0])
        top = np.argpartition(-q, k - 1)[:k] if k < q.shape[0] else np.arange(q.shape[0])
        self.top_ids = top[np.argsort(-q[top], kind="stable")]  # [K] largest q first
        self.top_q = q[self.top_ids]
        self.top_ratio = self.ratio[self.top_ids]
        # scalar f(lambda) without numpy overhead: Python lists of the profile's arrays
        self._neg_ratio = self.prof._neg_ratio
        self._p_cum = self.prof.p_cum
        self._q_cum = self.prof.q_cum
        self._q2_cum = np.concatenate([[0.0], np.cumsum(q[self.prof.order] ** 2)])  # [V+1] in the p/q order
        self.exact = np.zeros(n_max + 1)  # [N+1] exactly known parts of R_j
        self.exact[0] = 1.0
        self.pending_lo = np.zeros(n_max + 1)
        self.pending_hi = np.zeros(n_max + 1)
        self.heap: list = []
        self._tick = itertools.count()
        self.pruned = False
        self._register(0, 1.0, 0.0, self._f(0.0), 1.0, ())

    def _f(self, lam: float) -> float:
        r"""Scalar :math:`f(\lambda)` (same as ``RatioProfile.f``, without array overhead)."""
        if lam == np.inf:
            return 0.0
        k = int(self._neg_ratio.searchsorted(-lam, side="left"))
        qc = float(self._q_cum[k])
        val = float(self._p_cum[k]) - (lam * qc if qc > 0 else 0.0)
        return val if val > 0.0 else 0.0

    # -- bounds ---------------------------------------------------------------------------------------

    def _top_rejectable(self, count: int, lam_hi: float, drafted: tuple[int, ...]) -> float:
        """Sum of the ``count`` largest ``q`` over tokens not in ``drafted`` with ``p/q < lam_hi``."""
        if count <= 0:
            return 0.0
        pos = np.flatnonzero(self.top_ratio < lam_hi)[: count + len(drafted)]
        if drafted:
            pos = [i for i in pos.tolist() if int(self.top_ids[i]) not in drafted]
        pos = pos[:count]
        if len(pos) < count and self.top_ids.size < self.q.shape[0]:  # rare: scan the whole vocabulary
            mask = self.ratio < lam_hi
            mask[list(drafted)] = False
            return float(np.sort(self.q[mask])[::-1][:count].sum())
        return float(self.top_q[pos].sum())

    def _q2_rejectable(self, lam: float) -> float:
        r""":math:`\sum q(x)^2` over the tokens with :math:`p/q < \lambda` (the only ones that can be rejected)."""
        if lam == np.inf:
            return float(self._q2_cum[-1])
        start = int(self._neg_ratio.searchsorted(-lam, side="right"))
        return float(self._q2_cum[-1] - self._q2_cum[start])

    def _chain(self, lam_lo: float, lam_hi: float, rem: float, drafted, count0: int, steps: int, e0: float):
        r"""Bounds of the next ``steps`` values of :math:`\mathbb{E}_\nu[f(\lambda_{i+1})]` over a subtree.

        ``lam_lo <= lambda_i <= lam_hi`` for the current ``i`` on every path; ``rem = 1 - S`` with ``S`` a
        lower bound of every later ``S_{i-1}``; ``count0`` = number of rejected drafts not in ``drafted``
        that ``S_{i-1}`` can contain at the current ``i`` (grows by one per step), and ``e0`` an upper
        bound of their expected total draft mass under :math:`\nu` (the law of the rejected drafts given
        that they are rejected).

        Returns ``(f_up, f_dn)``: ``f_up[t] = f(Λ^lo)`` bounds :math:`f(\lambda)` from above on every path;
        ``f_dn[t]`` bounds :math:`\mathbb{E}_\nu f(\lambda)` from below, as the larger of :math:`f(Λ^{hi})`
        (every path) and :math:`f(Λ^{E})` (Jensen: ``f`` is convex and :math:`Λ^E \ge \mathbb{E}_\nu\lambda`).
        """
        f_up = np.zeros(steps)  # f at the lower lambda bound: upper bound of f
        f_dn = np.zeros(steps)
        lam_e, d = lam_hi, e0  # bound of E[lambda_i]; bound of E[S_{i-1} - S]
        for t in range(steps):
            f_at_lo = self._f(lam_lo)
            extra = self._top_rejectable(count0 + t, lam_hi, drafted) if np.isfinite(lam_hi) else 0.0
            lam_lo = lam_lo + f_at_lo / rem
            room = rem - extra - _REM_MARGIN * rem  # rounded down: keeps lam_hi an upper bound
            if room > 0 and np.isfinite(lam_hi):
                lam_hi = lam_hi + f_at_lo / room
                # 1/(1 - S) is convex on [S, S + extra]: below its chord, so E[1/(1-S')] <= 1/rem + slope E[S' - S]
                slope = (1.0 / room - 1.0 / rem) / extra if extra > 0 else 0.0
                lam_e = lam_e + f_at_lo * min(1.0 / room, 1.0 / rem + slope * min(d, extra))
            else:
                lam_hi = lam_e = np.inf
            f_up[t] = self._f(lam_lo)
            f_dn[t] = max(self._f(lam_hi), self._f(lam_e))
            # expected mass of the draft rejected at this step: w(x) <= q(x) / room and the rejection
            # probability is at least f(Λ^hi_{i+1}) / f(Λ^lo_i), so E_nu[q(x_i)] <= sum q^2 / room / that
            if t + 1 < steps:
                e_max = self._top_rejectable(1, lam_hi, drafted) if np.isfinite(lam_hi) else 1.0
                p_rej = self._f(lam_hi) / f_at_lo if f_at_lo > 0 else 0.0
                if room > 0 and p_rej > 0:
                    e_max = min(e_max, self._q2_rejectable(lam_hi) / room / p_rej)
                d += e_max
        return f_up, f_dn

    def _push(self, item) -> None:
        self.pending_lo += item.lo
        self.pending_hi += item.hi
        width = float((item.hi - item.lo).sum())
        heapq.heappush(self.heap, (-width, next(self._tick), item))

    # -- nodes ----------------------------------------------------------------------------------------

    def _register(self, depth, mass, lam, fl, rem, drafted, count_next: bool = True) -> None:
        """Add the exact next-step share of a node (unless already counted) and push its bounds for the later steps."""
        n_max = self.n_max
        left = self.n_supp - len(drafted)
        if left <= 0 or rem <= 0:  # nothing left to draft: every later step "rejects"
            self.exact[depth + 1 :] += mass
            if not count_next and depth + 1 <= n_max:
                self.exact[depth + 1] -= mass  # that share was counted by the parent
            return
        lam1 = lam + fl / rem
        fl1 = self._f(lam1)
        if depth + 1 <= n_max and count_next:
            self.exact[depth + 1] += mass * fl1 / fl
        if depth + 2 > n_max or fl1 <= 0.0:
            return
        lo = np.zeros(n_max + 1)
        hi = np.zeros(n_max + 1)
        steps = n_max - depth - 1  # j = depth + 2 .. n_max
        if left - 1 >= steps:  # no exhaustion of the draft support before step n_max
            # the next rejected draft: w(x) <= q(x) / rem, total rejection probability fl1 / fl
            e0 = min(self._top_rejectable(1, lam1, drafted), self._q2_rejectable(lam1) / rem / (fl1 / fl))
            f_up, f_dn = self._chain(lam1, lam1, rem, drafted, 1, steps, e0)
            hi[depth + 2 :] = mass * np.minimum(fl1, f_up) / fl
            lo[depth + 2 :] = mass * f_dn / fl
        else:
            hi[depth + 2 :] = mass * fl1 / fl
        self._push(_Node(depth, mass, lam, fl, rem, drafted, lam1, fl1, lo, hi))

    def _expand(self, node: _Node) -> None:
        """Replace a node's bounds by exact shares of its children at the next step plus their bounds."""
        p, q = self.p, self.q
        k, rem, lam1, fl1 = node.depth, node.rem, node.lam1, node.fl1
        # only tokens with p/q < lambda_{k+2} can be rejected: a suffix of the p/q order
        first = int(self._neg_ratio.searchsorted(-lam1, side="right"))
        cand = self.prof.order[first:]
        pc, qc = p[cand], q[cand]
        wc = node.mass * np.maximum(qc / rem - np.maximum(pc - node.lam * qc, 0.0) / node.fl, 0.0)  # [C]
        if node.drafted:
            wc[np.isin(cand, node.drafted)] = 0.0
        nz = wc > 0.0
        cand, wc, qc = cand[nz], wc[nz], qc[nz]
        left = self.n_supp - len(node.drafted) - 1  # support left for each child
        if left <= 0:
            self.exact[k + 2 :] += wc.sum()
            return
        rem_c = rem - qc
        # a child that drafts more than half of the remaining mass: sum what is left directly instead
        # of subtracting (rem - q(x) would lose all relative precision when q(x) ~ rem, and 1/rem_c
        # enters every later lambda)
        for j in np.flatnonzero(qc > 0.5 * rem):
            left_mask = np.ones(q.shape[0], dtype=bool)
            left_mask[list(node.drafted) + [int(cand[j])]] = False
            rem_c[j] = float(q[left_mask].sum())
        with np.errstate(divide="ignore"):
            lam2 = np.where(rem_c > 0, lam1 + fl1 / np.where(rem_c > 0, rem_c, 1.0), np.inf)
        r_c = np.where(np.isfinite(lam2), self.prof.f(np.where(np.isfinite(lam2), lam2, 0.0)), 0.0) / fl1
        self.exact[k + 2] += float((wc * r_c).sum())  # every child's share of R_{k+2}
        if k + 3 > self.n_max:
            return
        self._split(_Lump(node, cand, wc, r_c, rem_c, np.zeros(self.n_max + 1), np.zeros(self.n_max + 1)))

    def _split(self, lump: _Lump) -> None:
        """Register the ``max_children`` heaviest members of a lump as nodes; bound and push the rest."""
        node = lump.parent
        k, rem, lam1, fl1 = node.depth, node.rem, node.lam1, node.fl1
        m = lump.ids.size
        c = min(self.max_children, m)
        top = np.argpartition(-lump.w, c - 1)[:c] if c < m else np.arange(m)
        for i in top:
            x = int(lump.ids[i])
            self._register(k + 1, float(lump.w[i]), lam1, fl1, float(lump.rem[i]), node.drafted + (x,), count_next=False)
        if c == m:
            return
        rest = np.ones(m, dtype=bool)
        rest[top] = False
        self.pruned = True
        ids, w, r, rem_c = lump.ids[rest], lump.w[rest], lump.r[rest], lump.rem[rest]
        n_max = self.n_max
        big_w, big_wr = float(w.sum()), float((w * r).sum())
        lo = np.zeros(n_max + 1)
        hi = np.zeros(n_max + 1)
        steps = n_max - k - 2  # j = k + 3 .. n_max; a child draws at steps k + 2 .. n_max
        left = self.n_supp - len(node.drafted) - 1
        hi[k + 3 :] = big_wr
        if left - 1 >= steps:
            lam_lo = lam1 + fl1 / rem  # every child has rem_c < rem, so lambda_{k+3} >= this
            room = float(rem_c.min()) - _REM_MARGIN * rem
            lam_hi = lam1 + fl1 / room if room > 0 else np.inf
            if np.isfinite(lam_hi):
                # expected masses of the two unknown drafts: the member (exact mean under the weights w)
                # and the draft rejected after it (the bound of _chain's step, at lambda in [lam1, lam_hi])
                e_member = float((w * self.q[ids]).sum()) / big_w if big_w > 0 else 0.0
                e_next = self._top_rejectable(1, lam_hi, node.drafted)
                p_rej = self._f(lam_hi) / fl1
                if p_rej > 0:
                    e_next = min(e_next, self._q2_rejectable(lam_hi) / room / p_rej)
                f_up, f_dn = self._chain(lam_lo, lam_hi, rem, node.drafted, 2, steps, min(e_member + e_next, 1.0))
                # chain starts at lambda_{k+3}; f(lambda_{j+1}) for j = k+3.. is f_up[j - k - 3]
                hi[k + 3 :] = np.minimum(big_wr, big_w * f_up / fl1)
                lo[k + 3 :] = big_w * f_dn / fl1
        self._push(_Lump(node, ids, w, r, rem_c, lo, hi))

    def run(self, max_expansions: int) -> int:
        """Expand nodes / split lumps, widest first, until ``max_expansions`` or nothing is uncertain."""
        done = 0
        while self.heap:
            neg_width, _, item = self.heap[0]
            if -neg_width <= 0.0:
                heapq.heappop(self.heap)
                self.pending_lo -= item.lo
                self.pending_hi -= item.hi
                if not np.array_equal(item.lo, item.hi):
                    self.pruned = True
                self.exact += item.lo
                continue
            if done >= max_expansions:
                self.pruned = True
                break
            heapq.heappop(self.heap)
            self.pending_lo -= item.lo
            self.pending_hi -= item.hi
            if isinstance(item, _Lump):
                self._split(item)
            else:
                self._expand(item)
            done += 1
        return done
