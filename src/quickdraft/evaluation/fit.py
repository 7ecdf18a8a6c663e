"""Goodness of fit of a sampler's counts against an exact law (Pearson's chi-square).

The statistical tests of every lossless path use it (``tests/conftest.py``), and so do the studies
that test another engine's sampler (``benchmarks/studies/genai_sampling_fit.py``).
"""

from __future__ import annotations

import numpy as np
from scipy import stats


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of observed ``counts`` against the exact ``probs`` (same shape).

    Cells expected below 5 are pooled into one bin (cells of probability 0 with them); where that
    bin's expected count is 0, an observation in it gives p = 0 (the sampler produced something the
    target never can).

    >>> round(chi_square_pvalue(np.array([50, 50]), np.array([0.5, 0.5])), 3)
    1.0
    >>> chi_square_pvalue(np.array([90, 10]), np.array([0.5, 0.5])) < 1e-10
    True
    """
    probs = probs.astype(np.float64) / probs.sum()
    expected = probs.ravel() * counts.sum()
    observed = counts.ravel()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0
        obs, exp = obs[:-1], exp[:-1]
    exp = exp * obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)
