r"""Fast :math:`\Pr[\text{all } n \text{ drafts} \in A_k]` for sampling without replacement, all prefixes.

Used by :func:`quickdraft.theory.optimal_acceptance` (``sampling="without_replacement"``). The tokens
with ``q > 0`` are given in the order that makes the optimal set a prefix (``q/p`` decreasing; see
``docs/theory.md`` §3 for the proof); ``A_k`` is the set of the first ``k`` of them.

Exponential race (Kool et al. 2019): sequential sampling without replacement from ``q`` is the
arrival order of independent clocks :math:`T_x \sim \mathrm{Exp}(q_x)`, so with :math:`\lambda_k = 1 - q(A_k)`

.. math::

    g_k = \Pr[\text{first } n \text{ arrivals} \subseteq A_k]
        = \int_0^\infty \lambda_k e^{-\lambda_k t} \bigl(1 - G_k(t)\bigr)\, dt,
    \qquad G_k(t) = \Pr[N_{A_k}(t) \le n - 1],

:math:`N_{A}(t) = \sum_{x \in A} \mathrm{Bernoulli}(1 - e^{-q_x t})`. After subtracting
:math:`\psi(t) = (1 - e^{-\mu t})^n` (:math:`\mu` = ``n``-th largest ``q``; its transform
:math:`\prod_{i=1}^n i\mu/(i\mu + \lambda)` is exact) the integrand is analytic and decays at both ends in
:math:`y = \log t`, so the trapezoidal rule in ``y`` converges geometrically.

What makes it fast at ``V = 151,936`` (a direct evaluation costs an ``O(nV)`` scan per quadrature node):

* **light tokens** (``q_x t_hi <= 1/4`` for every node ``t <= t_hi``) enter :math:`G_k` only through
  the power sums :math:`P_i = \sum_x r_x^i` of :math:`r_x = e^{q_x t} - 1`, ``i < n``. By the Taylor
  series :math:`(e^y - 1)^i = i! \sum_{l \ge i} S(l, i) y^l / l!` (Stirling numbers of the second kind,
  all terms positive) :math:`P_i(t) = \sum_l c_{il} t^l M_l` with the block moments
  :math:`M_l = \sum_x q_x^l`, which are computed **once**; per node only a small matrix product remains.
  The polynomial :math:`\prod_x (1 + r_x z) \bmod z^n = \exp(\sum_i (-1)^{i+1} P_i z^i / i)` follows
  from the exponential recurrence. Since ``r_x <= e^{1/4} - 1``, this has no harmful cancellation.
* **heavy tokens** (the rest: at most ``4 t_hi`` of them, typically tens to a thousand) use the
  positive prefix recursion of the elementary symmetric polynomials, vectorised over nodes. If that
  would exceed :data:`GROUP_BUDGET` (very flat ``q``), the nodes are split into groups, each with the
  light/heavy split of its own largest ``t``.
* **branch and bound over prefixes**: :math:`g` is computed exactly only at interval ends; since
  :math:`g_k` is a convex function of the cumulative draft mass (``docs/theory.md`` §3.1), the chord
  bounds :math:`g_k - p(A_k)` inside an interval, and only intervals that can still hold the
  maximiser are refined, down to 16-token blocks evaluated token by token (:meth:`WorPrefixes.max_gap`).
"""

from __future__ import annotations

import math

import numpy as np

from quickdraft.errors import QuickdraftError

