"""Exponential-race acceptance: closed form and n-candidate integral against Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.theory import chain_acceptance, race_acceptance, race_expected_tokens, race_tree_size, race_tree_speedup
from quickdraft.theory import races


def monte_carlo(p, q, n, trials, rng):
    """Shared Exp(1) races: is the target's winner among the draft's n earliest arrivals?"""
    e = rng.exponential(size=(trials, p.shape[0]))
    with np.errstate(divide="ignore"):
        winner = np.argmin(e / p, axis=1)
        top = np.argsort(e / q, axis=1)[:, :n]
    return (top == winner[:, None]).any(axis=1)


def test_closed_form_equals_quadratic_formula():
    rng = np.random.default_rng(0)
    for _ in range(30):
        v = int(rng.integers(2, 30))
        p = rng.dirichlet(np.full(v, 0.5))
        q = rng.dirichlet(np.full(v, 0.5))
        q[rng.integers(0, v)] = 0.0
        q /= q.sum()
        direct = sum(
            p[w] * q[w] / np.maximum(p * q[w], q * p[w]).sum() for w in range(v) if p[w] * q[w] > 0
        )
        assert race_acceptance(p, q) == pytest.approx(direct, abs=1e-13)
        assert race_acceptance(p, q) <= chain_acceptance(p, q) + 1e-12


@pytest.mark.parametrize("v,n", [(5, 1), (6, 2), (6, 3), (14, 2), (14, 3)])
def test_against_monte_carlo_with_negative_control(v, n):
    rng = np.random.default_rng(10 * v + n)
    p = rng.dirichlet(np.ones(v))
    q = rng.dirichlet(np.ones(v))
    trials = 100_000
    hits = monte_carlo(p, q, n, trials, rng)
    exact = race_acceptance(p, q, n)
    se = math.sqrt(exact * (1 - exact) / trials)
    assert abs(hits.mean() - exact) < 4.5 * se
    wrong = race_acceptance(p, q, n + 1) if n < v - 1 else race_acceptance(p, q, n - 1)
    assert abs(hits.mean() - wrong) > 4.5 * se


def test_quadrature_matches_exact_sum():
    rng = np.random.default_rng(3)
    for n in (2, 3, 4):
        p = rng.dirichlet(np.full(9, 0.4))
        q = rng.dirichlet(np.full(9, 0.4))
        exact = race_acceptance(p, q, n)
        old = races._EXACT_MAX_BEATERS
        races._EXACT_MAX_BEATERS = 0
        try:
            quad = race_acceptance(p, q, n)
        finally:
            races._EXACT_MAX_BEATERS = old
        assert quad == pytest.approx(exact, abs=1e-10)


def test_identical_and_disjoint():
    p = np.array([0.2, 0.3, 0.5])
    assert race_acceptance(p, p) == pytest.approx(1.0)
    assert race_acceptance([0.5, 0.5, 0, 0], [0, 0, 0.5, 0.5], 2) == 0.0
    assert race_acceptance(p, [0.6, 0.3, 0.1], 3) == pytest.approx(1.0)


def test_expected_tokens_of_race_chain_by_simulation():
    """A race chain over i.i.d. positions: tokens per call = sum_i alpha^i."""
    rng = np.random.default_rng(4)
    p = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6))
    k, trials = 4, 40_000
    alpha = race_acceptance(p, q)
    acc = np.stack([monte_carlo(p, q, 1, trials, rng) for _ in range(k)], axis=1)
    tokens = np.cumprod(acc, axis=1).sum(axis=1) + 1
    se = tokens.std() / math.sqrt(trials)
    assert abs(tokens.mean() - race_expected_tokens([alpha] * k)) < 4.5 * se
    assert abs(tokens.mean() - race_expected_tokens([alpha] * (k - 1))) > 4.5 * se


def test_tree_size_and_log_growth():
    assert race_tree_size(2, 3) == 14
    for n in (2, 3):
        for depth in range(1, 8):
            k, s = race_tree_speedup(1.0, n, depth, 0.0)
            assert s <= 1 + math.log(k, n) + 1e-12  # tokens <= 1 + log_n k


def test_invalid():
    with pytest.raises(QuickdraftError):
        race_acceptance([0.5, 0.5], [0.5, 0.5], 0)
    with pytest.raises(QuickdraftError):
        race_expected_tokens([1.5])


def test_expected_tokens_of_race_tree_by_simulation():
    """Full race tree, n candidates per node, depth d: along the target's path each depth is accepted when the
    target's race winner is among the draft's n earliest arrivals; tokens per call = sum_i prod_{j<=i} alpha_j."""
    rng = np.random.default_rng(8)
    p = rng.dirichlet(np.ones(7))
    q = rng.dirichlet(np.ones(7))
    n, depth, trials = 2, 3, 40_000
    alpha = race_acceptance(p, q, n)
    acc = np.stack([monte_carlo(p, q, n, trials, rng) for _ in range(depth)], axis=1)  # fresh races per depth
    tokens = np.cumprod(acc, axis=1).sum(axis=1) + 1
    se = tokens.std() / math.sqrt(trials)
    k, _ = race_tree_speedup(alpha, n, depth, 0.0)
    assert k == race_tree_size(n, depth) == 2 + 4 + 8
    assert abs(tokens.mean() - race_expected_tokens([alpha] * depth)) < 4.5 * se
    # negative control: the single-candidate rate gives a different (smaller) expectation
    assert abs(tokens.mean() - race_expected_tokens([race_acceptance(p, q, 1)] * depth)) > 4.5 * se
