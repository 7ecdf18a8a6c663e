"""Divergences against scipy on random and degenerate distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from scipy.spatial.distance import jensenshannon

from quickdraft.divergences import (
    DIVERGENCES,
    bucket_top_k,
    entropy,
    get_divergence,
    js,
    js_fsd,
    kl,
    kl_reverse,
    rel_entr,
    topk_js,
    topk_kl_reverse,
    tv,
)
from quickdraft.errors import QuickdraftError

LN2 = math.log(2.0)


# -- numpy references (p = target, q = draft) -----------------------------------------------------


def ref_kl(p, q):  # KL(q || p)
    return scipy.special.rel_entr(q, p).sum(-1)


def ref_kl_reverse(p, q):  # KL(p || q)
    return scipy.special.rel_entr(p, q).sum(-1)


def ref_js(p, q):
    # scipy returns the Jensen-Shannon *distance* (the square root), base e by default
    return np.array([jensenshannon(a, b) ** 2 for a, b in zip(p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1]))]).reshape(p.shape[:-1])


def ref_js_fsd(p, q):
    m = 0.5 * (p + q)
    return 0.5 * (scipy.special.rel_entr(m, p).sum(-1) + scipy.special.rel_entr(m, q).sum(-1))


def ref_tv(p, q):
    return 0.5 * np.abs(p - q).sum(-1)


REFS = {"kl": ref_kl, "kl_reverse": ref_kl_reverse, "js": ref_js, "js_fsd": ref_js_fsd, "tv": ref_tv}


def ref_bucket(p, q, k):
    """Per-row loop: the target's top-k tokens (torch.topk order) plus the rest."""
    tp, tq = [], []
    for a, b in zip(p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1])):
        idx = torch.topk(torch.from_numpy(a), k).indices.numpy()
        rest = np.ones(a.shape[0], bool)
        rest[idx] = False
        tp.append(np.append(a[idx], a[rest].sum()))
        tq.append(np.append(b[idx], b[rest].sum()))
    shape = p.shape[:-1] + (k + 1,)
    return np.array(tp).reshape(shape), np.array(tq).reshape(shape)


def random_pair(shape, seed, sharpness=1.0):
    rng = np.random.default_rng(seed)
    p = scipy.special.softmax(rng.normal(size=shape) * sharpness, axis=-1)
    q = scipy.special.softmax(rng.normal(size=shape) * sharpness, axis=-1)
    return p, q