#: Trapezoidal step in log-time (|error| < 1e-13 against exact enumeration in the tests).
LOG_STEP = 0.25
#: Light tokens satisfy q * t <= LIGHT for every node, so the Taylor series below converges fast.
LIGHT = 0.25
#: Taylor terms kept for the power sums: the first omitted term is below LIGHT**TAYLOR / TAYLOR! ~ 1e-17.
TAYLOR = 12
#: A heavy clock with q * t above this counts as arrived (error per token <= exp(-40) ~ 4e-18).
SURE = 40.0
#: Tokens per block: the light moments are kept per block, and a block is the unit evaluated token by token.
BLOCK = 16
#: Each refinement level splits an interval of blocks into this many parts.
FANOUT = 8
#: Branch and bound drops an interval whose upper bound is at most ``best + PRUNE_TOL``, so the returned
#: maximum is below the exact one by at most this much (plus the quadrature error). A margin *below* the
#: best value would keep every prefix whose gap is within it of the best, which for peaked
#: distributions (long stretches of prefixes with ``g_k`` and ``p(A_k)`` both ~1e-14) means all of them.
PRUNE_TOL = 1e-12


def _stirling_coeffs(n_pow: int, terms: int) -> np.ndarray:
    r"""``[n_pow, terms]``: ``C[i-1, l-1]`` with :math:`(e^y - 1)^i = \sum_l C_{il} y^l` (zero for ``l < i``)."""
    # (e^y - 1)^i = i! sum_l S(l, i) y^l / l!
    stir = np.zeros((terms + 1, n_pow + 1))
    stir[0, 0] = 1.0
    for l in range(1, terms + 1):
        for i in range(1, n_pow + 1):
            stir[l, i] = i * stir[l - 1, i] + stir[l - 1, i - 1]
    out = np.zeros((n_pow, terms))
    for i in range(1, n_pow + 1):
        for l in range(i, terms + 1):
            out[i - 1, l - 1] = math.factorial(i) * stir[l, i] / math.factorial(l)
    return out


def _exp_series(power_sums: np.ndarray, n: int) -> np.ndarray:
    r"""Coefficients ``[..., n]`` of :math:`\exp(\sum_{i<n} (-1)^{i+1} P_i z^i / i) \bmod z^n` (the ESPs).

    ``power_sums``: ``[..., n-1]`` with ``P_1 .. P_{n-1}``. Recurrence :math:`k e_k = \sum_{i=1}^k (-1)^{i+1} P_i e_{k-i}`.
    """
    shape = power_sums.shape[:-1]
    e = np.zeros(shape + (n,))
    e[..., 0] = 1.0
    for k in range(1, n):
        acc = np.zeros(shape)
        for i in range(1, k + 1):
            term = power_sums[..., i - 1] * e[..., k - i]
            acc = acc + term if i % 2 == 1 else acc - term
        e[..., k] = np.maximum(acc / k, 0.0)
    return e


#: Memory budget of one node group's heavy recursion, in float64 entries (nodes x heavy tokens x n).
GROUP_BUDGET = 3_000_000


