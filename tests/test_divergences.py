"""Divergences against scipy on random and degenerate distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch
from scipy.spatial.distance import jensenshannon

from quickdraft.verification.divergences import (
    DEPRECATED_NAMES,
    DIVERGENCES,
    bucket_top_k,
    canonical_name,
    entropy,
    get_divergence,
    js,
    js_fsd,
    jsd,
    kl,
    kl_reverse,
    rel_entr,
    restrict_top_p,
    topk_js,
    topk_js_fsd,
    topk_jsd,
    topk_kl_reverse,
    topp_js,
    topp_jsd,
    topp_kl,
    topp_kl_reverse,
    topp_tv,
    tv,
)
from quickdraft.verification.rules import Fuzzy
from quickdraft.errors import QuickdraftError

LN2 = math.log(2.0)


# -- numpy references (p = target, q = draft) -----------------------------------------------------


def ref_kl(p, q):  # KL(q || p)
    return scipy.special.rel_entr(q, p).sum(-1)


def ref_kl_reverse(p, q):  # KL(p || q)
    return scipy.special.rel_entr(p, q).sum(-1)


def ref_jsd(p, q):
    # scipy returns the Jensen-Shannon *distance* (the square root), base e by default
    return np.array([jensenshannon(a, b) ** 2 for a, b in zip(p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1]))]).reshape(p.shape[:-1])


def ref_js(p, q):  # FSD's "JS": KL from the mixture
    m = 0.5 * (p + q)
    return 0.5 * (scipy.special.rel_entr(m, p).sum(-1) + scipy.special.rel_entr(m, q).sum(-1))


def ref_tv(p, q):
    return 0.5 * np.abs(p - q).sum(-1)


REFS = {"kl": ref_kl, "kl_reverse": ref_kl_reverse, "js": ref_js, "jsd": ref_jsd, "tv": ref_tv}


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
    # different one-hots: KL infinite both ways, textbook JS exactly ln 2, TV 1, FSD's JS infinite
    assert kl(e[0], e[1]) == math.inf and kl_reverse(e[0], e[1]) == math.inf
    assert jsd(e[0], e[1]).item() == pytest.approx(LN2, abs=1e-15)
    assert tv(e[0], e[1]).item() == 1.0
    assert js(e[0], e[1]) == math.inf
    # the draft (one-hot) sits inside the target's support: KL(draft||target) = log 2 finite,
    # KL(target||draft) infinite
    assert kl(half, e[0]).item() == pytest.approx(LN2, abs=1e-15)
    assert kl_reverse(half, e[0]) == math.inf
    # identical distributions give exact zeros, not tiny rounding residues
    for fn in (kl, kl_reverse, js, jsd, tv):
        assert fn(half, half).item() == 0.0


def test_js_variants_differ_and_bounds_hold():
    p, q = random_pair((2000, 50), seed=3, sharpness=4.0)
    tp, tq = torch.from_numpy(p), torch.from_numpy(q)
    textbook, fsd = jsd(tp, tq), js(tp, tq)
    assert (textbook <= LN2 + 1e-15).all() and (textbook >= 0).all()
    # KL from the mixture is never smaller: js - jsd = sum_v q g(p/q) with
    # g(r) = 2(r+1) log((r+1)/2) - (3r+1)/2 log r, g(1) = 0, g'' = (r-1)^2 / (2 r^2 (r+1)) >= 0,
    # an f-divergence, hence >= 0 by Jensen
    assert (fsd >= textbook - 1e-12).all() and (fsd > textbook).float().mean() > 0.99
    assert (tv(tp, tq) <= 1).all()
    # symmetric ones are symmetric, the KLs are each other's mirror image
    torch.testing.assert_close(jsd(tp, tq), jsd(tq, tp))
    torch.testing.assert_close(js(tp, tq), js(tq, tp))
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
    for top, full in ((topk_js, js), (topk_jsd, jsd)):
        torch.testing.assert_close(top(tp, tq, 40), full(tp, tq))
        torch.testing.assert_close(top(tp, tq, 1000), full(tp, tq))
        # merging tokens can only lower an f-divergence (data processing inequality)
        assert (top(tp, tq, 5) <= full(tp, tq) + 1e-12).all()


# -- top-p versions -----------------------------------------------------------------------------


def ref_nucleus(p, q, top_p):
    """Per-row loop: the target's tokens by decreasing probability (ties: lower id first) while
    the mass before them is below top_p; both renormalised on them, zero elsewhere."""
    tp, tq = np.zeros_like(p), np.zeros_like(q)
    for a, b, ra, rb in zip(p.reshape(-1, p.shape[-1]), q.reshape(-1, q.shape[-1]),
                            tp.reshape(-1, p.shape[-1]), tq.reshape(-1, q.shape[-1])):
        mass = 0.0
        for v in sorted(range(a.shape[0]), key=lambda v: (-a[v], v)):
            if mass >= top_p:
                break
            ra[v], rb[v] = a[v], b[v]
            mass += a[v]
        ra /= ra.sum()
        rb /= rb.sum()
    return tp, tq


def test_top_p_by_hand():
    # target ranking 0, 2, 1, 3; mass before token 2 is 0.5 < 0.7, before token 1 it is 0.8:
    # nucleus {0, 2}; renormalised target [5/8, 3/8], draft [1/2, 1/2] on it
    target = torch.tensor([0.5, 0.1, 0.3, 0.1], dtype=torch.float64)
    draft = torch.tensor([0.2, 0.4, 0.2, 0.2], dtype=torch.float64)
    rt, rd = restrict_top_p(target, draft, 0.7)
    torch.testing.assert_close(rt, torch.tensor([5 / 8, 0, 3 / 8, 0], dtype=torch.float64))
    torch.testing.assert_close(rd, torch.tensor([1 / 2, 0, 1 / 2, 0], dtype=torch.float64))
    log = math.log
    # m = (p + q) / 2 = [9/16, 7/16] on the nucleus
    want = {
        topp_tv: 0.5 * (1 / 8 + 1 / 8),
        topp_kl: 0.5 * log(4 / 5) + 0.5 * log(4 / 3),  # KL(draft || target)
        topp_kl_reverse: 5 / 8 * log(5 / 4) + 3 / 8 * log(3 / 4),  # KL(target || draft)
        topp_js: 0.5 * (9 / 16 * log(9 / 10) + 7 / 16 * log(7 / 6)) + 0.5 * (9 / 16 * log(9 / 8) + 7 / 16 * log(7 / 8)),
        topp_jsd: 0.5 * (5 / 8 * log(10 / 9) + 3 / 8 * log(6 / 7)) + 0.5 * (1 / 2 * log(8 / 9) + 1 / 2 * log(8 / 7)),
    }
    for fn, value in want.items():
        assert fn(target, draft, 0.7).item() == pytest.approx(value, rel=1e-12), fn.__name__


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 1.0])
def test_top_p_of_identical_distributions_is_exactly_zero(top_p):
    p, _ = random_pair((6, 200), seed=13, sharpness=3.0)
    tp = torch.from_numpy(p)
    for name in REFS:
        got = get_divergence(f"topp_{name}", top_p=top_p)(tp, tp.clone())
        assert (got == 0).all(), name


@pytest.mark.parametrize("name", list(REFS))
@pytest.mark.parametrize("top_p", [0.3, 0.9])
def test_top_p_versions_match_the_per_row_reference(name, top_p):
    p, q = random_pair((4, 3, 300), seed=17, sharpness=3.0)
    rp, rq = ref_nucleus(p, q, top_p)
    got = get_divergence(f"topp_{name}", top_p=top_p)(torch.from_numpy(p), torch.from_numpy(q))
    assert got.shape == (4, 3)
    np.testing.assert_allclose(got.numpy(), REFS[name](rp, rq), rtol=1e-10, atol=1e-12)
    # the nucleus size differs from row to row
    sizes = {int((r > 0).sum()) for r in rp.reshape(-1, 300)}
    assert len(sizes) > 1


def test_top_p_one_is_the_full_divergence_and_ties_go_to_the_lower_id():
    p, q = random_pair((10, 40), seed=19, sharpness=2.0)
    tp, tq = torch.from_numpy(p), torch.from_numpy(q)
    torch.testing.assert_close(topp_js(tp, tq, 1.0), js(tp, tq))
    torch.testing.assert_close(topp_jsd(tp, tq, 1.0), jsd(tp, tq))
    target = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    draft = torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64)
    rt, rd = restrict_top_p(target, draft, 0.3)
    assert rt.tolist() == [1.0, 0.0, 0.0] and rd.tolist() == [1.0, 0.0, 0.0]


def test_top_p_without_draft_mass_on_the_nucleus_is_infinite():
    target = torch.tensor([[0.7, 0.2, 0.1], [0.7, 0.2, 0.1]], dtype=torch.float64)
    draft = torch.tensor([[0.0, 0.5, 0.5], [0.5, 0.5, 0.0]], dtype=torch.float64)
    for fn in (topp_kl, topp_kl_reverse, topp_js, topp_jsd, topp_tv):
        got = fn(target, draft, 0.5)  # nucleus {0}
        assert got[0].item() == math.inf and got[1].item() == 0.0, fn.__name__


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, True, float("nan")])
def test_top_p_must_be_in_the_unit_interval(top_p):
    with pytest.raises(QuickdraftError, match="top_p"):
        get_divergence("topp_js", top_p=top_p)
    with pytest.raises(QuickdraftError, match="top_p"):
        Fuzzy(divergence="topp_js", top_p=top_p)


# -- registry -----------------------------------------------------------------------------------


def test_registry_names_and_errors():
    assert set(DIVERGENCES) == {
        "kl", "kl_reverse", "js", "jsd", "tv",
        "topk_kl", "topk_kl_reverse", "topk_js", "topk_jsd", "topk_tv",
        "topp_kl", "topp_kl_reverse", "topp_js", "topp_jsd", "topp_tv",
    }
    with pytest.raises(QuickdraftError, match="unknown divergence 'jensen_shannon'"):
        get_divergence("jensen_shannon")
    with pytest.raises(QuickdraftError, match="top_k"):
        get_divergence("topk_js", top_k=0)
    assert get_divergence("js") is js
    assert get_divergence("jsd") is jsd
    p, q = random_pair((5, 100), seed=23, sharpness=3.0)
    tp, tq = torch.from_numpy(p), torch.from_numpy(q)
    torch.testing.assert_close(DIVERGENCES["topp_js"](tp, tq), topp_js(tp, tq, 0.9))


def test_js_fsd_is_a_deprecated_alias_of_js():
    p, q = random_pair((5, 100), seed=29, sharpness=3.0)
    tp, tq = torch.from_numpy(p), torch.from_numpy(q)
    assert DEPRECATED_NAMES == {"js_fsd": "js", "topk_js_fsd": "topk_js"}
    assert not set(DEPRECATED_NAMES) & set(DIVERGENCES)
    with pytest.warns(DeprecationWarning, match="'js_fsd' is deprecated; use 'js'"):
        assert get_divergence("js_fsd") is js
    with pytest.warns(DeprecationWarning, match="'topk_js_fsd' is deprecated; use 'topk_js'"):
        torch.testing.assert_close(get_divergence("topk_js_fsd", top_k=7)(tp, tq), topk_js(tp, tq, 7))
    with pytest.warns(DeprecationWarning, match="use 'js'"):
        torch.testing.assert_close(js_fsd(tp, tq), js(tp, tq))
    with pytest.warns(DeprecationWarning, match="use 'topk_js'"):
        torch.testing.assert_close(topk_js_fsd(tp, tq), topk_js(tp, tq))
    with pytest.warns(DeprecationWarning, match="use 'js'"):
        assert canonical_name("js_fsd") == "js"
    with pytest.warns(DeprecationWarning, match="use 'js'"):
        assert Fuzzy(divergence="js_fsd").divergence == "js"
