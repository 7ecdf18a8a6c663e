"""Optimal multi-draft acceptance: fast dual vs LP, structure by brute force, verifiers vs Monte Carlo."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.theory import (
    draft_tuple_distribution,
    greedy_optimal_plan,
    kseq_rho,
    optimal_acceptance,
    optimal_acceptance_lp,
    verifier_acceptance,
)
from quickdraft.theory import _wor
from quickdraft.theory import multidraft as md

MODES = ("with_replacement", "without_replacement", "greedy")


def random_pair(rng: np.random.Generator, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Random target/draft pair with a mix of flat, peaked, sparse and disjoint cases."""
    kind = rng.integers(0, 5)
    p = rng.dirichlet(np.full(v, rng.choice([0.1, 0.5, 1.0, 5.0])))
    q = rng.dirichlet(np.full(v, rng.choice([0.1, 0.5, 1.0, 5.0])))
    if kind == 1:  # exact zeros
        p[rng.integers(0, v, 2)] = 0.0
        q[rng.integers(0, v, 2)] = 0.0
    elif kind == 2:  # disjoint supports
        cut = int(rng.integers(1, v))
        p[cut:] = 0.0
        q[:cut] = 0.0
    elif kind == 3:  # peaked
        p = np.exp(8 * rng.standard_normal(v))
        q = np.exp(8 * rng.standard_normal(v))
    if p.sum() == 0:
        p[0] = 1.0
    if q.sum() == 0:
        q[-1] = 1.0
    return p / p.sum(), q / q.sum()


def tv(p, q):
    return 0.5 * np.abs(p - q).sum()