class _NodeGroup:
    """Quadrature nodes ``t`` that share one light/heavy split (light: ``q * max(t) <= LIGHT``)."""

    def __init__(self, qs: np.ndarray, n: int, t: np.ndarray, coef: np.ndarray):
        m = qs.shape[0]
        self.t, self.n, self.m = t, n, m
        heavy = qs > LIGHT / float(t[-1])
        self.heavy_pos = np.flatnonzero(heavy)  # [H] positions (0-based) in prefix order
        self.q_light = np.where(heavy, 0.0, qs)  # [m]
        # light moments M_l = sum q^l per block, cumulated: row j = the first j blocks
        nb = -(-m // BLOCK)
        padded = np.zeros(nb * BLOCK)
        padded[:m] = self.q_light
        blocks = padded.reshape(nb, BLOCK)
        mom = np.empty((nb, TAYLOR))
        powq = blocks.copy()
        for l in range(TAYLOR):
            mom[:, l] = powq.sum(axis=1)
            if l + 1 < TAYLOR:
                powq *= blocks
        self.cum_mom = np.vstack([np.zeros((1, TAYLOR)), np.cumsum(mom, axis=0)])  # [nb+1, L]
        tpow = t[:, None] ** np.arange(1, TAYLOR + 1)[None, :]  # [T, L]
        self.taylor_w = tpow[:, :, None] * coef.T[None, :, :]  # [T, L, n-1]: P_i = sum_l M_l t^l C_il
        self._heavy_esp(qs)

    def _heavy_esp(self, qs: np.ndarray) -> None:
        r"""Per node, the heavy part of the count's generating polynomial after each heavy token.

        Stores the elementary symmetric polynomials ``[T, H+1, n]`` of :math:`r_x = e^{q_x t} - 1` over the
        first ``k`` heavy tokens that have not surely arrived, their count of surely arrived tokens and
        :math:`-\sum q_x t` (row 0: no heavy token); :meth:`_heavy_poly` turns them into
        :math:`\prod_x (e^{-q_x t} + (1 - e^{-q_x t}) z)`.
        """
        n = self.n
        x = qs[self.heavy_pos][None, :] * self.t[:, None]  # [T, H]
        sure = x > SURE
        r = np.where(sure, 0.0, np.expm1(np.where(sure, 0.0, x)))
        zero = np.zeros((x.shape[0], 1))
        self._n_sure = np.concatenate([zero.astype(np.int64), np.cumsum(sure, axis=1)], axis=1)
        self._log_d0 = np.concatenate([zero, -np.cumsum(np.where(sure, 0.0, x), axis=1)], axis=1)
        esp = np.zeros((x.shape[0], x.shape[1] + 1, n))
        esp[:, :, 0] = 1.0
        for j in range(1, n):
            esp[:, 1:, j] = np.cumsum(r * esp[:, :-1, j - 1], axis=1)
        self._esp = esp

    def _heavy_poly(self, heavy_count: np.ndarray) -> np.ndarray:
        r"""``[T, K, n]``: the heavy polynomial after the first ``heavy_count[k]`` heavy tokens.

        Coefficient of :math:`z^j` is :math:`e^{-\sum q_x t}\, e_{j - s}(r)` over the not-surely-arrived heavy
        tokens, ``s`` = the number of surely arrived ones; computed in logs because ``e_j`` can be huge.
        """
        n = self.n
        esp = self._esp[:, heavy_count, :]  # [T, K, n]
        n_sure = self._n_sure[:, heavy_count]  # [T, K]
        log_d0 = self._log_d0[:, heavy_count]
        with np.errstate(divide="ignore"):
            log_esp = np.log(esp)
        poly = np.zeros_like(esp)
        for deg in range(n):
            src = deg - n_sure
            vals = np.take_along_axis(log_esp, np.clip(src, 0, n - 1)[..., None], axis=2)[..., 0]
            with np.errstate(under="ignore"):
                poly[:, :, deg] = np.where(src >= 0, np.exp(vals + log_d0), 0.0)
        return poly

    def light_taylor(self, blk: np.ndarray) -> np.ndarray:
        """``[T, K, n-1]`` light power sums of the prefixes made of the first ``blk`` complete blocks."""
        return np.matmul(self.cum_mom[blk][None, :, :], self.taylor_w)  # [1, K, L] @ [T, L, n-1]

    def boundary_parts(self, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.light_taylor(blk), self.cum_mom[blk, 0]

    def block_parts(self, blocks: np.ndarray, ks: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Light power sums ``[T, K, n-1]`` and light mass ``[K]`` for every prefix inside ``blocks``."""
        n = self.n
        ql = self.q_light[np.minimum(ks - 1, self.m - 1)] * (ks <= self.m)  # [R, b]; token k-1 closes prefix k
        ps = self.light_taylor(blocks)[:, :, None, :].repeat(BLOCK, axis=2)  # [T, R, b, n-1]
        r = np.expm1(ql[None, :, :] * self.t[:, None, None])  # [T, R, b]
        rp = r.copy()
        for i in range(n - 1):
            ps[..., i] += np.cumsum(rp, axis=2)
            rp *= r
        mass = self.cum_mom[blocks, 0][:, None] + np.cumsum(ql, axis=1)  # [R, b]
        return ps.reshape(self.t.size, -1, n - 1)[:, keep, :], mass.ravel()[keep]

    def integral(self, kk, ps, mass, lam, mu) -> np.ndarray:
        r"""``[K]``: :math:`\sum_{t} t \lambda e^{-\lambda t} ((1 - G_k(t)) - \psi(t))` over this group's nodes."""
        n = self.n
        light = _exp_series(ps, n) * np.exp(-mass[None, :, None] * self.t[:, None, None])  # [T, K, n]
        heavy = self._heavy_poly(np.searchsorted(self.heavy_pos, kk, side="left"))  # [T, K, n]
        light_cum = np.cumsum(light, axis=2)
        big_g = np.zeros(light.shape[:2])  # G = sum_{a + b < n} heavy_a light_b
        for a in range(n):
            big_g += heavy[:, :, a] * light_cum[:, :, n - 1 - a]
        big_g = np.clip(big_g, 0.0, 1.0)
        t = self.t[:, None]
        psi = (-np.expm1(-mu * t)) ** n  # [T, 1]
        with np.errstate(under="ignore"):
            weight = t * lam[None, :] * np.exp(-lam[None, :] * t)
        return (weight * ((1.0 - big_g) - psi)).sum(axis=0)


class WorPrefixes:
    r""":math:`g_k = \Pr[\text{all drafts} \in A_k]` for the prefixes of ``qs`` (``[m]``, all positive, ``m > n >= 2``).

    Build once, then call :meth:`max_gap` (or :meth:`all` for every prefix, in tests).
    """

    def __init__(self, qs: np.ndarray, n: int):
        qs = np.asarray(qs, dtype=np.float64)
        m = qs.shape[0]
        if m <= n or n < 2:
            raise ValueError("WorPrefixes needs n >= 2 and more than n support tokens")
        self.qs, self.n, self.m = qs, n, m
        self.nb = -(-m // BLOCK)
        # mass outside each prefix A_k, k = 0..m (suffix sums: no cancellation near 1)
        self.lam = np.concatenate([np.cumsum(qs[::-1])[::-1], [0.0]])  # [m+1]
        self.mu = float(np.partition(qs, m - n)[m - n])  # n-th largest q
        # slowest decay rate of the integrand over all prefixes: for k with lam_k >= mu the factor
        # e^{-lam t} decays at rate >= mu; for the others 1 - G_k decays at rate >= the n-th largest q
        # of A_k >= that of A_{k0}, k0 the first such prefix
        below = np.flatnonzero(self.lam[n:m] < self.mu)
        rate = self.mu
        if below.size:
            k0 = n + int(below[0])
            rate = min(rate, float(np.partition(qs[:k0], k0 - n)[k0 - n]))
        t_hi = (40.0 + math.log(n)) / rate
        t_lo = (1e-18 * math.factorial(n)) ** (1.0 / (n + 1)) / max(1.0, self.mu)
        t = np.exp(np.arange(math.log(t_lo), math.log(t_hi) + LOG_STEP, LOG_STEP))  # [T] nodes
        if (690.0 - (n - 1) * math.log(m)) / (n - 1) < 25.0:
            raise QuickdraftError(f"num_drafts={n} is too large for the without-replacement quadrature at V={m}")
        coef = _stirling_coeffs(n - 1, TAYLOR)  # [n-1, L]
        # node groups: one group unless the heavy recursion would exceed the memory budget, in which
        # case earlier (smaller-t) nodes get their own, smaller heavy sets
        q_desc = None
        self.groups = []
        start = 0
        while start < t.size:
            end = t.size
            if t.size - start > 1:
                heavy_all = int(np.count_nonzero(qs > LIGHT / float(t[-1])))
                if (end - start) * (heavy_all + 1) * n > GROUP_BUDGET:
                    if q_desc is None:
                        q_desc = np.sort(qs)[::-1]
                    # largest end with (end - start) * H(t[end-1]) * n <= budget (at least one node)
                    heavy_counts = np.searchsorted(-q_desc, -LIGHT / t[start:], side="left")  # q > LIGHT/t
                    cost = (np.arange(1, t.size - start + 1)) * (heavy_counts + 1) * n
                    end = start + max(1, int(np.searchsorted(cost > GROUP_BUDGET, True)))
            self.groups.append(_NodeGroup(qs, n, t[start:end], coef))
            start = end

    def _finish(self, kk: np.ndarray, parts) -> np.ndarray:
        """``g_k`` from per-group ``(light power sums, light mass)``; ``kk`` are the prefix lengths."""
        n = self.n
        out = np.zeros(kk.shape[0])
        valid = kk >= n
        full = valid & (self.lam[kk] <= 0.0)
        out[full] = 1.0
        todo = valid & ~full
        if todo.any():
            k2 = kk[todo]
            lam = self.lam[k2]
            acc = np.zeros(k2.size)
            for group, (ps, mass) in zip(self.groups, parts):
                acc += group.integral(k2, ps[:, todo, :], mass[todo], lam, self.mu)
            i = np.arange(1, n + 1)[None, :]
            closed = np.prod(i * self.mu / (i * self.mu + lam[:, None]), axis=1)  # transform of psi
            out[todo] = LOG_STEP * acc + closed
        return np.clip(out, 0.0, 1.0)

    def at_boundaries(self, blk: np.ndarray) -> np.ndarray:
        """``g_k`` for ``k = blk * BLOCK`` (``blk``: ``[K]`` numbers of complete blocks, ``k <= m``)."""
        blk = np.asarray(blk, dtype=np.int64)
        return self._finish(blk * BLOCK, [g.boundary_parts(blk) for g in self.groups])

    def in_blocks(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prefix lengths ``ks`` and ``g_k`` for every ``k`` in ``(j * BLOCK, (j+1) * BLOCK] ∩ [1, m]``, ``j`` in ``blocks``."""
        blocks = np.asarray(blocks, dtype=np.int64)
        ks = blocks[:, None] * BLOCK + np.arange(1, BLOCK + 1)[None, :]  # [R, b]
        keep = (ks <= self.m).ravel()
        parts = [g.block_parts(blocks, ks, keep) for g in self.groups]
        return ks.ravel()[keep], self._finish(ks.ravel()[keep], parts)

    def all(self) -> np.ndarray:
        """``[m]``: ``g_k`` for ``k = 1..m`` (all prefixes; for tests)."""
        out = np.zeros(self.m)
        for i in range(0, self.nb, 32):
            ks, g = self.in_blocks(np.arange(i, min(i + 32, self.nb)))
            out[ks - 1] = g
        return out

    def max_gap(self, p_sorted: np.ndarray) -> float:
        r""":math:`\max_{0 \le k \le m} (g_k - p(A_k))` with ``p_sorted`` ``[m]`` the target mass in prefix order.

        Branch and bound over prefix intervals :math:`(a, b]`. By the exchange lemma of ``docs/theory.md``
        §3 the increments of ``g`` per unit of draft mass are non-decreasing along *any* token order, i.e.
        :math:`g_k = \varphi(q(A_k))` with :math:`\varphi` convex. So inside an interval ``g`` lies below
        its chord, and

        .. math::

            \max_{a < k \le b} (g_k - p(A_k)) \le \max_{a < k \le b}
            \Bigl(g_a + \frac{g_b - g_a}{Q_b - Q_a} (Q_k - Q_a) - P_k\Bigr),

        which costs ``O(b - a)`` with the prefix sums ``Q``, ``P``. ``g`` is computed exactly at interval
        ends; intervals whose bound reaches the best value found are split ``FANOUT``-fold down to single
        blocks, which are evaluated token by token. The result is the exact maximum up to the quadrature
        error (about ``1e-13``) and :data:`PRUNE_TOL` (an interval is dropped only if it cannot beat the best
        value found by more than ``PRUNE_TOL``).
        """
        m = self.m
        p_cum = np.concatenate([[0.0], np.cumsum(p_sorted)])  # [m+1]
        q_cum = np.concatenate([[0.0], np.cumsum(self.qs)])  # [m+1]
        nfull = m // BLOCK
        best = 0.0
        if m % BLOCK:  # the last, partial block: token by token
            ks, g = self.in_blocks(np.array([nfull]))
            best = max(best, float(np.max(g - p_cum[ks])))
        if nfull == 0:
            return best
        # intervals (a, b] in units of blocks, with g known at both ends
        size = FANOUT**3
        a = np.arange(0, nfull, size)
        b = np.minimum(a + size, nfull)
        g_at = self.at_boundaries(b)
        g_a = np.concatenate([[0.0], g_at[:-1]])
        g_b = g_at
        best = max(best, float(np.max(g_b - p_cum[b * BLOCK])))
        while a.size:
            keep = g_b - p_cum[a * BLOCK] > best + PRUNE_TOL  # the cheap bound first
            a, b, g_a, g_b = a[keep], b[keep], g_a[keep], g_b[keep]
            ub = self._chord_bound(a * BLOCK, b * BLOCK, g_a, g_b, q_cum, p_cum)
            keep = ub > best + PRUNE_TOL
            a, b, g_a, g_b = a[keep], b[keep], g_a[keep], g_b[keep]
            single = b - a == 1
            leaves = a[single]
            for i in range(0, leaves.size, 64):
                ks, g = self.in_blocks(leaves[i : i + 64])
                best = max(best, float(np.max(g - p_cum[ks])))
            a, b, g_a, g_b = a[~single], b[~single], g_a[~single], g_b[~single]
            if not a.size:
                break
            # split each interval into up to FANOUT parts; evaluate g at the new inner ends
            step = (b - a + FANOUT - 1) // FANOUT
            parts = [np.arange(x, y, s_) for x, y, s_ in zip(a, b, step)]
            starts = np.concatenate(parts)
            owner = np.repeat(np.arange(a.size), [len(x) for x in parts])
            ends = np.minimum(starts + step[owner], b[owner])
            inner = ends < b[owner]
            g_inner = self.at_boundaries(ends[inner])
            g_end = g_b[owner].copy()
            g_end[inner] = g_inner
            best = max(best, float(np.max(g_inner - p_cum[ends[inner] * BLOCK], initial=0.0)))
            g_start = np.empty_like(g_end)
            first = np.concatenate([[True], owner[1:] != owner[:-1]])
            g_start[first] = g_a[owner[first]]
            g_start[~first] = g_end[np.flatnonzero(~first) - 1]
            a, b, g_a, g_b = starts, ends, g_start, g_end
        return best

    @staticmethod
    def _chord_bound(ka, kb, g_a, g_b, q_cum, p_cum) -> np.ndarray:
        """Upper bound of ``g_k - P_k`` on each interval ``(ka, kb]`` from the chord of the convex ``g(Q)``."""
        if ka.size == 0:
            return np.zeros(0)
        lengths = kb - ka
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        owner = np.repeat(np.arange(ka.size), lengths)
        idx = np.arange(int(lengths.sum())) - starts[owner] + ka[owner] + 1  # all k in the intervals
        dq = q_cum[kb] - q_cum[ka]
        slope = np.where(dq > 0, (g_b - g_a) / np.where(dq > 0, dq, 1.0), 0.0)
        vals = (g_a - slope * q_cum[ka])[owner] + slope[owner] * q_cum[idx] - p_cum[idx]
        return np.maximum.reduceat(vals, starts)
