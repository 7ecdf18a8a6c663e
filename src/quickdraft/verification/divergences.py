"""Divergences between the target's and the draft's next-token distributions.

Pure, batched functions over the last dimension: every function takes ``target_probs [..., V]``
and ``draft_probs [..., V]`` (in that order) and returns ``[...]``. Used by Fuzzy Speculative
Decoding (:class:`quickdraft.verification.rules.Fuzzy`), which accepts a draft position when the divergence
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
``js``          :math:`\\tfrac12 \\mathrm{KL}(m \\| p) + \\tfrac12 \\mathrm{KL}(m \\| q)`    [0, ∞]
``jsd``         :math:`\\tfrac12 \\mathrm{KL}(p \\| m) + \\tfrac12 \\mathrm{KL}(q \\| m)`    [0, ln 2]
``tv``          :math:`\\tfrac12 \\sum_v |p_v - q_v|`                                      [0, 1]
==============  =====================================================================  ==========

``kl`` is the direction the FSD reference code computes for ``kl_div``
(``torch.nn.functional.kl_div(log p, q)`` = KL(q‖p)). ``js`` is what that code computes for
``js_div`` (``kl_div(log p, m)`` + ``kl_div(log q, m)``, halved) and what FSD's quoted thresholds
(e.g. 0.4) refer to: the KL divergences *from* the mixture, unbounded. ``jsd`` is the textbook
Jensen–Shannon divergence [2]_, the KL divergences *to* the mixture, at most ln 2. The two are
different quantities (``js >= jsd``, with equality only where p = q), so a threshold of one
does not carry over to the other. The reference code smooths the processed distributions with
1e-10 before this; quickdraft does not, so ``js`` is infinite when the supports differ (the raw,
temperature-1 softmax distributions FSD uses by default have full support). ``js_fsd`` (and
``topk_js_fsd``) is a deprecated name of ``js`` (``topk_js``): it still works, with a
:class:`DeprecationWarning` (:func:`canonical_name`).

``topk_<name>`` applies ``<name>`` to the distributions coarsened to the target's ``top_k`` most
likely tokens plus one bucket holding the rest of the mass (:func:`bucket_top_k`); FSD's code uses
``top_k = 50``.

``topp_<name>`` applies ``<name>`` to the distributions restricted to the target's top-p nucleus
(the smallest set of its most likely tokens whose probability reaches ``top_p``) and renormalised
on it (:func:`restrict_top_p`), as FSD's code does for its top-p divergences (which also keeps the
next token when the cumulative mass equals ``top_p`` exactly); ``top_p = 0.9`` by default here
(FSD's code leaves it unset).

References
----------
.. [1] M. Holsman, Y. Huang, B. Dhingra, "Fuzzy Speculative Decoding for a Tunable
   Accuracy-Runtime Tradeoff", Findings of ACL 2025, arXiv:2502.20704.
.. [2] J. Lin, "Divergence measures based on the Shannon entropy", IEEE Trans. Inf. Theory 37(1),
   1991 (the Jensen–Shannon divergence and its ln 2 bound).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable

import torch

from quickdraft.errors import QuickdraftError

#: a divergence: ``(target_probs [..., V], draft_probs [..., V]) -> [...]``
DivergenceFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: FSD's reference code coarsens to the target's 50 most likely tokens
DEFAULT_TOP_K = 50

#: the nucleus of the ``topp_*`` divergences (FSD's code leaves it unset)
DEFAULT_TOP_P = 0.9

_LN2 = 0.6931471805599453  # the Jensen–Shannon divergence's upper bound (nats)

#: deprecated name -> its replacement (accepted with a DeprecationWarning)
DEPRECATED_NAMES: dict[str, str] = {"js_fsd": "js", "topk_js_fsd": "topk_js"}


def _warn_deprecated(name: str) -> None:
    warnings.warn(
        f"divergence {name!r} is deprecated; use {DEPRECATED_NAMES[name]!r} (the same quantity, "
        "FSD's \"JS\"); the textbook Jensen–Shannon divergence is 'jsd'",
        DeprecationWarning,
        stacklevel=3,
    )


def canonical_name(name: str) -> str:
    """``name`` with a deprecated alias replaced by its current name (and a DeprecationWarning).

    >>> canonical_name("jsd")
    'jsd'
    """
    if name in DEPRECATED_NAMES:
        _warn_deprecated(name)
        return DEPRECATED_NAMES[name]
    return name


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
    """FSD's "JS": ½KL(m‖p) + ½KL(m‖q), m = (p+q)/2 — KL *from* the mixture; in [0, ∞]."""
    m = 0.5 * (target_probs + draft_probs)
    return 0.5 * (_kl(m, target_probs) + _kl(m, draft_probs))


