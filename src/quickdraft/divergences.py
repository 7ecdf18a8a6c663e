"""Divergences between the target's and the draft's next-token distributions.

Pure, batched functions over the last dimension: every function takes ``target_probs [..., V]``
and ``draft_probs [..., V]`` (in that order) and returns ``[...]``. Used by Fuzzy Speculative
Decoding (:class:`quickdraft.rules.Fuzzy`), which accepts a draft position when the divergence
between the two distributions is at most a threshold.

Zeros are handled exactly: :math:`0 \\log 0 = 0` and :math:`0 \\log(0 / y) = 0`, while
:math:`x \\log(x / 0) = +\\infty` for :math:`x > 0` — a KL divergence is infinite when the second
distribution misses part of the first one's support. No epsilon smoothing.

With :math:`p` = target, :math:`q` = draft, :math:`m = (p + q)/2` (natural logarithms, nats):

==============  =====================================================================  ==========
name            definition                                                             range
==============  =====================================================================  ==========
``kl``          :math:`\\mathrm{KL}(q \\| p) = \\sum_v q_v \\log(q_v / p_v)`              [0, ∞]
``kl_reverse``  :math:`\\mathrm{KL}(p \\| q)`                                            [0, ∞]
``js``          :math:`\\tfrac12 \\mathrm{KL}(p \\| m) + \\tfrac12 \\mathrm{KL}(q \\| m)`    [0, ln 2]
``js_fsd``      :math:`\\tfrac12 \\mathrm{KL}(m \\| p) + \\tfrac12 \\mathrm{KL}(m \\| q)`    [0, ∞]
``tv``          :math:`\\tfrac12 \\sum_v |p_v - q_v|`                                      [0, 1]
==============  =====================================================================  ==========

``kl`` is the direction the FSD reference code computes for ``kl_div``
(``torch.nn.functional.kl_div(log p, q)`` = KL(q‖p)). ``js_fsd`` is what that code computes for
``js_div`` (``kl_div(log p, m)`` + ``kl_div(log q, m)``, halved): the KL divergences *from* the
mixture, not the textbook Jensen–Shannon divergence; it is unbounded and is what FSD's quoted
thresholds (e.g. 0.4) refer to. The reference code smooths the processed distributions with 1e-10
before this; quickdraft does not, so ``js_fsd`` is infinite when the supports differ (the raw,
temperature-1 softmax distributions FSD uses by default have full support).

``topk_<name>`` applies ``<name>`` to the distributions coarsened to the target's ``top_k`` most
likely tokens plus one bucket holding the rest of the mass (:func:`bucket_top_k`); FSD's code uses
``top_k = 50``.

References
----------
.. [1] M. Holsman, Y. Huang, B. Dhingra, "Fuzzy Speculative Decoding for a Tunable
   Accuracy-Runtime Tradeoff", Findings of ACL 2025, arXiv:2502.20704.
.. [2] J. Lin, "Divergence measures based on the Shannon entropy", IEEE Trans. Inf. Theory 37(1),
   1991 (the Jensen–Shannon divergence and its ln 2 bound).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from quickdraft.errors import QuickdraftError

#: a divergence: ``(target_probs [..., V], draft_probs [..., V]) -> [...]``
DivergenceFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: FSD's reference code coarsens to the target's 50 most likely tokens
DEFAULT_TOP_K = 50

_LN2 = 0.6931471805599453  # the JS divergence's upper bound (nats)


def rel_entr(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Elementwise :math:`x \\log(x / y)` with ``0`` where ``x = 0`` and ``+inf`` where ``x > 0 = y``.

    Same convention as ``scipy.special.rel_entr``.
    """
    # where x = 0 the discarded branch may hold NaN (0/0) or -inf; torch.where never propagates it
    return torch.where(x > 0, x * torch.log(x / y), 0.0)


