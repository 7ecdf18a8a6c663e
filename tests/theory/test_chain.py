"""Chain formulas against exact sums and a simulation of the accept/reject process."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.theory import best_draft_length, chain_acceptance, expected_tokens_per_call, speedup


def test_chain_acceptance_is_one_minus_tv_and_matches_simulation():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(8))
    q = rng.dirichlet(np.ones(8))
    alpha = chain_acceptance(p, q)
    assert alpha == pytest.approx(1 - 0.5 * np.abs(p - q).sum(), abs=1e-15)
    trials = 200_000
    x = rng.choice(8, size=trials, p=q)
    accepted = rng.random(trials) < np.minimum(1.0, p[x] / q[x])
    se = math.sqrt(alpha * (1 - alpha) / trials)
    assert abs(accepted.mean() - alpha) < 4.5 * se
    assert abs(accepted.mean() - (alpha - 0.02)) > 4.5 * se  # negative control


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.999999, 1.0])
@pytest.mark.parametrize("k", [0, 1, 4, 10])
def test_expected_tokens_matches_sum_and_simulation(alpha, k):
    exact = sum(alpha**i for i in range(k + 1))
    assert expected_tokens_per_call(alpha, k) == pytest.approx(exact, rel=1e-12)


def test_expected_tokens_against_simulation_with_negative_control():
    rng = np.random.default_rng(1)
    alpha, k, trials = 0.7, 5, 100_000
    acc = rng.random((trials, k)) < alpha
    tokens = np.cumprod(acc, axis=1).sum(axis=1) + 1
    se = tokens.std() / math.sqrt(trials)
    assert abs(tokens.mean() - expected_tokens_per_call(alpha, k)) < 4.5 * se
    assert abs(tokens.mean() - expected_tokens_per_call(alpha, k + 1)) > 4.5 * se


def test_speedup_and_best_length():
    assert speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / (0.2 * 1.2))
    assert speedup(1.0, 3, 0.0) == pytest.approx(4.0)
    k = best_draft_length(0.8, 0.05, 30)
    values = [speedup(0.8, j, 0.05) for j in range(31)]
    assert values[k] == max(values)
    assert best_draft_length(0.0, 0.1, 10) == 0
    assert best_draft_length(1.0, 0.01, 10) == 10


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_call(1.2, 3),
        lambda: expected_tokens_per_call(0.5, -1),
        lambda: speedup(0.5, 2, -0.1),
        lambda: speedup(0.5, 2, float("nan")),
        lambda: best_draft_length(0.5, 0.1, 2.5),
        lambda: chain_acceptance([0.5, 0.5], [1.0]),
    ],
)
def test_invalid(call):
    with pytest.raises(QuickdraftError):
        call()
