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

What makes it fast at ``V = 151,936`` (the old code ran an ``O(nV)`` scan per quadrature node):

* **light tokens** (``q_x t_hi <= 1/4`` for every node ``t <= t_hi``) enter :math:`G_k` only through
  the power sums :math:`P_i = \sum_x r_x^i` of :math:`r_x = e^{q_x t} - 1`, ``i < n``. By the Taylor
  series :math:`(e^y - 1)^i = i! \sum_{l \ge i} S(l, i) y^l / l!` (Stirling numbers of the second kind,
  all terms positive) :math:`P_i(t) = \sum_l c_{il} t^l M_l` with the block moments
  :math:`M_l = \sum_x q_x^l`, which are computed **once**; per node only a small matrix product remains.
  The polynomial :math:`\prod_x (1 + r_x z) \bmod z^n = \exp(\sum_i (-1)^{i+1} P_i z^i / i)` follows
  from the exponential recurrence. Since ``r_x <= e^{1/4} - 1``, this has no harmful cancellation.
* **heavy tokens** (the rest: at most ``4 t_hi`` of them, typically hundreds) use the positive
  prefix recursion of the elementary symmetric polynomials, vectorised over nodes.
* :math:`g` is computed exactly at **block boundaries** only; a block :math:`(a, b]` can hold the
  maximiser of :math:`g_k - p(A_k)` only if :math:`g_b - p(A_a)` reaches the best boundary value,
  and only such blocks are evaluated token by token.
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
#: Tokens per block of the coarse pass.
BLOCK = 128


def _stirling_coeffs(n_pow: int, terms: int) -> np.ndarray:
    """``[n_pow, terms]``: ``C[i-1, l-1]`` with :math:`(e^y - 1)^i = \\sum_l C_{il} y^l` (zero for ``l < i``)."""
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


