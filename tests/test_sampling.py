"""`sampling.sample`: one token per row with the row's probabilities (inverse transform sampling)."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from quickdraft.sampling import sample


def _counts(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    draws = sample(probs.expand(n, -1), g)  # [n]
    return torch.bincount(draws, minlength=probs.shape[-1]).double()


def test_sample_follows_the_row_distribution_and_never_draws_a_zero():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(1, 64, generator=g) ** 3  # unnormalised, uneven
    probs[0, ::7] = 0.0
    n = 200_000
    counts = _counts(probs, n, seed=1)
    assert counts[::7].sum() == 0
    keep = probs[0] > 0
    expected = probs[0, keep].double() / probs[0].sum() * n
    assert stats.chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-4
    # negative control: the same test rejects draws from the distribution moved one token along
    moved = _counts(torch.roll(probs, 1, dims=-1), n, seed=1)
    assert stats.chisquare(moved[keep].numpy(), (expected * moved[keep].sum() / n).numpy()).pvalue < 1e-6


def test_sample_keeps_the_leading_shape_and_is_seeded():
    probs = torch.softmax(torch.randn(3, 5, 11), -1)
    a = sample(probs, torch.Generator().manual_seed(3))
    b = sample(probs, torch.Generator().manual_seed(3))
    assert a.shape == (3, 5) and a.dtype == torch.long and torch.equal(a, b)
    one_hot = torch.zeros(4, 9)
    one_hot[torch.arange(4), torch.tensor([0, 8, 3, 3])] = 1.0
    assert sample(one_hot, torch.Generator().manual_seed(0)).tolist() == [0, 8, 3, 3]


@pytest.mark.parametrize("vocab", [2, 151_936])
def test_sample_stays_in_range(vocab):
    probs = torch.zeros(2, vocab)
    probs[:, -1] = 1.0
    assert sample(probs, torch.Generator().manual_seed(0)).tolist() == [vocab - 1, vocab - 1]
