"""Input checks shared by the theory functions (numpy in, numpy out).

Every public function of :mod:`quickdraft.theory` calls these at entry, so a bad input raises
:class:`~quickdraft.errors.QuickdraftError` with a message naming the problem instead of a NaN or a
silent wrong answer.
"""

from __future__ import annotations

import numpy as np

from quickdraft.errors import QuickdraftError

#: Tolerance on ``|sum(probs) - 1|`` (float32 softmax outputs at V = 151,936 sum to 1 within ~1e-5).
SUM_TOL = 1e-4

SAMPLINGS = ("with_replacement", "without_replacement", "greedy")
VERIFIERS = ("rrs", "kseq", "optimal_greedy")


def as_distribution(probs, name: str) -> np.ndarray:
    """Return ``probs`` as a float64 vector ``[V]`` renormalised to sum 1, or raise.

    Accepts numpy arrays, lists and torch tensors (anything ``np.asarray`` understands).
    """
    try:
        arr = np.asarray(probs.detach().cpu() if hasattr(probs, "detach") else probs, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise QuickdraftError(f"{name} must be a vector of probabilities: {exc}") from None
    if arr.ndim != 1:
        raise QuickdraftError(f"{name} must be a 1-D vector [V], got shape {arr.shape}")
    if arr.size == 0:
        raise QuickdraftError(f"{name} is empty")
    if np.isnan(arr).any():
        raise QuickdraftError(f"{name} contains NaN")
    if not np.isfinite(arr).all():
        raise QuickdraftError(f"{name} contains inf")
    if (arr < 0).any():
        raise QuickdraftError(f"{name} has negative entries (min {arr.min():.3g})")
    total = arr.sum()
    if abs(total - 1.0) > SUM_TOL:
        raise QuickdraftError(f"{name} is not a distribution: it sums to {total:.6g}, not 1")
    return arr / total


def pair(target_probs, draft_probs) -> tuple[np.ndarray, np.ndarray]:
    """Validate a (target, draft) pair of distributions over the same vocabulary."""
    p = as_distribution(target_probs, "target_probs")
    q = as_distribution(draft_probs, "draft_probs")
    if p.shape != q.shape:
        raise QuickdraftError(f"target_probs and draft_probs differ in vocabulary size: {p.shape[0]} vs {q.shape[0]}")
    return p, q


def num_drafts(n, name: str = "num_drafts") -> int:
    """Validate a positive integer count."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise QuickdraftError(f"{name} must be an integer >= 1, got {n!r}")
    if n < 1:
        raise QuickdraftError(f"{name} must be >= 1, got {n}")
    return int(n)


def sampling(s) -> str:
    if s not in SAMPLINGS:
        raise QuickdraftError(f"unknown sampling {s!r}; expected one of {', '.join(SAMPLINGS)}")
    return s


def verifier(v) -> str:
    if v not in VERIFIERS:
        raise QuickdraftError(f"unknown verifier {v!r}; expected one of {', '.join(VERIFIERS)}")
    return v


def probability(x, name: str) -> float:
    """Validate a number in [0, 1]."""
    try:
        val = float(x)
    except (TypeError, ValueError):
        raise QuickdraftError(f"{name} must be a number in [0, 1], got {x!r}") from None
    if not (0.0 <= val <= 1.0):
        raise QuickdraftError(f"{name} must be in [0, 1], got {x!r}")
    return val
