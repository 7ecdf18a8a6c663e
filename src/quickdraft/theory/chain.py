r"""Chain speculative decoding: acceptance, expected tokens per target call, speed-up.

With per-token acceptance rate :math:`\alpha` assumed i.i.d. across positions (Leviathan et al.
2023, §3.1), a draft of length :math:`k` yields

.. math::

    \mathbb{E}[\text{tokens per target call}] = \sum_{i=0}^{k} \alpha^i = \frac{1 - \alpha^{k+1}}{1 - \alpha}

(accepted tokens plus the one recovered-or-bonus token; this is the *mean acceptance length* of
:mod:`quickdraft.verification.verify`), and with draft cost :math:`c` (one draft forward over one target forward)
the walltime speed-up over plain decoding is (Leviathan et al. 2023, Thm. 3.8)

.. math::

    S(\alpha, k, c) = \frac{1 - \alpha^{k+1}}{(1 - \alpha)(1 + k c)}.

References
----------
.. [1] Y. Leviathan, M. Kalman, Y. Matias. "Fast Inference from Transformers via Speculative
   Decoding", ICML 2023, arXiv:2211.17192 (Def. 3.1, eq. (1), Thm. 3.8).
.. [2] C. Chen et al. "Accelerating Large Language Model Decoding with Speculative Sampling",
   arXiv:2302.01318.
"""

from __future__ import annotations

import numpy as np

from quickdraft.errors import QuickdraftError
from quickdraft.theory import _validate


def chain_acceptance(target_probs, draft_probs) -> float:
    r"""Acceptance rate of lossless speculative sampling at one position: :math:`1 - \mathrm{TV}(p, q)`.

    .. math:: \alpha = \sum_x \min(p(x), q(x)) = 1 - \tfrac12 \sum_x |p(x) - q(x)|

    Parameters
    ----------
    target_probs, draft_probs:
        ``[V]`` distributions :math:`p` and :math:`q`.
    """
    p, q = _validate.pair(target_probs, draft_probs)
    return float(min(1.0, np.minimum(p, q).sum()))


def _check_k(k, name: str = "k") -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise QuickdraftError(f"{name} must be an integer >= 0, got {k!r}")
    return int(k)


def expected_tokens_per_call(alpha: float, k: int) -> float:
    r"""Expected tokens emitted per target call with draft length ``k``: :math:`(1-\alpha^{k+1})/(1-\alpha)`.

    Equals :math:`k + 1` at :math:`\alpha = 1` (the limit), 1 at :math:`\alpha = 0` or :math:`k = 0`.
    """
    a = _validate.probability(alpha, "alpha")
    k = _check_k(k)
    if a == 1.0:
        return float(k + 1)
    # sum_{i=0}^{k} a^i, written to stay accurate near a = 1
    return float(-np.expm1((k + 1) * np.log(a)) / (1.0 - a)) if a > 0 else 1.0


def speedup(alpha: float, k: int, cost_ratio: float) -> float:
    r"""Walltime speed-up :math:`\frac{1-\alpha^{k+1}}{(1-\alpha)(1+kc)}` (Leviathan et al. 2023, Thm. 3.8).

    Parameters
    ----------
    alpha:
        Per-token acceptance rate in [0, 1].
    k:
        Draft length (``>= 0``).
    cost_ratio:
        :math:`c \ge 0`, the time of one draft forward divided by one target forward.
    """
    c = float(cost_ratio)
    if not np.isfinite(c) or c < 0:
        raise QuickdraftError(f"cost_ratio must be a finite number >= 0, got {cost_ratio!r}")
    return expected_tokens_per_call(alpha, k) / (1.0 + _check_k(k) * c)


def best_draft_length(alpha: float, cost_ratio: float, max_k: int) -> int:
    """The draft length ``k`` in ``0..max_k`` maximising :func:`speedup` (smallest on ties)."""
    max_k = _check_k(max_k, "max_k")
    values = [speedup(alpha, k, cost_ratio) for k in range(max_k + 1)]
    return int(np.argmax(values))
