"""Shared-sort rates (``theory.curves``), the f(lambda) forms of RRS / K-SEQ, and the certified RRS
without-replacement interval (``theory.rrs_wor``) against exact recursions and Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.theory import multidraft as md
from quickdraft.theory import optimal_acceptance, verifier_acceptance
from quickdraft.theory._ratio import RatioProfile
from quickdraft.theory.curves import METRICS, acceptance_curves
from quickdraft.theory.rrs_wor import rrs_without_replacement_interval

from .test_multidraft import random_pair


def rrs_wr_direct(p, q, n):
    """RRS with i.i.d. drafts straight from the definition: 1 - prod_i TV(p_i, q), p_{i+1} = norm((p_i - q)^+)."""
    reject, cur = 1.0, p
    for _ in range(n):
        resid = np.maximum(cur - q, 0.0)
        tv = resid.sum()
        reject *= tv
        if tv <= 0:
            break
        cur = resid / tv
    return 1.0 - reject


def kseq_direct(p, q, n):
    """K-SEQ from SpecTr's definition: bisection on h(rho) = 1 - (1 - beta)^n - rho beta, beta = sum min(q, p/rho)."""
    def h(rho):
        beta = np.minimum(q, p / rho).sum()
        return 1 - (1 - beta) ** n - rho * beta

    lo, hi = 1.0, float(n)
    if n > 1 and h(lo) > 0:
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if h(mid) > 0 else (lo, mid)
    else:
        hi = 1.0
    beta = np.minimum(q, p / hi).sum()
    return 1 - (1 - beta) ** n


def test_residual_function_matches_definition():
    rng = np.random.default_rng(20)
    for _ in range(30):
        p, q = random_pair(rng, int(rng.integers(2, 40)))
        prof = RatioProfile(p, q)
        lams = np.concatenate([[0.0, 1.0], rng.exponential(3.0, 20), prof.ratio[np.isfinite(prof.ratio)][:5]])
        direct = np.array([np.maximum(p - lam * q, 0.0).sum() for lam in lams])
        assert np.abs(prof.f(lams) - direct).max() < 1e-13
        assert prof.f(1.0) == pytest.approx(0.5 * np.abs(p - q).sum(), abs=1e-13)  # f(1) = TV


def test_rrs_and_kseq_closed_forms_match_definitions():
    rng = np.random.default_rng(21)
    for _ in range(120):
        p, q = random_pair(rng, int(rng.integers(2, 60)))
        n = int(rng.integers(1, 9))
        assert verifier_acceptance(p, q, n, "with_replacement", "rrs") == pytest.approx(rrs_wr_direct(p, q, n), abs=1e-12)
        assert verifier_acceptance(p, q, n, "with_replacement", "kseq") == pytest.approx(kseq_direct(p, q, n), abs=1e-10)


@pytest.mark.parametrize("vocab", [7, 2500])
def test_curves_equal_one_call_per_point(vocab):
    """acceptance_curves gives the numbers of optimal_acceptance / verifier_acceptance (and the RRS wor interval)."""
    rng = np.random.default_rng(22 + vocab)
    for trial in range(6 if vocab > 100 else 40):
        if vocab > 100:
            z = rng.standard_normal(vocab)
            p = np.exp(3 * z)
            q = np.exp(3 * (z + 0.6 * rng.standard_normal(vocab)))
            p, q = p / p.sum(), q / q.sum()
        else:
            p, q = random_pair(rng, vocab)
        n_max = 5 if vocab > 100 else 4
        c = acceptance_curves(p, q, n_max)
        assert set(c) == set(METRICS) and all(len(v) == n_max for v in c.values())
        for n in range(1, n_max + 1):
            for name, (sampling, verifier) in METRICS.items():
                got = c[name][n - 1]
                if verifier is None:
                    assert got == pytest.approx(optimal_acceptance(p, q, n, sampling), abs=1e-12), (name, n)
                elif name.startswith("rrs_without_replacement"):
                    continue
                else:
                    assert got == pytest.approx(verifier_acceptance(p, q, n, sampling, verifier), abs=1e-12), (name, n)
            lo, hi = c["rrs_without_replacement_lower"][n - 1], c["rrs_without_replacement_upper"][n - 1]
            assert lo <= hi + 1e-15
            if vocab < 100:  # the exact recursion is feasible: the interval contains it
                exact = verifier_acceptance(p, q, n, "without_replacement", "rrs")
                assert lo - 1e-12 <= exact <= hi + 1e-12
            # RRS is below the optimum of its scheme
            assert lo <= c["optimal_without_replacement"][n - 1] + 1e-12


def _rrs_wor_exact(p, q, n_max):
    return np.array([1.0 - md._rrs_wor_reject(p, q, n) for n in range(1, n_max + 1)])