@pytest.mark.parametrize("mode", MODES)
def test_single_draft_is_one_minus_tv(mode):
    rng = np.random.default_rng(0)
    for _ in range(50):
        p, q = random_pair(rng, int(rng.integers(2, 30)))
        assert optimal_acceptance(p, q, 1, mode) == pytest.approx(1 - tv(p, q), abs=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_fast_matches_lp(mode):
    rng = np.random.default_rng({"with_replacement": 1, "without_replacement": 2, "greedy": 3}[mode])
    worst = 0.0
    for _ in range(150):
        v = int(rng.integers(2, 7))
        n = int(rng.integers(1, 4))
        p, q = random_pair(rng, v)
        fast = optimal_acceptance(p, q, n, mode)
        lp = optimal_acceptance_lp(p, q, n, mode)
        worst = max(worst, abs(fast - lp))
        assert fast == pytest.approx(lp, abs=1e-9), (p, q, n)
    assert worst < 1e-9


def all_in_probability(p, q, n, mode, subset):
    tuples, probs = draft_tuple_distribution(q, n, mode)
    return sum(pr for tup, pr in zip(tuples, probs) if set(tup) <= subset)


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement"])
def test_prefix_structure_by_brute_force(mode):
    """max over ALL subsets A of Pr[all drafts in A] - p(A) is attained at a q/p-prefix."""
    rng = np.random.default_rng(4)
    checked = 0
    for _ in range(120):
        v = int(rng.integers(2, 7))
        n = int(rng.integers(2, 4))
        p, q = random_pair(rng, v)
        best = max(
            all_in_probability(p, q, n, mode, set(a)) - p[list(a)].sum()
            for r in range(v + 1)
            for a in itertools.combinations(range(v), r)
        )
        order = md._ratio_order(p, q)
        prefix_best = max(
            all_in_probability(p, q, n, mode, set(order[:k].tolist())) - p[order[:k]].sum() for k in range(v + 1)
        )
        assert prefix_best >= best - 1e-12
        checked += 1
    assert checked == 120


@pytest.mark.parametrize("mode", ["with_replacement", "without_replacement"])
def test_exchange_lemma_by_brute_force(mode):
    """Lemma (L) of docs/theory.md §3.1: q_x [F(B+y) - F(B)] <= q_y [F(B+x+y) - F(B+y)] for all B, x, y."""
    rng = np.random.default_rng(40)
    checked = 0
    for _ in range(40):
        v = int(rng.integers(3, 7))
        n = int(rng.integers(2, 4))
        _, q = random_pair(rng, v)
        tuples, probs = draft_tuple_distribution(q, n, mode)
        sets = [frozenset(t) for t in tuples]

        def f(a):
            return sum(pr for s_, pr in zip(sets, probs) if s_ <= a)

        for r in range(v - 1):
            for b in itertools.combinations(range(v), r):
                bset = frozenset(b)
                for x in range(v):
                    for y in range(v):
                        if x == y or x in bset or y in bset:
                            continue
                        lhs = q[x] * (f(bset | {y}) - f(bset))
                        rhs = q[y] * (f(bset | {x, y}) - f(bset | {y}))
                        assert lhs <= rhs + 1e-12, (q, n, b, x, y)
                        checked += 1
    assert checked > 1000


def test_without_replacement_node_groups_agree():
    """Splitting the quadrature nodes into groups (the memory guard for flat q) changes nothing."""
    rng = np.random.default_rng(41)
    q = np.exp(2.0 * rng.standard_normal(3000))
    q /= q.sum()
    one = _wor.WorPrefixes(q, 8)
    old = _wor.GROUP_BUDGET
    try:
        _wor.GROUP_BUDGET = 20_000
        many = _wor.WorPrefixes(q, 8)
    finally:
        _wor.GROUP_BUDGET = old
    assert len(one.groups) == 1 and len(many.groups) > 3
    assert np.abs(one.all() - many.all()).max() < 1e-13


def test_without_replacement_quadrature_matches_enumeration():
    """The fast quadrature (light/heavy split, block Taylor moments) equals exact tuple enumeration."""
    rng = np.random.default_rng(5)
    worst, checked = 0.0, 0
    for _ in range(40):
        v = int(rng.integers(8, 13))
        n = int(rng.integers(2, 5))
        p, q = random_pair(rng, v)
        qs = q[md._ratio_order(p, q)]
        qs = qs[qs > 0]
        if qs.size <= n:
            continue
        worst = max(worst, np.abs(md._wor_exact(qs, n) - _wor.WorPrefixes(qs, n).all()).max())
        checked += 1
    assert checked > 20
    assert worst < 1e-12


def test_without_replacement_max_gap_uses_bounds_correctly():
    """Block bounds + refinement give the maximum over every prefix within PRUNE_TOL (V = 3000, n = 8).

    Scale 25 is the peaked case (long stretches of prefixes with gaps ~1e-14) that used to defeat pruning.
    """
    rng = np.random.default_rng(15)
    for scale in (1.0, 3.0, 8.0, 25.0):
        z = rng.standard_normal(3000)
        p = np.exp(scale * z)
        q = np.exp(scale * (z + 0.5 * rng.standard_normal(3000)))
        p, q = p / p.sum(), q / q.sum()
        order = md._ratio_order(p, q)
        qs, ps = q[order], p[order]
        w = _wor.WorPrefixes(qs, 8)
        g = np.concatenate([[0.0], w.all()])
        brute = float(np.max(g - np.concatenate([[0.0], np.cumsum(ps)])))
        fast = w.max_gap(ps)
        assert brute - _wor.PRUNE_TOL - 1e-14 <= fast <= brute + 1e-14
        # and the quadrature agrees with the sequential-draw probabilities on a direct check:
        # g_k for the full support is 1, for k < n it is 0
        assert g[-1] == pytest.approx(1.0, abs=1e-12) and g[7] == 0.0


def test_without_replacement_beats_with_replacement():
    rng = np.random.default_rng(6)
    for _ in range(100):
        p, q = random_pair(rng, int(rng.integers(2, 40)))
        n = int(rng.integers(1, 5))
        assert optimal_acceptance(p, q, n, "without_replacement") >= optimal_acceptance(p, q, n, "with_replacement") - 1e-12


def test_monotone_in_num_drafts_and_edge_cases():
    p = np.array([0.5, 0.5, 0.0])
    q = np.array([0.0, 0.0, 1.0])
    for mode in MODES:
        assert optimal_acceptance(p, q, 1, mode) == pytest.approx(0.0, abs=1e-15)
    # greedy with n = 3 puts the two most likely draft tokens (2, then 0 by lower id) in G
    assert optimal_acceptance(p, q, 3, "greedy") == pytest.approx(0.5)
    # without replacement with a one-token draft support: the drafts are just that token
    assert optimal_acceptance(p, q, 4, "without_replacement") == pytest.approx(0.0, abs=1e-15)
    assert optimal_acceptance([1, 0, 0], [1, 0, 0], 2, "without_replacement") == pytest.approx(1.0)


VERIFIER_MODES = [
    ("rrs", "with_replacement"),
    ("rrs", "without_replacement"),
    ("rrs", "greedy"),
    ("kseq", "with_replacement"),
    ("optimal_greedy", "greedy"),
]


@pytest.mark.parametrize("verifier,mode", VERIFIER_MODES)
def test_verifiers_below_optimum(verifier, mode):
    rng = np.random.default_rng(7)
    for _ in range(80):
        v = int(rng.integers(2, 7))
        n = int(rng.integers(1, 4))
        p, q = random_pair(rng, v)
        rate = verifier_acceptance(p, q, n, mode, verifier)
        assert 0.0 <= rate <= optimal_acceptance(p, q, n, mode) + 1e-9


def test_optimal_greedy_attains_optimum_and_matches_lp():
    rng = np.random.default_rng(8)
    for _ in range(60):
        v = int(rng.integers(2, 7))
        n = int(rng.integers(1, 4))
        p, q = random_pair(rng, v)
        rate = verifier_acceptance(p, q, n, "greedy", "optimal_greedy")
        assert rate == pytest.approx(optimal_acceptance(p, q, n, "greedy"), abs=1e-12)
        assert rate == pytest.approx(optimal_acceptance_lp(p, q, n, "greedy"), abs=1e-9)


def test_kseq_rho_solves_its_equation():
    rng = np.random.default_rng(9)
    for _ in range(40):
        p, q = random_pair(rng, 20)
        n = int(rng.integers(1, 6))
        rho = kseq_rho(p, q, n)
        beta = np.minimum(q, p / rho).sum()
        assert 1.0 <= rho <= n
        assert 1 - (1 - beta) ** n == pytest.approx(rho * beta, abs=1e-10)


# ---------------------------------------------------------------------------------------------------
# Monte Carlo of the verifiers, written directly from their definitions
# ---------------------------------------------------------------------------------------------------


def simulate(p, q, n, mode, verifier, trials, rng):
    """Return (accepted flags, emitted tokens) of ``trials`` independent verification steps."""
    v = p.shape[0]
    accepted = np.zeros(trials, dtype=bool)
    emitted = np.zeros(trials, dtype=np.int64)
    rho = kseq_rho(p, q, n) if verifier == "kseq" else None
    plan = greedy_optimal_plan(p, q, n) if verifier == "optimal_greedy" else None
    for t in range(trials):
        if verifier == "optimal_greedy":
            if plan.sample_probs.sum() > 0:
                y = rng.choice(v, p=plan.sample_probs)
                if rng.random() < plan.accept_probs[y]:
                    accepted[t], emitted[t] = True, y
                    continue
            z = rng.choice(v, p=plan.residual_probs)
            emitted[t], accepted[t] = z, z in set(plan.top_ids.tolist()) | ({int(y)} if plan.sample_probs.sum() > 0 else set())
            continue
        cur = p.copy()
        left = q.copy()
        done = False
        for _ in range(n):
            if left.sum() <= 0:
                break
            prop = left / left.sum() if mode == "without_replacement" else q
            x = rng.choice(v, p=prop)
            if verifier == "kseq":
                if rng.random() < min(1.0, p[x] / (rho * q[x])):
                    accepted[t], emitted[t], done = True, x, True
                    break
                continue
            if rng.random() < min(1.0, cur[x] / prop[x]):
                accepted[t], emitted[t], done = True, x, True
                break
            resid = np.maximum(cur - prop, 0.0)
            cur = resid / resid.sum()
            if mode == "without_replacement":
                left[x] = 0.0
        if not done:
            resid = np.maximum(p - rho * q, 0.0) if verifier == "kseq" else cur
            emitted[t] = rng.choice(v, p=resid / resid.sum())
    return accepted, emitted


CASES = [
    (np.array([0.5, 0.3, 0.15, 0.05]), np.array([0.1, 0.2, 0.3, 0.4]), 3),
    (np.array([0.05, 0.05, 0.6, 0.3]), np.array([0.4, 0.3, 0.2, 0.1]), 2),
]


# RRS over greedy drafts is checked against quickdraft.verification.multidraft.sample_step in test_sampler_agreement.py
@pytest.mark.parametrize("verifier,mode", [vm for vm in VERIFIER_MODES if vm != ("rrs", "greedy")])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_verifier_rate_and_law_match_monte_carlo(verifier, mode, case):
    p, q, n = CASES[case]
    rng = np.random.default_rng(100 + case)
    trials = 6000
    acc, out = simulate(p, q, n, mode, verifier, trials, rng)
    exact = verifier_acceptance(p, q, n, mode, verifier)
    se = math.sqrt(max(exact * (1 - exact), 1e-4) / trials)
    assert abs(acc.mean() - exact) < 4.5 * se
    # negative control: the single-draft rate is a different number and must be rejected
    wrong = 1 - tv(p, q)
    assert abs(acc.mean() - wrong) > 4.5 * se
    # the emitted token follows the target law (chi-square, 3 dof, 0.999 quantile 16.27)
    counts = np.bincount(out, minlength=p.shape[0])
    chi2 = (((counts - trials * p) ** 2) / (trials * p)).sum()
    assert chi2 < 16.27
    chi2_wrong = (((counts - trials * q) ** 2) / (trials * q)).sum()
    assert chi2_wrong > 16.27


@pytest.mark.parametrize(
    "args,match",
    [
        (([0.5, 0.6], [0.5, 0.5], 2, "with_replacement"), "sums to"),
        (([1.5, -0.5], [0.5, 0.5], 2, "with_replacement"), "negative"),
        (([np.nan, 1.0], [0.5, 0.5], 2, "with_replacement"), "NaN"),
        (([0.5, 0.5], [0.2, 0.3, 0.5], 2, "with_replacement"), "vocabulary size"),
        (([0.5, 0.5], [0.5, 0.5], 0, "with_replacement"), "num_drafts"),
        (([0.5, 0.5], [0.5, 0.5], 2.0, "with_replacement"), "num_drafts"),
        (([0.5, 0.5], [0.5, 0.5], 2, "beam"), "unknown sampling"),
        (([[0.5, 0.5]], [[0.5, 0.5]], 2, "greedy"), "1-D"),
    ],
)
def test_invalid_inputs(args, match):
    with pytest.raises(QuickdraftError, match=match):
        optimal_acceptance(*args)


def test_invalid_verifier_combinations():
    p = q = [0.5, 0.5]
    with pytest.raises(QuickdraftError, match="unknown verifier"):
        verifier_acceptance(p, q, 2, "greedy", "spectr")
    for ver, mode in [("kseq", "greedy"), ("kseq", "without_replacement"), ("optimal_greedy", "with_replacement"), ("optimal_greedy", "without_replacement")]:
        with pytest.raises(QuickdraftError, match="not defined"):
            verifier_acceptance(p, q, 2, mode, ver)

