"""Monte Carlo of the step-level sampler ``quickdraft.verification.multidraft.sample_step`` against the exact
acceptance rates of ``quickdraft.theory.verifier_acceptance``, for every valid (sampling, verifier) pair.

Separate from ``test_multidraft.py`` because 100,000 steps per case make it the slow part (about
1-2 min on the shared 2-core machine, dominated by K-SEQ's per-row bisection).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from quickdraft.theory import optimal_acceptance, verifier_acceptance

VERIFIER_MODES = [
    ("rrs", "with_replacement"),
    ("rrs", "without_replacement"),
    ("rrs", "greedy"),
    ("kseq", "with_replacement"),
    ("optimal_greedy", "greedy"),
]


def tv(p, q):
    return 0.5 * np.abs(p - q).sum()


# ---------------------------------------------------------------------------------------------------
# The step-level sampler (quickdraft.verification.multidraft.sample_step) against the exact rates
# ---------------------------------------------------------------------------------------------------

#: Distribution pairs for the Monte Carlo check (V = 6, n = 3 <= |supp q| for every scheme)
SAMPLER_CASES = {
    "random": (np.array([0.30, 0.05, 0.25, 0.10, 0.20, 0.10]), np.array([0.10, 0.30, 0.05, 0.25, 0.10, 0.20])),
    "peaked": (np.array([0.90, 0.02, 0.02, 0.02, 0.02, 0.02]), np.array([0.02, 0.85, 0.05, 0.04, 0.02, 0.02])),
    "nearly_disjoint": (np.array([0.5, 0.3, 0.2, 0.0, 0.0, 0.0]), np.array([0.0, 0.0, 0.05, 0.5, 0.3, 0.15])),
    "disjoint": (np.array([0.6, 0.4, 0.0, 0.0, 0.0, 0.0]), np.array([0.0, 0.0, 0.25, 0.25, 0.25, 0.25])),
}
SAMPLER_PAIRS = [(mode, ver) for ver, mode in VERIFIER_MODES]
SEEDS = {(m, v, c): 1000 + i for i, (m, v, c) in enumerate((m, v, c) for m, v in SAMPLER_PAIRS for c in SAMPLER_CASES)}
MC_SAMPLES = 100_000
#: |z| bound: two-sided 1e-7 per test, so all 20 tests pass together with probability > 0.999998
Z_BOUND = 5.33


def sampler_rate(p, q, n, mode, verifier, seed):
    torch = pytest.importorskip("torch")
    from quickdraft.verification.multidraft import sample_step

    gen = torch.Generator().manual_seed(seed)
    tp = torch.tensor(p, dtype=torch.float64).expand(MC_SAMPLES, -1).contiguous()
    dp = torch.tensor(q, dtype=torch.float64).expand(MC_SAMPLES, -1).contiguous()
    out = sample_step(tp, dp, n, mode, verifier, generator=gen)
    return float(out.accepted.double().mean())


@pytest.mark.parametrize("mode,verifier", SAMPLER_PAIRS)
@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_sample_step_matches_verifier_acceptance(mode, verifier, case):
    """Monte Carlo of sample_step (100,000 steps) lies in the binomial interval around the exact rate."""
    p, q = SAMPLER_CASES[case]
    n = 3
    exact = verifier_acceptance(p, q, n, mode, verifier)
    assert exact <= optimal_acceptance(p, q, n, mode) + 1e-12
    hat = sampler_rate(p, q, n, mode, verifier, seed=SEEDS[(mode, verifier, case)])
    if exact in (0.0, 1.0):
        assert hat == exact
        return
    se = math.sqrt(exact * (1 - exact) / MC_SAMPLES)
    assert abs(hat - exact) < Z_BOUND * se, (hat, exact)


@pytest.mark.parametrize("mode,verifier", SAMPLER_PAIRS)
def test_sample_step_negative_control(mode, verifier):
    """The same interval rejects the single-draft rate 1 - TV and, for greedy RRS, the (higher) rate of
    the optimal greedy verifier: the check has the power to see a wrong formula."""
    p, q = SAMPLER_CASES["random"]
    n = 3
    hat = sampler_rate(p, q, n, mode, verifier, seed=7)
    wrong = [1 - tv(p, q)]
    if (mode, verifier) == ("greedy", "rrs"):
        wrong.append(verifier_acceptance(p, q, n, "greedy", "optimal_greedy"))  # a different greedy verifier
    for w in wrong:
        se = math.sqrt(w * (1 - w) / MC_SAMPLES)
        assert abs(hat - w) > Z_BOUND * se, (hat, w)


def test_rrs_greedy_closed_form():
    """p(T) + sum_{x notin T} min(p(x), (1 - p(T)) q_R(x)), worked by hand for the 'random' case."""
    p, q = SAMPLER_CASES["random"]
    # top 2 of q: tokens 1 (0.30) and 3 (0.25); p(T) = 0.15; q_R on {0, 2, 4, 5} = q / 0.45
    p_top = 0.15
    rest = [0, 2, 4, 5]
    expected = p_top + sum(min(p[x], (1 - p_top) * q[x] / 0.45) for x in rest)
    assert verifier_acceptance(p, q, 3, "greedy", "rrs") == pytest.approx(expected, abs=1e-15)
    assert expected < verifier_acceptance(p, q, 3, "greedy", "optimal_greedy")