def test_rrs_wor_interval_contains_exact_rate_at_every_budget():
    """The certificate: for random pairs and tiny budgets (heavy pruning) lower <= exact <= upper."""
    rng = np.random.default_rng(23)
    checked = widest = 0
    for it in range(120):
        v = int(rng.integers(5, 10))
        n = int(rng.integers(2, 6)) if v <= 6 else 3
        if it % 3 == 1:  # peaked, correlated
            z = rng.standard_normal(v)
            p, q = np.exp(4 * z), np.exp(4 * (z + 0.7 * rng.standard_normal(v)))
            p, q = p / p.sum(), q / q.sum()
        else:
            p, q = random_pair(rng, v)
        exact = _rrs_wor_exact(p, q, n)
        for budget, children in ((0, 1), (1, 1), (2, 2), (5, 3), (20, 2)):
            iv = rrs_without_replacement_interval(p, q, n, budget, children)
            assert np.all(iv.lower <= exact + 1e-12) and np.all(exact <= iv.upper + 1e-12), (p, q, n, budget)
            widest = max(widest, float((iv.upper - iv.lower).max()))
            checked += 1
        full = rrs_without_replacement_interval(p, q, n, 10**6, 10**6)
        assert np.abs(full.lower - exact).max() < 1e-12 and np.abs(full.upper - exact).max() < 1e-12
    assert checked == 600 and widest > 0.05  # the small budgets really did prune


def test_rrs_wor_interval_tiny_remaining_mass():
    """Regression: the last draft token has q ~ 1e-12; 1 - S must not be formed by cancellation."""
    p = np.array([0.16720517563561882, 0.12082945306452052, 0.03471253573260767, 0.677252835567253])
    q = np.array([1.8757224443283172e-12, 3.7215449517790505e-01, 1.7945751009876173e-05, 6.2782755906920940e-01])
    q = q / q.sum()
    iv = rrs_without_replacement_interval(p, q, 4, 100, 100)
    exact = _rrs_wor_exact(p, q, 4)
    assert exact[3] == pytest.approx(1.0, abs=1e-15)  # every token drafted: something is accepted
    assert np.abs(iv.lower - exact).max() < 1e-12 and np.abs(iv.upper - exact).max() < 1e-12


def test_rrs_wor_large_vocabulary_against_sample_step():
    """V = 400, n = 3 (beyond the exact recursion): sample_step's Monte Carlo lies in the certified interval."""
    torch = pytest.importorskip("torch")
    from quickdraft.verification.multidraft import sample_step

    rng = np.random.default_rng(24)
    z = rng.standard_normal(400)
    p, q = np.exp(2.5 * z), np.exp(2.5 * (z + 0.8 * rng.standard_normal(400)))
    p, q = p / p.sum(), q / q.sum()
    iv = rrs_without_replacement_interval(p, q, 3, 256, 16)
    lo, hi = float(iv.lower[2]), float(iv.upper[2])
    assert hi - lo < 1e-3  # narrow enough for the check to have power
    samples = 40_000
    gen = torch.Generator().manual_seed(5)
    tp = torch.tensor(p).expand(samples, -1).contiguous()
    dp = torch.tensor(q).expand(samples, -1).contiguous()
    hat = float(sample_step(tp, dp, 3, "without_replacement", "rrs", generator=gen).accepted.double().mean())
    se = math.sqrt(lo * (1 - lo) / samples)
    assert lo - 5 * se <= hat <= hi + 5 * se, (hat, lo, hi)
    # negative control: the with-replacement rate is a different number and is rejected
    wr = verifier_acceptance(p, q, 3, "with_replacement", "rrs")
    assert abs(hat - wr) > 5 * se


def test_verifier_acceptance_rrs_wor_beyond_recursion_is_certified_or_refused():
    rng = np.random.default_rng(25)
    z = rng.standard_normal(3000)
    p, q = np.exp(3 * z), np.exp(3 * (z + 0.5 * rng.standard_normal(3000)))
    p, q = p / p.sum(), q / q.sum()
    rate = verifier_acceptance(p, q, 2, "without_replacement", "rrs")  # n = 2 is always exact
    iv = rrs_without_replacement_interval(p, q, 2, 1, 1)  # one expansion (of the root) makes n = 2 exact
    assert iv.exact and rate == pytest.approx(float(iv.lower[1]), abs=1e-12)
    old = md.RRS_WOR_TOL
    try:
        md.RRS_WOR_TOL = 0.0  # nothing beyond n = 2 is certified to width 0 here: a clear refusal
        with pytest.raises(QuickdraftError, match="certified interval"):
            verifier_acceptance(p, q, 8, "without_replacement", "rrs")
    finally:
        md.RRS_WOR_TOL = old


def test_rrs_wor_interval_invalid_inputs():
    with pytest.raises(QuickdraftError, match="max_expansions"):
        rrs_without_replacement_interval([0.5, 0.5], [0.5, 0.5], 2, -1)
    with pytest.raises(QuickdraftError, match="max_drafts"):
        rrs_without_replacement_interval([0.5, 0.5], [0.5, 0.5], 0)
    with pytest.raises(QuickdraftError, match="sums to"):
        acceptance_curves([0.5, 0.6], [0.5, 0.5], 2)
