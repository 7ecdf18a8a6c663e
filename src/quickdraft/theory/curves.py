r"""Every optimal and achieved acceptance rate at one position for ``n = 1 .. N``, sharing the work.

:func:`acceptance_curves` returns the same numbers as calling :func:`~quickdraft.theory.optimal_acceptance`
and :func:`~quickdraft.theory.verifier_acceptance` once per ``(n, scheme, verifier)``, but validates the
inputs once and sorts the vocabulary once: the :math:`p/q` order serves the prefix search of the optimal
rates (reversed, it is the :math:`q/p` order of ``docs/theory.md`` §2-3), the residual function
:math:`f(\lambda)` of RRS and K-SEQ's :math:`\beta(\rho)`. RRS with drafts sampled without replacement is
reported as a certified interval (:mod:`quickdraft.theory.rrs_wor`). It is what ``quickdraft analyze``
runs at each position (``V = 151,936``).
"""

from __future__ import annotations

import numpy as np

from quickdraft.theory import _validate
from quickdraft.theory._ratio import RatioProfile
from quickdraft.theory.multidraft import (
    _alpha_greedy_dual,
    _greedy_optimal_rate,
    _kseq_rate,
    _rrs_greedy_rate,
    _rrs_wr_reject_all,
    _wor_max_gap,
)
from quickdraft.theory.rrs_wor import rrs_without_replacement_interval

#: metric name -> (sampling scheme, verifier); verifier None means the optimal rate alpha*. RRS without
#: replacement has two entries, the ends of its certified interval.
METRICS: dict[str, tuple[str, str | None]] = {
    "optimal_with_replacement": ("with_replacement", None),
    "optimal_without_replacement": ("without_replacement", None),
    "optimal_greedy": ("greedy", None),
    "rrs_with_replacement": ("with_replacement", "rrs"),
    "kseq_with_replacement": ("with_replacement", "kseq"),
    "rrs_without_replacement_lower": ("without_replacement", "rrs"),
    "rrs_without_replacement_upper": ("without_replacement", "rrs"),
    "rrs_greedy": ("greedy", "rrs"),
    "optimal_greedy_verifier": ("greedy", "optimal_greedy"),
}


def acceptance_curves(
    target_probs, draft_probs, max_drafts: int, rrs_wor_expansions: int = 64, rrs_wor_children: int = 8
) -> dict[str, list[float]]:
    r"""All rates of :data:`METRICS` for ``n = 1 .. max_drafts`` at one position.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` target and draft distributions.
    max_drafts:
        Largest number of drafts ``N``.
    rrs_wor_expansions, rrs_wor_children:
        Budget of :func:`~quickdraft.theory.rrs_wor.rrs_without_replacement_interval`; RRS without
        replacement is reported as a certified interval (``..._lower <= exact <= ..._upper``).

    Returns
    -------
    dict
        metric name -> list of ``N`` rates (index ``n - 1``).

    Examples
    --------
    >>> c = acceptance_curves([0.5, 0.3, 0.2], [0.2, 0.3, 0.5], 2)
    >>> round(c["optimal_with_replacement"][0], 12), round(c["rrs_with_replacement"][0], 12)  # 1 - TV
    (0.7, 0.7)
    """
    p, q = _validate.pair(target_probs, draft_probs)
    n_max = _validate.num_drafts(max_drafts, "max_drafts")
    prof = RatioProfile(p, q)
    # prefix order of alpha*: q/p non-increasing with the q = 0 tokens last, i.e. the p/q order reversed
    # (prof.order puts q = 0, ratio +inf, first); only the first m = |supp q| prefixes count
    m = int(np.count_nonzero(q))
    order = prof.order[::-1][:m]
    qs, ps = q[order], p[order]
    p_cum = np.concatenate([[0.0], np.cumsum(ps)])  # [m+1]
    q_cum = np.concatenate([[0.0], np.cumsum(qs)])  # [m+1]
    ns = range(1, n_max + 1)
    out: dict[str, list[float]] = {}
    out["optimal_with_replacement"] = [_clip(1.0 - max(0.0, float(np.max(q_cum**n - p_cum)))) for n in ns]
    out["optimal_without_replacement"] = [_clip(1.0 - max(0.0, _wor_max_gap(qs, ps, p_cum, n))) for n in ns]
    out["optimal_greedy"] = [_alpha_greedy_dual(p, q, n) for n in ns]
    out["rrs_with_replacement"] = [_clip(1.0 - _rrs_wr_reject_all(prof, n)) for n in ns]
    out["kseq_with_replacement"] = [_kseq_rate(prof, n) for n in ns]
    iv = rrs_without_replacement_interval(p, q, n_max, rrs_wor_expansions, rrs_wor_children, profile=prof)
    out["rrs_without_replacement_lower"] = [float(x) for x in iv.lower]
    out["rrs_without_replacement_upper"] = [float(x) for x in iv.upper]
    out["rrs_greedy"] = [_rrs_greedy_rate(p, q, n) for n in ns]
    out["optimal_greedy_verifier"] = [_greedy_optimal_rate(p, q, n) for n in ns]
    return out


def _clip(x: float) -> float:
    return float(min(1.0, max(0.0, x)))