def _kl(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:math:`\\mathrm{KL}(x \\| y)` over the last dim, clamped at 0 against rounding."""
    return rel_entr(x, y).sum(dim=-1).clamp_min(0.0)


def kl(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """KL(draft ‖ target) = Σ q log(q/p): infinite where the draft has mass the target lacks."""
    return _kl(draft_probs, target_probs)


def kl_reverse(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """KL(target ‖ draft) = Σ p log(p/q): infinite where the target has mass the draft lacks."""
    return _kl(target_probs, draft_probs)


def js(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Textbook Jensen–Shannon divergence ½KL(p‖m) + ½KL(q‖m), m = (p+q)/2; in [0, ln 2]."""
    m = 0.5 * (target_probs + draft_probs)
    return (0.5 * (_kl(target_probs, m) + _kl(draft_probs, m))).clamp_max(_LN2)


def js_fsd(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """FSD's "JS": ½KL(m‖p) + ½KL(m‖q), m = (p+q)/2 — KL *from* the mixture; unbounded."""
    m = 0.5 * (target_probs + draft_probs)
    return 0.5 * (_kl(m, target_probs) + _kl(m, draft_probs))


def tv(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Total variation distance ½ Σ |p − q|; in [0, 1]."""
    return (0.5 * (target_probs - draft_probs).abs().sum(dim=-1)).clamp(0.0, 1.0)



def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy −Σ p log p (nats) over the last dim, with 0 log 0 = 0."""
    return -torch.special.xlogy(probs, probs).sum(dim=-1)


def bucket_top_k(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, top_k: int = DEFAULT_TOP_K
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coarsen both distributions to the target's ``top_k`` tokens plus one bucket for the rest.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[..., V]``.
    top_k:
        Number of the target's most likely tokens kept (``>= 1``; capped at V).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``[..., k+1]`` each: the probabilities of the target's top-k tokens (same tokens for both),
        then the remaining mass. The bucket is summed over the other tokens (not ``1 − Σ top-k``),
        so it is exactly 0 when they are all 0.
    """
    if int(top_k) != top_k or top_k < 1:
        raise QuickdraftError(f"top_k must be an integer >= 1, got {top_k!r}")
    k = min(int(top_k), target_probs.shape[-1])
    top_target, idx = torch.topk(target_probs, k, dim=-1)
    top_draft = draft_probs.gather(-1, idx)
    rest = torch.ones_like(target_probs, dtype=torch.bool).scatter_(-1, idx, False)
    rest_target = torch.where(rest, target_probs, torch.zeros_like(target_probs)).sum(dim=-1, keepdim=True)
    rest_draft = torch.where(rest, draft_probs, torch.zeros_like(draft_probs)).sum(dim=-1, keepdim=True)
    return torch.cat([top_target, rest_target], dim=-1), torch.cat([top_draft, rest_draft], dim=-1)


def _top_k_version(fn: DivergenceFn) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def wrapped(target_probs: torch.Tensor, draft_probs: torch.Tensor, top_k: int = DEFAULT_TOP_K) -> torch.Tensor:
        return fn(*bucket_top_k(target_probs, draft_probs, top_k))

    wrapped.__name__ = f"topk_{fn.__name__}"
    wrapped.__qualname__ = wrapped.__name__
    wrapped.__doc__ = (
        f"``{fn.__name__}`` on the target's top-k tokens plus one bucket for the rest "
        f"(:func:`bucket_top_k`).\n\n{fn.__name__}: {fn.__doc__}"
    )
    return wrapped


topk_kl = _top_k_version(kl)
topk_kl_reverse = _top_k_version(kl_reverse)
topk_js = _top_k_version(js)
topk_js_fsd = _top_k_version(js_fsd)
topk_tv = _top_k_version(tv)

_BASE: dict[str, DivergenceFn] = {"kl": kl, "kl_reverse": kl_reverse, "js": js, "js_fsd": js_fsd, "tv": tv}
_TOP_K: dict[str, Callable[..., torch.Tensor]] = {
    "topk_kl": topk_kl,
    "topk_kl_reverse": topk_kl_reverse,
    "topk_js": topk_js,
    "topk_js_fsd": topk_js_fsd,
    "topk_tv": topk_tv,
}

#: name -> divergence ``(target_probs, draft_probs) -> [...]`` (``topk_*`` with ``top_k = 50``);
#: the choices of the CLI's ``--divergence``
DIVERGENCES: dict[str, DivergenceFn] = {**_BASE, **_TOP_K}


def get_divergence(name: str, top_k: int = DEFAULT_TOP_K) -> DivergenceFn:
    """The divergence called ``name`` as a two-argument function (``top_k`` bound for ``topk_*``)."""
    if name in _BASE:
        return _BASE[name]
    if name in _TOP_K:
        bucket_top_k(torch.ones(1), torch.ones(1), top_k)  # validates top_k
        return functools.partial(_TOP_K[name], top_k=top_k)
    raise QuickdraftError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")
