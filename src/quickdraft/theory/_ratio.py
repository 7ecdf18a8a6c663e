r"""The residual mass function :math:`f(\lambda) = \sum_x (p(x) - \lambda q(x))^+` after one sort.

Every residual that recursive rejection sampling produces has the form
:math:`\mathrm{norm}((p - \lambda q)^+)` for a scalar threshold :math:`\lambda` (``docs/theory.md`` §5), and
K-SEQ's :math:`\beta(\rho) = \sum_x \min(q, p/\rho) = (1 - f(\rho))/\rho`. With the tokens sorted by
:math:`p/q` decreasing and prefix sums of ``p`` and ``q``, :math:`f(\lambda) = P_k - \lambda Q_k` with
:math:`k = \#\{x : p(x)/q(x) > \lambda\}`, one binary search per :math:`\lambda`.
"""

from __future__ import annotations

import numpy as np


class RatioProfile:
    r"""Tokens in the order of :math:`p/q` decreasing, with prefix sums, for fast :math:`f(\lambda)`.

    Parameters
    ----------
    p, q:
        ``[V]`` target and draft distributions (validated, float64).

    Attributes
    ----------
    order:
        ``[V]`` token ids by :math:`p/q` decreasing; tokens with ``q = 0`` (ratio :math:`+\infty`) first.
        Reversed, it is an order of :math:`q/p` non-increasing with the ``q = 0`` tokens last, which is
        the prefix order of the optimal acceptance rate (``docs/theory.md`` §2-3).
    ratio:
        ``[V]`` :math:`p/q` in that order (non-increasing; :math:`+\infty` where ``q = 0``).
    """

    def __init__(self, p: np.ndarray, q: np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(q > 0, p / np.where(q > 0, q, 1.0), np.inf)  # [V]
        self.order = np.argsort(-ratio)  # [V]
        self.ratio = ratio[self.order]  # [V] non-increasing
        self._neg_ratio = -self.ratio  # [V] non-decreasing, for searchsorted
        self.p_cum = np.concatenate([[0.0], np.cumsum(p[self.order])])  # [V+1]
        self.q_cum = np.concatenate([[0.0], np.cumsum(q[self.order])])  # [V+1]

    def f(self, lam):
        r""":math:`f(\lambda) = \sum_x (p(x) - \lambda q(x))^+` for a scalar or array of :math:`\lambda \ge 0`.

        Non-increasing and convex; :math:`f(0) = 1`, :math:`f(1) = \mathrm{TV}(p, q)`; for finite
        :math:`\lambda` the tokens with ``q = 0 < p`` always count with their full ``p``. By convention
        :math:`f(\infty) = 0` (used only when no draft mass is left).
        """
        lam = np.asarray(lam, dtype=np.float64)
        k = np.searchsorted(self._neg_ratio, -lam, side="left")  # tokens with ratio > lam
        with np.errstate(invalid="ignore"):
            val = self.p_cum[k] - np.where(self.q_cum[k] > 0, lam * self.q_cum[k], 0.0)
        out = np.maximum(val, 0.0)
        return float(out) if out.ndim == 0 else out
