"""``quickdraft.evaluation.fit``: the chi-square test every lossless path is tested with."""

from __future__ import annotations

import doctest

import numpy as np

import quickdraft.evaluation.fit as fit
from quickdraft.evaluation.fit import chi_square_pvalue


def test_doctests():
    assert doctest.testmod(fit).failed == 0


def test_draws_of_the_law_fit_and_draws_of_another_do_not():
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(40))
    other = 0.8 * probs + 0.2 * rng.dirichlet(np.ones(40))  # total variation ~0.1 from probs
    draws = np.bincount(rng.choice(40, size=4000, p=probs), minlength=40)
    wrong = np.bincount(rng.choice(40, size=4000, p=other), minlength=40)
    assert chi_square_pvalue(draws, probs) > 1e-3
    assert chi_square_pvalue(wrong, probs) < 1e-6


def test_rare_cells_are_pooled_and_impossible_draws_fail():
    probs = np.array([0.5, 0.49, 0.006, 0.004, 0.0])
    counts = np.array([50, 49, 1, 0, 0])  # the two rare cells (expected < 5) go to one bin
    assert chi_square_pvalue(counts, probs) > 0.5
    assert chi_square_pvalue(np.array([50, 49, 1]), np.array([0.5, 0.5, 0.0])) == 0.0  # a draw the law never makes