class WorPrefixes:
    r""":math:`g_k = \Pr[\text{all drafts} \in A_k]` for the prefixes of ``qs`` (``[m]``, all positive).

    Build once, then call :meth:`at` for any set of prefix lengths, or :meth:`max_gap`.
    """

    def __init__(self, qs: np.ndarray, n: int):
        qs = np.asarray(qs, dtype=np.float64)
        m = qs.shape[0]
        if m <= n:
            raise ValueError("WorPrefixes needs more than n support tokens")
        self.qs, self.n, self.m = qs, n, m
        # mass outside each prefix A_k, k = 0..m (suffix sums: no cancellation near 1)
        suffix = np.concatenate([np.cumsum(qs[::-1])[::-1], [0.0]])  # [m+1]
        self.lam = suffix
        self.mu = float(np.partition(qs, m - n)[m - n])  # n-th largest q
        # slowest decay rate over the prefixes that matter (see docs/theory.md §3): for k with
        # lam_k >= mu the factor e^{-lam t} decays at least at rate mu; for the others the count
        # N_{A_k} reaches n at rate >= the n-th largest q of A_k >= that of A_{k0}
        below = np.flatnonzero(suffix[n:m] < self.mu)
        if below.size:
            k0 = n + int(below[0])
            kth = float(np.partition(qs[:k0], k0 - n)[k0 - n])
            rate = min(self.mu, kth)
        else:
            rate = self.mu
        t_hi = (40.0 + math.log(n)) / rate
        t_lo = (1e-18 * math.factorial(n)) ** (1.0 / (n + 1)) / max(1.0, self.mu)
        ys = np.arange(math.log(t_lo), math.log(t_hi) + LOG_STEP, LOG_STEP)
        self.t = np.exp(ys)  # [T] quadrature nodes
        self.log_v_guard = (690.0 - (n - 1) * math.log(m)) / max(1, n - 1)
        if self.log_v_guard < 25.0:
            raise QuickdraftError(f"num_drafts={n} is too large for the without-replacement quadrature at V={m}")
        # split into light and heavy tokens
        theta = LIGHT / float(self.t[-1])
        heavy = qs > theta
        self.heavy_pos = np.flatnonzero(heavy)  # [H] positions (0-based) in prefix order
        q_light = np.where(heavy, 0.0, qs)
        self.q_light = q_light
        # block moments of the light tokens, cumulated over blocks: boundary j = prefix length (j+1)*BLOCK
        nb = -(-m // BLOCK)
        padded = np.zeros(nb * BLOCK)
        padded[:m] = q_light
        blocks = padded.reshape(nb, BLOCK)
        mom = np.empty((nb, TAYLOR))
        powq = blocks.copy()
        for l in range(TAYLOR):
            mom[:, l] = powq.sum(axis=1)
            if l + 1 < TAYLOR:
                powq *= blocks
        self.nb = nb
        self.cum_mom = np.vstack([np.zeros((1, TAYLOR)), np.cumsum(mom, axis=0)])  # [nb+1, L], row j: first j blocks
        self.coef = _stirling_coeffs(n - 1, TAYLOR) if n > 1 else np.zeros((0, TAYLOR))  # [n-1, L]
        self.tpow = self.t[:, None] ** np.arange(1, TAYLOR + 1)[None, :]  # [T, L]
        self._heavy_esp()

    # ------------------------------------------------------------------------------------------
    def _heavy_esp(self) -> None:
        """Per node, the heavy part of the count's generating polynomial after each heavy token.

        Stores ``self.heavy_poly [T, H+1, n]``: coefficient of :math:`z^j` in
        :math:`\\prod_{x \\text{ heavy}, x \\le k} (e^{-q_x t} + (1 - e^{-q_x t}) z)` after the first ``k`` heavy
        tokens (row 0: no heavy token, the constant 1).
        """
        n = self.n
        qh = self.qs[self.heavy_pos]  # [H]
        t = self.t[:, None]
        x = qh[None, :] * t  # [T, H]
        sure = x > SURE
        r = np.where(sure, 0.0, np.expm1(np.where(sure, 0.0, x)))
        n_sure = np.concatenate([np.zeros((x.shape[0], 1), dtype=np.int64), np.cumsum(sure, axis=1)], axis=1)
        log_d0 = np.concatenate([np.zeros((x.shape[0], 1)), -np.cumsum(np.where(sure, 0.0, x), axis=1)], axis=1)
        esp = np.zeros((x.shape[0], x.shape[1] + 1, n))
        esp[:, :, 0] = 1.0
        for j in range(1, n):
            esp[:, 1:, j] = np.cumsum(r * esp[:, :-1, j - 1], axis=1)
        # shift by the surely-arrived count and scale by exp(log_d0) (in logs: e_j may be huge)
        poly = np.zeros_like(esp)
        with np.errstate(divide="ignore"):
            log_esp = np.log(esp)
        for deg in range(n):
            src = deg - n_sure  # [T, H+1]
            ok = src >= 0
            vals = np.take_along_axis(log_esp, np.clip(src, 0, n - 1)[..., None], axis=2)[..., 0]
            with np.errstate(under="ignore"):
                poly[:, :, deg] = np.where(ok, np.exp(vals + log_d0), 0.0)
        self.heavy_poly = poly

    # ------------------------------------------------------------------------------------------
    def _g(self, light_ps: np.ndarray, light_mass: np.ndarray, heavy_count: np.ndarray) -> np.ndarray:
        r"""``g`` for ``K`` prefixes from their light power sums ``[T, K, n-1]``, light mass ``[K]``, heavy count ``[K]``."""
        n = self.n
        lam = self.lam_for  # [K]
        light = _exp_series(light_ps, n) * np.exp(-light_mass[None, :, None] * self.t[:, None, None])  # [T, K, n]
        heavy = self.heavy_poly[:, heavy_count, :]  # [T, K, n]
        # G = sum_{a + b < n} heavy_a light_b
        light_cum = np.cumsum(light, axis=2)
        big_g = np.zeros(light.shape[:2])
        for a in range(n):
            big_g += heavy[:, :, a] * light_cum[:, :, n - 1 - a]
        big_g = np.clip(big_g, 0.0, 1.0)
        t = self.t[:, None]
        psi = (-np.expm1(-self.mu * t)) ** n  # [T, 1]
        with np.errstate(under="ignore"):
            weight = t * lam[None, :] * np.exp(-lam[None, :] * t)
        acc = (weight * ((1.0 - big_g) - psi)).sum(axis=0)
        i = np.arange(1, n + 1)[None, :]
        closed = np.prod(i * self.mu / (i * self.mu + lam[:, None]), axis=1)
        return LOG_STEP * acc + closed

    def _light_taylor(self, blk: np.ndarray) -> np.ndarray:
        """``[T, K, n-1]`` light power sums of the prefixes made of the first ``blk`` complete blocks."""
        if self.n == 1:
            return np.zeros((self.t.size, blk.size, 0))
        return np.einsum("kl,tl,il->tki", self.cum_mom[blk], self.tpow, self.coef)

    def at_boundaries(self, blk: np.ndarray) -> np.ndarray:
        """``g_k`` for ``k = blk * BLOCK`` (``blk``: ``[K]`` numbers of complete blocks, ``k <= m``)."""
        blk = np.asarray(blk, dtype=np.int64)
        return self._finish(blk * BLOCK, self._light_taylor(blk), self.cum_mom[blk, 0])

    def in_blocks(self, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Prefix lengths ``ks`` and ``g_k`` for every ``k`` in ``(j * BLOCK, (j+1) * BLOCK] ∩ [1, m]``, ``j`` in ``blocks``."""
        blocks = np.asarray(blocks, dtype=np.int64)
        n = self.n
        off = np.arange(1, BLOCK + 1)
        ks = blocks[:, None] * BLOCK + off[None, :]  # [R, b]
        ql = self.q_light[np.minimum(ks - 1, self.m - 1)] * (ks <= self.m)  # token k-1 closes prefix k
        ps = self._light_taylor(blocks)[:, :, None, :].repeat(BLOCK, axis=2)  # [T, R, b, n-1]
        r = np.expm1(ql[None, :, :] * self.t[:, None, None])  # [T, R, b]
        rp = r.copy()
        for i in range(n - 1):
            ps[..., i] += np.cumsum(rp, axis=2)
            rp *= r
        mass = self.cum_mom[blocks, 0][:, None] + np.cumsum(ql, axis=1)  # [R, b]
        keep = (ks <= self.m).ravel()
        t_count = self.t.size
        g = self._finish(ks.ravel()[keep], ps.reshape(t_count, -1, max(n - 1, 0))[:, keep, :], mass.ravel()[keep])
        return ks.ravel()[keep], g

    def _finish(self, kk: np.ndarray, ps: np.ndarray, mass: np.ndarray) -> np.ndarray:
        out = np.zeros(kk.shape[0])
        valid = kk >= self.n
        full = valid & (self.lam[kk] <= 0.0)
        out[full] = 1.0
        todo = valid & ~full
        if todo.any():
            k2 = kk[todo]
            heavy_count = np.searchsorted(self.heavy_pos, k2, side="left")
            self.lam_for = self.lam[k2]
            out[todo] = self._g(ps[:, todo, :], mass[todo], heavy_count)
        return np.clip(out, 0.0, 1.0)

    def all(self) -> np.ndarray:
        """``[m]``: ``g_k`` for ``k = 1..m`` (all prefixes; for tests)."""
        out = np.zeros(self.m)
        for i in range(0, self.nb, 32):
            ks, g = self.in_blocks(np.arange(i, min(i + 32, self.nb)))
            out[ks - 1] = g
        return out

    def max_gap(self, p_sorted: np.ndarray) -> float:
        r""":math:`\max_{0 \le k \le m} (g_k - p(A_k))` with ``p_sorted`` ``[m]`` the target mass in prefix order.

        Exact ``g`` at block boundaries gives a lower bound; a block :math:`(a, b]` is evaluated token by token
        only if its upper bound :math:`g_b - p(A_a)` reaches it (``g`` and ``p(A)`` are non-decreasing in ``k``).
        The last (partial) block is always evaluated token by token.
        """
        m, nb = self.m, self.nb
        p_cum = np.concatenate([[0.0], np.cumsum(p_sorted)])  # [m+1]
        full_blocks = m // BLOCK
        blk = np.arange(1, full_blocks + 1)
        g_b = self.at_boundaries(blk)
        best = max(0.0, float(np.max(g_b - p_cum[blk * BLOCK], initial=0.0)))
        last = [nb - 1] if m % BLOCK else []
        if last:
            ks, g = self.in_blocks(np.array(last))
            best = max(best, float(np.max(g - p_cum[ks])))
            g_end = float(g[-1])
        ends = np.concatenate([g_b, [g_end] if last else []])  # g at the end of each block
        starts = np.arange(nb) * BLOCK
        cand = np.flatnonzero(ends - p_cum[starts] > best - 1e-12)
        cand = cand[cand < full_blocks]
        for i in range(0, cand.size, 16):
            ks, g = self.in_blocks(cand[i : i + 16])
            best = max(best, float(np.max(g - p_cum[ks])))
        return best