def degenerate_pairs(v=6):
    """(name, p, q) with exact zeros: identical one-hots, different one-hots, disjoint and
    partially overlapping supports, zeros shared by both, a uniform vs a one-hot."""
    e = np.eye(v)
    half = np.r_[np.full(v // 2, 2.0 / v), np.zeros(v - v // 2)]
    other_half = half[::-1].copy()
    partial = np.r_[0.5, 0.5, np.zeros(v - 2)]
    shared_zero_p = np.r_[0.2, 0.3, 0.5, np.zeros(v - 3)]
    shared_zero_q = np.r_[0.6, 0.1, 0.3, np.zeros(v - 3)]
    uniform = np.full(v, 1.0 / v)
    return [
        ("same one-hot", e[1], e[1]),
        ("different one-hots", e[0], e[3]),
        ("disjoint supports", half, other_half),
        ("draft misses target mass", partial, e[0]),
        ("target misses draft mass", e[0], partial),
        ("shared zeros", shared_zero_p, shared_zero_q),
        ("uniform vs one-hot", uniform, e[2]),
        ("identical", shared_zero_p, shared_zero_p),
    ]


# -- against scipy ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("sharpness", [1.0, 6.0])
def test_matches_scipy_on_random_batches(name, sharpness):
    p, q = random_pair((3, 4, 257), seed=11, sharpness=sharpness)
    got = DIVERGENCES[name](torch.from_numpy(p), torch.from_numpy(q))
    assert got.shape == (3, 4)
    np.testing.assert_allclose(got.numpy(), REFS[name](p, q), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", list(REFS))
def test_matches_scipy_on_degenerate_distributions(name):
    cases = degenerate_pairs()
    p = np.stack([c[1] for c in cases])
    q = np.stack([c[2] for c in cases])
    got = DIVERGENCES[name](torch.from_numpy(p), torch.from_numpy(q)).numpy()
    want = REFS[name](p, q)
    assert not np.isnan(got).any()
    for (case, *_), g, w in zip(cases, got, want):
        if np.isinf(w):
            assert np.isposinf(g), f"{name} on {case}: want +inf, got {g}"
        else:
            assert g == pytest.approx(w, rel=1e-12, abs=1e-15), f"{name} on {case}"


def test_degenerate_values_by_hand():
    e = torch.eye(4, dtype=torch.float64)
    half = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    # different one-hots: KL infinite both ways, JS exactly ln 2, TV 1, FSD's JS infinite
    assert kl(e[0], e[1]) == math.inf and kl_reverse(e[0], e[1]) == math.inf
    assert js(e[0], e[1]).item() == pytest.approx(LN2, abs=1e-15)
    assert tv(e[0], e[1]).item() == 1.0
    assert js_fsd(e[0], e[1]) == math.inf
    # the draft (one-hot) sits inside the target's support: KL(draft||target) = log 2 finite,
    # KL(target||draft) infinite
    assert kl(half, e[0]).item() == pytest.approx(LN2, abs=1e-15)
    assert kl_reverse(half, e[0]) == math.inf
    # identical distributions give exact zeros, not tiny rounding residues
    for fn in (kl, kl_reverse, js, js_fsd, tv):
        assert fn(half, half).item() == 0.0


def test_js_variants_differ_and_bounds_hold():
    p, q = random_pair((2000, 50), seed=3, sharpness=4.0)
    tp, tq = torch.from_numpy(p), torch.from_numpy(q)
    textbook, fsd = js(tp, tq), js_fsd(tp, tq)
    assert (textbook <= LN2 + 1e-15).all() and (textbook >= 0).all()
    # KL from the mixture is never smaller: js_fsd - js = sum_v q g(p/q) with
    # g(r) = 2(r+1) log((r+1)/2) - (3r+1)/2 log r, g(1) = 0, g'' = (r-1)^2 / (2 r^2 (r+1)) >= 0,
    # an f-divergence, hence >= 0 by Jensen
    assert (fsd >= textbook - 1e-12).all() and (fsd > textbook).float().mean() > 0.99
    assert (tv(tp, tq) <= 1).all()
    # symmetric ones are symmetric, the KLs are each other's mirror image
    torch.testing.assert_close(js(tp, tq), js(tq, tp))
    torch.testing.assert_close(js_fsd(tp, tq), js_fsd(tq, tp))
    torch.testing.assert_close(kl(tp, tq), kl_reverse(tq, tp))


def test_rel_entr_matches_scipy_elementwise():
    x = torch.tensor([0.0, 0.0, 0.3, 0.3, 1.0], dtype=torch.float64)
    y = torch.tensor([0.0, 0.2, 0.0, 0.6, 1.0], dtype=torch.float64)
    np.testing.assert_array_equal(rel_entr(x, y).numpy(), scipy.special.rel_entr(x.numpy(), y.numpy()))


def test_entropy_matches_scipy():
    p, _ = random_pair((5, 100), seed=1, sharpness=3.0)
    p[0] = np.eye(100)[7]
    np.testing.assert_allclose(entropy(torch.from_numpy(p)).numpy(), scipy.stats.entropy(p, axis=-1), atol=1e-12)
    assert entropy(torch.from_numpy(p))[0].item() == 0.0


def test_float32_large_vocab_close_to_float64():
    p, q = random_pair((2, 151_936), seed=5, sharpness=3.0)
    for name in REFS:
        got = DIVERGENCES[name](torch.from_numpy(p).float(), torch.from_numpy(q).float())
        assert got.dtype == torch.float32
        np.testing.assert_allclose(got.double().numpy(), REFS[name](p, q), rtol=1e-4)


# -- top-k versions -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REFS))
def test_top_k_versions_match_bucketed_reference(name):
    p, q = random_pair((4, 3, 300), seed=7, sharpness=3.0)
    bp, bq = ref_bucket(p, q, 20)
    got = get_divergence(f"topk_{name}", top_k=20)(torch.from_numpy(p), torch.from_numpy(q))
    np.testing.assert_allclose(got.numpy(), REFS[name](bp, bq), rtol=1e-10, atol=1e-12)
    # the registry entry uses FSD's k = 50
    bp, bq = ref_bucket(p, q, 50)
    got = DIVERGENCES[f"topk_{name}"](torch.from_numpy(p), torch.from_numpy(q))
    np.testing.assert_allclose(got.numpy(), REFS[name](bp, bq), rtol=1e-10, atol=1e-12)


def test_bucket_is_exactly_zero_when_the_rest_is_empty():
    p = torch.tensor([0.7, 0.3, 0.0, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.4, 0.6, 0.0, 0.0, 0.0], dtype=torch.float64)
    bp, bq = bucket_top_k(p, q, 2)
    assert bp[-1].item() == 0.0 and bq[-1].item() == 0.0
    # hence a finite KL (1 - sum(top-k) would leave rounding mass and make it infinite)
    assert math.isfinite(topk_kl_reverse(p, q, 2).item())
    assert topk_kl_reverse(p, q, 2).item() == pytest.approx(ref_kl_reverse(p.numpy(), q.numpy()))


def test_top_k_at_least_vocab_equals_full_divergence_and_coarsening_shrinks_it():
    p, q = random_pair((10, 40), seed=9, sharpness=2.0)
    tp, tq = torch.from_numpy(p), torch.from_numpy(q)
    torch.testing.assert_close(topk_js(tp, tq, 40), js(tp, tq))
    torch.testing.assert_close(topk_js(tp, tq, 1000), js(tp, tq))
    # merging tokens can only lower an f-divergence (data processing inequality)
    assert (topk_js(tp, tq, 5) <= js(tp, tq) + 1e-12).all()


# -- registry -----------------------------------------------------------------------------------


def test_registry_names_and_errors():
    assert set(DIVERGENCES) == {
        "kl", "kl_reverse", "js", "js_fsd", "tv",
        "topk_kl", "topk_kl_reverse", "topk_js", "topk_js_fsd", "topk_tv",
    }
    with pytest.raises(QuickdraftError, match="unknown divergence 'jsd'"):
        get_divergence("jsd")
    with pytest.raises(QuickdraftError, match="top_k"):
        get_divergence("topk_js", top_k=0)
    assert get_divergence("js") is js