def jsd(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Textbook Jensen–Shannon divergence ½KL(p‖m) + ½KL(q‖m), m = (p+q)/2; in [0, ln 2]."""
    m = 0.5 * (target_probs + draft_probs)
    return (0.5 * (_kl(target_probs, m) + _kl(draft_probs, m))).clamp_max(_LN2)


def js_fsd(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Deprecated name of :func:`js` (warns)."""
    _warn_deprecated("js_fsd")
    return js(target_probs, draft_probs)


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


def _named(wrapped: Callable[..., torch.Tensor], prefix: str, fn: DivergenceFn, how: str) -> Callable[..., torch.Tensor]:
    """Name ``wrapped`` ``<prefix>_<fn>`` and document it as ``fn`` computed ``how``."""
    wrapped.__name__ = f"{prefix}_{fn.__name__}"
    wrapped.__qualname__ = wrapped.__name__
    wrapped.__doc__ = f"``{fn.__name__}`` {how}.\n\n{fn.__name__}: {fn.__doc__}"
    return wrapped


def _top_k_version(fn: DivergenceFn) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def wrapped(target_probs: torch.Tensor, draft_probs: torch.Tensor, top_k: int = DEFAULT_TOP_K) -> torch.Tensor:
        return fn(*bucket_top_k(target_probs, draft_probs, top_k))

    return _named(wrapped, "topk", fn, "on the target's top-k tokens plus one bucket for the rest (:func:`bucket_top_k`)")


topk_kl = _top_k_version(kl)
topk_kl_reverse = _top_k_version(kl_reverse)
topk_js = _top_k_version(js)
topk_jsd = _top_k_version(jsd)
topk_tv = _top_k_version(tv)


def topk_js_fsd(target_probs: torch.Tensor, draft_probs: torch.Tensor, top_k: int = DEFAULT_TOP_K) -> torch.Tensor:
    """Deprecated name of :func:`topk_js` (warns)."""
    _warn_deprecated("topk_js_fsd")
    return topk_js(target_probs, draft_probs, top_k)


def restrict_top_p(
    target_probs: torch.Tensor, draft_probs: torch.Tensor, top_p: float = DEFAULT_TOP_P
) -> tuple[torch.Tensor, torch.Tensor]:
    """Restrict both distributions to the target's top-p nucleus and renormalise them on it.

    The nucleus is the smallest set of the target's most likely tokens whose total probability
    reaches ``top_p``: token v is in it when the tokens ranked before it hold less than ``top_p``
    (ties ranked by token id, lowest first). Outside the nucleus both distributions are set to 0;
    inside, each is divided by its own mass there.

    Parameters
    ----------
    target_probs, draft_probs:
        ``[..., V]``.
    top_p:
        Nucleus mass, in ``(0, 1]``; ``1`` keeps every token (the distributions themselves).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]
        ``[..., V]`` each. Where the draft has no mass on the nucleus its restriction is all
        ``NaN`` (0/0): there is no renormalised draft, and the ``topp_*`` divergences are ``+inf``.

    Examples
    --------
    Target ``[0.5, 0.1, 0.3, 0.1]``, ``top_p = 0.7``: the target's ranking is tokens 0, 2, 1, 3,
    and 0.5 < 0.7 <= 0.5 + 0.3, so the nucleus is {0, 2}:

    >>> t, d = restrict_top_p(torch.tensor([0.5, 0.1, 0.3, 0.1]), torch.tensor([0.2, 0.4, 0.2, 0.2]), 0.7)
    >>> t, d
    (tensor([0.6250, 0.0000, 0.3750, 0.0000]), tensor([0.5000, 0.0000, 0.5000, 0.0000]))
    """
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise QuickdraftError(f"top_p must be a number in (0, 1], got {top_p!r}")
    sorted_target, order = torch.sort(target_probs, dim=-1, descending=True, stable=True)  # [..., V]
    mass_before = torch.cumsum(sorted_target, dim=-1) - sorted_target  # [..., V] mass ranked above
    nucleus = torch.zeros_like(target_probs, dtype=torch.bool).scatter_(-1, order, mass_before < top_p)
    zero = torch.zeros_like(target_probs)
    target_in = torch.where(nucleus, target_probs, zero)
    draft_in = torch.where(nucleus, draft_probs, zero)
    return target_in / target_in.sum(-1, keepdim=True), draft_in / draft_in.sum(-1, keepdim=True)


def _top_p_version(fn: DivergenceFn) -> Callable[..., torch.Tensor]:
    @functools.wraps(fn)
    def wrapped(target_probs: torch.Tensor, draft_probs: torch.Tensor, top_p: float = DEFAULT_TOP_P) -> torch.Tensor:
        restricted_target, restricted_draft = restrict_top_p(target_probs, draft_probs, top_p)
        no_draft_mass = restricted_draft.isnan().any(dim=-1)  # [...]
        value = fn(restricted_target, torch.nan_to_num(restricted_draft, nan=0.0))
        return torch.where(no_draft_mass, torch.full_like(value, math.inf), value)

    return _named(wrapped, "topp", fn, "on the target's top-p nucleus, both distributions renormalised there "
                  "(:func:`restrict_top_p`); ``+inf`` where the draft has no mass on the nucleus")


topp_kl = _top_p_version(kl)
topp_kl_reverse = _top_p_version(kl_reverse)
topp_js = _top_p_version(js)
topp_jsd = _top_p_version(jsd)
topp_tv = _top_p_version(tv)

_BASE: dict[str, DivergenceFn] = {"kl": kl, "kl_reverse": kl_reverse, "js": js, "jsd": jsd, "tv": tv}
_TOP_K: dict[str, Callable[..., torch.Tensor]] = {
    "topk_kl": topk_kl,
    "topk_kl_reverse": topk_kl_reverse,
    "topk_js": topk_js,
    "topk_jsd": topk_jsd,
    "topk_tv": topk_tv,
}
_TOP_P: dict[str, Callable[..., torch.Tensor]] = {
    "topp_kl": topp_kl,
    "topp_kl_reverse": topp_kl_reverse,
    "topp_js": topp_js,
    "topp_jsd": topp_jsd,
    "topp_tv": topp_tv,
}

#: name -> divergence ``(target_probs, draft_probs) -> [...]`` (``topk_*`` with ``top_k = 50``,
#: ``topp_*`` with ``top_p = 0.9``); the choices of the CLI's ``--divergence``
DIVERGENCES: dict[str, DivergenceFn] = {**_BASE, **_TOP_K, **_TOP_P}


def get_divergence(name: str, top_k: int = DEFAULT_TOP_K, top_p: float = DEFAULT_TOP_P) -> DivergenceFn:
    """The divergence called ``name`` as a two-argument function (``top_k`` bound for ``topk_*``,
    ``top_p`` for ``topp_*``); a deprecated name (:data:`DEPRECATED_NAMES`) warns and resolves."""
    name = canonical_name(name)
    if name in _BASE:
        return _BASE[name]
    if name in _TOP_K:
        bucket_top_k(torch.ones(1), torch.ones(1), top_k)  # validates top_k
        return functools.partial(_TOP_K[name], top_k=top_k)
    if name in _TOP_P:
        restrict_top_p(torch.ones(1), torch.ones(1), top_p)  # validates top_p
        return functools.partial(_TOP_P[name], top_p=top_p)
    raise QuickdraftError(f"unknown divergence {name!r}; choose one of {', '.join(DIVERGENCES)}")
