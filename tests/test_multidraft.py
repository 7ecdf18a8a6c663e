"""Tests for quickdraft.verification.multidraft: losslessness of every (sampling, verifier) pair, acceptance rates.

Goodness of fit
---------------
Each lossless check draws N = 100,000 emitted tokens in ONE batched call (B = N identical rows)
and runs Pearson's chi-square test against ``target_probs`` (bins with expected count < 5 pooled).
A check passes when the p-value exceeds ``P_PASS = 1e-4``. Why that bound: the file runs ~25
such tests; under the null each p-value is uniform, so the chance that *any* lossless case fails
by bad luck is at most 25 · 1e-4 = 0.25 % (and the seeds are fixed, so a pass is reproducible).
With N = 100,000 the test still has power: at ~20 degrees of freedom a rejection at 1e-4 needs
a noncentrality of ~60, i.e. ``Σ_x (emitted(x) − p(x))² / p(x) ≳ 6e-4``, a total-variation error
of about 1 %. Every verifier family also has a *negative control*, a realistic bug (no residual
update, proposals that do not match how the drafts were drawn, ρ = 1, the wrong residual), run
through the same helper, that must give a p-value below ``P_FAIL = 1e-6``.

Acceptance rates are compared with closed forms computed here in numpy, independently of the
module, with an exact binomial test at the same 1e-4 level.

Runtime: the heavy calls run once per case (cached) and with one torch thread (on the shared
2-core machine two threads under load are several times slower because of OpenMP barriers);
the thread count is restored after the module.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
import torch
from scipy import optimize, stats

from quickdraft.errors import QuickdraftError
from quickdraft.verification.multidraft import StepResult, sample_step
from quickdraft.verification.multidraft_proposals import (
    Drafts,
    _remove,
    draft_greedy,
    draft_with_replacement,
    draft_without_replacement,
)
from quickdraft.verification.multidraft_verifiers import (
    kseq_beta,
    kseq_residual,
    kseq_rho,
    kseq_verify,
    optimal_greedy_verify,
    rrs_verify,
)
from quickdraft.verification.rules import residual

N = 100_000
P_PASS = 1e-4
P_FAIL = 1e-6

COMBOS = [
    ("with_replacement", "rrs"),
    ("with_replacement", "kseq"),
    ("without_replacement", "rrs"),
    ("greedy", "rrs"),
    ("greedy", "optimal_greedy"),
]
INVALID_COMBOS = [
    ("without_replacement", "kseq"),
    ("greedy", "kseq"),
    ("with_replacement", "optimal_greedy"),
    ("without_replacement", "optimal_greedy"),
]
# (kind, V, n): random / peaked / disjoint from the brief, plus partially overlapping supports
CASES = [
    ("random", 50, 3),
    ("random", 5, 2),
    ("peaked", 20, 3),
    ("peaked_same", 20, 3),
    ("disjoint", 12, 2),
    ("partial", 30, 4),
]


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def make_pair(kind: str, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A (target, draft) pair of float64 distributions over ``vocab`` tokens."""
    rng = np.random.default_rng(seed)
    p, q = np.zeros(vocab), np.zeros(vocab)
    if kind == "random":
        p, q = rng.dirichlet(np.ones(vocab)), rng.dirichlet(np.ones(vocab))
    elif kind == "peaked":  # both peaked (~0.95), on different tokens
        p = 0.05 * rng.dirichlet(np.ones(vocab))
        q = 0.05 * rng.dirichlet(np.ones(vocab))
        p[0] += 0.95
        q[1] += 0.95
    elif kind == "peaked_same":  # target ~0.95 and draft ~0.85 on the same token
        p = 0.05 * rng.dirichlet(np.ones(vocab))
        q = 0.15 * rng.dirichlet(np.ones(vocab))
        p[0] += 0.95
        q[0] += 0.85
    elif kind == "disjoint":
        half = vocab // 2
        p[:half] = rng.dirichlet(np.ones(half))
        q[half:] = rng.dirichlet(np.ones(vocab - half))
    elif kind == "partial":  # p on the first 2/3, q on the last 2/3
        third = vocab // 3
        p[: vocab - third] = rng.dirichlet(np.ones(vocab - third))
        q[third:] = rng.dirichlet(np.ones(vocab - third))
    elif kind == "identical":
        p = rng.dirichlet(np.ones(vocab))
        q = p.copy()
    else:
        raise ValueError(kind)
    return p, q


def batch(p: np.ndarray, q: np.ndarray, rows: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` copies of the pair as ``[rows, V]`` float64 tensors."""
    return (
        torch.from_numpy(p).unsqueeze(0).expand(rows, -1).contiguous(),
        torch.from_numpy(q).unsqueeze(0).expand(rows, -1).contiguous(),
    )


def gof_pvalue(tokens: torch.Tensor | np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of the sample ``tokens`` against ``probs``.

    Bins with expected count < 5 are pooled into one bin (merged into the smallest other bin if
    the pool is still below 5). Any token with probability 0 in the sample gives p-value 0.
    """
    tokens = np.asarray(tokens)
    vocab = len(probs)
    counts = np.bincount(tokens, minlength=vocab)
    if len(counts) > vocab or counts[probs == 0].sum() > 0:
        return 0.0
    expected = len(tokens) * probs / probs.sum()
    small = expected < 5
    obs, exp = list(counts[~small].astype(float)), list(expected[~small])
    if small.any() and expected[small].sum() > 0:
        pooled_obs, pooled_exp = float(counts[small].sum()), float(expected[small].sum())
        if pooled_exp >= 5 or not exp:
            obs.append(pooled_obs)
            exp.append(pooled_exp)
        else:
            j = int(np.argmin(exp))
            obs[j] += pooled_obs
            exp[j] += pooled_exp
    if len(obs) < 2:  # a single bin carries all the mass: nothing left to test
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def binom_pvalue(successes: int, trials: int, prob: float) -> float:
    prob = min(max(prob, 0.0), 1.0)
    return float(stats.binomtest(successes, trials, prob).pvalue)


@functools.lru_cache(maxsize=None)
def run_case(sampling: str, verifier: str, kind: str, vocab: int, n: int, seed: int = 0) -> StepResult:
    p, q = make_pair(kind, vocab, seed)
    target, draft = batch(p, q)
    gen = torch.Generator().manual_seed(1234 + seed)
    return sample_step(target, draft, n, sampling, verifier, generator=gen)


# ---- exact acceptance rates, computed independently in numpy ----------------------------------


def top_and_rest(q: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Top n-1 draft tokens (ties to the lowest id) and q restricted to the rest, renormalised."""
    top = np.argsort(-q, kind="stable")[: n - 1]
    rest = q.copy()
    rest[top] = 0
    return top, rest / rest.sum()


def acceptance_exact(sampling: str, verifier: str, p: np.ndarray, q: np.ndarray, n: int) -> float:
    """Exact acceptance rate of every valid combination (numpy, independent of the module)."""
    if n == 1:
        return float(np.minimum(p, q).sum())
    if (sampling, verifier) == ("with_replacement", "rrs"):
        # the residual after a rejection does not depend on the rejected token
        reject, p_cur = 1.0, p.copy()
        for _ in range(n):
            overlap = np.minimum(p_cur, q).sum()
            reject *= 1 - overlap
            res = np.maximum(p_cur - q, 0)
            p_cur = res / res.sum() if res.sum() > 1e-12 else p_cur
        return 1 - reject
    if (sampling, verifier) == ("with_replacement", "kseq"):
        beta = lambda rho: np.minimum(q, p / rho).sum()  # noqa: E731
        h = lambda rho: rho * beta(rho) - 1 + (1 - beta(rho)) ** n  # noqa: E731
        rho = 1.0 if h(1.0) >= 0 else optimize.brentq(h, 1.0, float(n), xtol=1e-14)
        return 1 - (1 - beta(rho)) ** n
    if (sampling, verifier) == ("without_replacement", "rrs"):
        return _rrs_without_replacement_acceptance(p, q, n)
    if sampling == "greedy":
        top, q_rest = top_and_rest(q, n)
        rest = np.ones(len(p), dtype=bool)
        rest[top] = False
        p_top = p[top].sum()
        if verifier == "optimal_greedy":
            return p_top + np.minimum(p[rest], q_rest[rest]).sum()
        return p_top + np.minimum(p[rest], (1 - p_top) * q_rest[rest]).sum()  # rrs: point-mass tests
    raise AssertionError((sampling, verifier))


def _rrs_without_replacement_acceptance(p_cur: np.ndarray, q_cur: np.ndarray, steps: int) -> float:
    """Pr[some of the next ``steps`` drafts passes], RRS without replacement, by exact recursion.

    The residual after a rejection, norm((p_i - q_i)^+), does not depend on which draft was
    rejected; the next proposal does (it loses that token), so recurse over the rejected token,
    which is x with probability (q_i(x) - p_i(x))^+.
    """
    accept_now = float(np.minimum(p_cur, q_cur).sum())
    res = np.maximum(p_cur - q_cur, 0)
    if steps == 1 or res.sum() < 1e-12:
        return accept_now
    p_next = res / res.sum()
    total = accept_now
    for x in np.flatnonzero(q_cur > p_cur):
        q_next = q_cur.copy()
        q_next[x] = 0
        total += (q_cur[x] - p_cur[x]) * _rrs_without_replacement_acceptance(p_next, q_next / q_next.sum(), steps - 1)
    return total


def optimal_greedy_bruteforce(p: np.ndarray, q: np.ndarray, n: int) -> float:
    """Hu et al.'s alpha* = 1 - max_A (p(A) - Pr[drafts meet A]) by enumerating all subsets A."""
    top, q_rest = top_and_rest(q, n)
    best = 0.0
    for bits in itertools.product([False, True], repeat=len(p)):
        a = np.array(bits)
        meets = 1.0 if a[top].any() else q_rest[a].sum()
        best = max(best, p[a].sum() - meets)
    return 1 - best


# ------------------------------------------------------------------------------------------------
# losslessness: chi-square for every valid combination
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,vocab,n", CASES, ids=[f"{k}-V{v}-n{n}" for k, v, n in CASES])
@pytest.mark.parametrize("sampling,verifier", COMBOS, ids=[f"{s}-{v}" for s, v in COMBOS])
def test_emitted_token_is_distributed_as_target(sampling, verifier, kind, vocab, n):
    p, _ = make_pair(kind, vocab)
    out = run_case(sampling, verifier, kind, vocab, n)
    assert out.tokens.shape == (N,) and out.tokens.dtype == torch.int64
    assert out.drafts.shape == (N, n) and out.drafts.dtype == torch.int64
    assert out.accepted.dtype == torch.bool
    assert torch.equal(out.accepted, (out.drafts == out.tokens.unsqueeze(-1)).any(-1))
    pvalue = gof_pvalue(out.tokens, p)
    assert pvalue > P_PASS, f"{sampling}/{verifier} on {kind}: chi-square p = {pvalue:.2e}"


def test_float32_input_is_lossless():
    p, q = make_pair("random", 10, seed=3)
    target, draft = batch(p.astype(np.float32).astype(np.float64), q)
    out = sample_step(target.float(), draft.float(), 3, "with_replacement", "kseq", torch.Generator().manual_seed(5))
    p32 = torch.tensor(p, dtype=torch.float32).double()
    assert gof_pvalue(out.tokens, (p32 / p32.sum()).numpy()) > P_PASS


# ------------------------------------------------------------------------------------------------
# negative controls: realistic bugs, same helper, must fail
# ------------------------------------------------------------------------------------------------


def _control_setup(kind: str = "random", vocab: int = 20, n: int = 3, seed: int = 7):
    p, q = make_pair(kind, vocab, seed)
    target, draft = batch(p, q)
    return p, target, draft, torch.Generator().manual_seed(99)


def test_gof_helper_rejects_plain_draft_samples():
    p, target, draft, gen = _control_setup()
    tokens = draft_with_replacement(draft, 1, gen).ids[:, 0]  # "always accept the first draft"
    assert gof_pvalue(tokens, p) < P_FAIL


def test_gof_helper_rejects_tokens_outside_the_support():
    p, _ = make_pair("disjoint", 12)
    tokens = np.zeros(1000, dtype=np.int64)
    tokens[0] = 11  # a token with p = 0
    assert gof_pvalue(tokens, p) == 0.0


def test_control_rrs_without_residual_update_fails():
    p, target, draft, gen = _control_setup()
    drafts = draft_with_replacement(draft, 3, gen)
    # bug: every draft is tested against the original p instead of the updated residual p_i
    tokens = torch.full((N,), -1)
    done = torch.zeros(N, dtype=torch.bool)
    for i in range(3):
        x = drafts.ids[:, i]
        u = torch.rand(N, dtype=torch.float64, generator=gen)
        passed = ~done & (u * draft.gather(-1, x[:, None])[:, 0] < target.gather(-1, x[:, None])[:, 0])
        tokens = torch.where(passed, x, tokens)
        done |= passed
    tokens = torch.where(done, tokens, torch.multinomial(residual(target, draft), 1, generator=gen)[:, 0])
    assert gof_pvalue(tokens, p) < P_FAIL


def test_control_rrs_without_replacement_drafts_tested_against_q_fails():
    p, target, draft, gen = _control_setup()
    drafts = draft_without_replacement(draft, 3, gen)
    # bug: forgetting that x_i was drawn from q with the earlier drafts removed
    tokens = rrs_verify(target, Drafts(drafts.ids, [draft] * 3), gen)
    assert gof_pvalue(tokens, p) < P_FAIL


def test_control_rrs_greedy_drafts_tested_as_sampled_fails():
    p, target, draft, gen = _control_setup()
    drafts = draft_greedy(draft, 3, gen)
    # bug: verifying deterministic top tokens as if sampled without replacement from q
    wrong = [draft] + [_remove(draft, drafts.ids[:, :i]) for i in range(1, 3)]
    tokens = rrs_verify(target, Drafts(drafts.ids, wrong), gen)
    assert gof_pvalue(tokens, p) < P_FAIL


def test_control_kseq_with_rho_one_fails():
    p, target, draft, gen = _control_setup()
    drafts = draft_with_replacement(draft, 3, gen)
    tokens = kseq_verify(target, draft, drafts, gen, rho=torch.ones(N, dtype=torch.float64))
    assert gof_pvalue(tokens, p) < P_FAIL


def test_control_optimal_greedy_against_unrestricted_q_fails():
    p, target, draft, gen = _control_setup()
    drafts = draft_greedy(draft, 3, gen)
    # bug: testing the sampled draft against q instead of q_R (and residual (p - q)^+)
    tokens = optimal_greedy_verify(target, Drafts(drafts.ids, drafts.proposals[:-1] + [draft]), gen)
    assert gof_pvalue(tokens, p) < P_FAIL


# ------------------------------------------------------------------------------------------------
# acceptance rates
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling,verifier", COMBOS, ids=[f"{s}-{v}" for s, v in COMBOS])
def test_single_draft_acceptance_is_one_minus_tv(sampling, verifier):
    p, q = make_pair("random", 20, seed=1)
    out = run_case(sampling, verifier, "random", 20, 1, seed=1)
    one_minus_tv = 1 - 0.5 * np.abs(p - q).sum()
    assert binom_pvalue(int(out.accepted.sum()), N, one_minus_tv) > P_PASS
    assert gof_pvalue(out.tokens, p) > P_PASS


@pytest.mark.parametrize("sampling,verifier", COMBOS, ids=[f"{s}-{v}" for s, v in COMBOS])
def test_identical_distributions_always_accept(sampling, verifier):
    p, q = make_pair("identical", 15, seed=2)
    target, draft = batch(p, q, rows=20_000)
    out = sample_step(target, draft, 3, sampling, verifier, torch.Generator().manual_seed(3))
    assert bool(out.accepted.all())


@pytest.mark.parametrize("kind,vocab,n", CASES, ids=[f"{k}-V{v}-n{n}" for k, v, n in CASES])
@pytest.mark.parametrize("sampling,verifier", COMBOS, ids=[f"{s}-{v}" for s, v in COMBOS])
def test_acceptance_matches_closed_form(sampling, verifier, kind, vocab, n):
    p, q = make_pair(kind, vocab)
    exact = acceptance_exact(sampling, verifier, p, q, n)
    out = run_case(sampling, verifier, kind, vocab, n)
    hits = int(out.accepted.sum())
    assert binom_pvalue(hits, N, exact) > P_PASS, f"empirical {hits / N:.4f} vs exact {exact:.4f}"


@pytest.mark.parametrize("sampling,verifier", COMBOS, ids=[f"{s}-{v}" for s, v in COMBOS])
def test_acceptance_grows_with_num_drafts(sampling, verifier):
    p, q = make_pair("random", 20, seed=4)
    target, draft = batch(p, q, rows=30_000)
    rates = []
    for n in (1, 2, 4):
        out = sample_step(target, draft, n, sampling, verifier, torch.Generator().manual_seed(n))
        rates.append(out.accepted.double().mean().item())
    se = 0.5 / np.sqrt(30_000)
    assert rates[0] + 4 * se < rates[1] + 1e-12 and rates[1] + 4 * se < rates[2], rates


def test_optimal_greedy_attains_hu_et_al_optimum_and_beats_rrs():
    for seed in range(3):
        p, q = make_pair("random", 8, seed=10 + seed)
        for n in (2, 3):
            optimum = optimal_greedy_bruteforce(p, q, n)
            assert acceptance_exact("greedy", "optimal_greedy", p, q, n) == pytest.approx(optimum, abs=1e-12)
            assert acceptance_exact("greedy", "rrs", p, q, n) <= optimum + 1e-12
    # the verifier reaches it empirically on the cached cases
    for kind, vocab, n in CASES:
        if vocab <= 12:
            p, q = make_pair(kind, vocab)
            out = run_case("greedy", "optimal_greedy", kind, vocab, n)
            assert binom_pvalue(int(out.accepted.sum()), N, optimal_greedy_bruteforce(p, q, n)) > P_PASS


# ------------------------------------------------------------------------------------------------
# the K-SEQ maths, exactly
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "peaked", "partial", "disjoint", "identical"])
@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_kseq_rho_solves_the_spectr_equation_and_output_identity_holds(kind, n):
    p_np, q_np = make_pair(kind, 30, seed=5)
    p, q = torch.from_numpy(p_np)[None], torch.from_numpy(q_np)[None]
    rho = kseq_rho(p, q, n)
    beta = kseq_beta(p, q, rho)
    assert 1.0 <= rho.item() <= n
    h = (rho * beta - 1 + (1 - beta) ** n).item()
    assert -1e-12 <= h <= 1e-9
    # reference root by Brent's method on the direct formula
    ref_beta = lambda r: np.minimum(q_np, p_np / r).sum()  # noqa: E731
    ref_h = lambda r: r * ref_beta(r) - 1 + (1 - ref_beta(r)) ** n  # noqa: E731
    if ref_h(1.0) < -1e-12:
        assert rho.item() == pytest.approx(optimize.brentq(ref_h, 1.0, float(n), xtol=1e-14), abs=1e-9)
    # emitted law = Pr[first passing draft is x] + Pr[all rejected] * residual(x) = p(x)
    b = beta.item()
    passed_part = sum((1 - b) ** i for i in range(n)) * np.minimum(q_np, p_np / rho.item())
    res = kseq_residual(p, q, n, rho)[0].numpy()
    reject = (1 - b) ** n
    law = passed_part + (reject * res / res.sum() if reject > 1e-15 else 0)
    np.testing.assert_allclose(law, p_np, atol=1e-12)
    assert (res >= 0).all()


# ------------------------------------------------------------------------------------------------
# the draft schemes
# ------------------------------------------------------------------------------------------------


def test_without_replacement_drafts_are_distinct_and_second_draft_has_the_sequential_law():
    _, q = make_pair("random", 10, seed=6)
    _, draft = batch(q, q)
    drafts = draft_without_replacement(draft, 3, torch.Generator().manual_seed(8))
    ids = drafts.ids
    assert (ids[:, 0] != ids[:, 1]).all() and (ids[:, 1] != ids[:, 2]).all() and (ids[:, 0] != ids[:, 2]).all()
    assert gof_pvalue(ids[:, 0], q) > P_PASS
    second = np.array([sum(q[a] * q[b] / (1 - q[a]) for a in range(10) if a != b) for b in range(10)])
    assert gof_pvalue(ids[:, 1], second) > P_PASS
    assert gof_pvalue(ids[:, 0], second) < P_FAIL  # control: the first draft does not have that law


def test_greedy_drafts_are_top_tokens_with_lowest_id_ties_then_a_sample_of_the_rest():
    q = np.array([0.1, 0.3, 0.05, 0.3, 0.2, 0.05])
    _, draft = batch(q, q, rows=50_000)
    drafts = draft_greedy(draft, 3, torch.Generator().manual_seed(9))
    assert (drafts.ids[:, 0] == 1).all() and (drafts.ids[:, 1] == 3).all()
    rest = np.array([0.1, 0, 0.05, 0, 0.2, 0.05]) / 0.4
    assert gof_pvalue(drafts.ids[:, 2], rest) > P_PASS
    np.testing.assert_allclose(drafts.proposals[-1][0].numpy(), rest)


def test_same_seed_same_result():
    p, q = make_pair("random", 10, seed=1)
    target, draft = batch(p, q, rows=100)
    a = sample_step(target, draft, 3, "without_replacement", "rrs", torch.Generator().manual_seed(4))
    b = sample_step(target, draft, 3, "without_replacement", "rrs", torch.Generator().manual_seed(4))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.drafts, b.drafts)


# ------------------------------------------------------------------------------------------------
# bad input
# ------------------------------------------------------------------------------------------------


def _pair(rows: int = 4, vocab: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    p, q = make_pair("random", vocab, seed=0)
    return batch(p, q, rows)


@pytest.mark.parametrize("sampling,verifier", INVALID_COMBOS)
def test_undefined_combinations_raise(sampling, verifier):
    target, draft = _pair()
    with pytest.raises(QuickdraftError, match="not defined"):
        sample_step(target, draft, 2, sampling, verifier)


BAD_INPUTS = {
    "unknown sampling": (lambda t, d: (t, d, 2, "beam", "rrs"), "unknown sampling"),
    "unknown verifier": (lambda t, d: (t, d, 2, "greedy", "typical"), "unknown verifier"),
    "n = 0": (lambda t, d: (t, d, 0, "with_replacement", "rrs"), "num_drafts"),
    "n negative": (lambda t, d: (t, d, -1, "greedy", "rrs"), "num_drafts"),
    "n float": (lambda t, d: (t, d, 2.0, "with_replacement", "rrs"), "num_drafts"),
    "n bool": (lambda t, d: (t, d, True, "with_replacement", "rrs"), "num_drafts"),
    "n None": (lambda t, d: (t, d, None, "with_replacement", "rrs"), "num_drafts"),
    "n > vocab, without replacement": (lambda t, d: (t, d, 7, "without_replacement", "rrs"), "support"),
    "n > vocab, greedy": (lambda t, d: (t, d, 7, "greedy", "optimal_greedy"), "support"),
    "n > draft support": (
        lambda t, d: (t, torch.nn.functional.one_hot(torch.arange(4) % 6, 6).double(), 2, "greedy", "rrs"),
        "support",
    ),
    "1-D target": (lambda t, d: (t[0], d, 2, "with_replacement", "rrs"), r"\[B, V\]"),
    "3-D draft": (lambda t, d: (t, d[None], 2, "with_replacement", "rrs"), r"\[B, V\]"),
    "shape mismatch": (lambda t, d: (t, d[:2], 2, "with_replacement", "rrs"), "same shape"),
    "vocab mismatch": (lambda t, d: (t, torch.full((4, 5), 0.2), 2, "with_replacement", "rrs"), "same shape"),
    "empty vocab": (lambda t, d: (t[:, :0], d[:, :0], 1, "with_replacement", "rrs"), "at least one"),
    "integer dtype": (lambda t, d: (t.long(), d, 1, "with_replacement", "rrs"), "floating"),
    "not a tensor": (lambda t, d: (t.numpy(), d, 1, "with_replacement", "rrs"), "torch.Tensor"),
    "negative prob": (
        lambda t, d: (t - 0.5 * torch.nn.functional.one_hot(torch.zeros(4, dtype=torch.long), 6), d, 1,
                      "with_replacement", "rrs"),
        "negative|sum",
    ),
    "rows do not sum to 1": (lambda t, d: (t, d * 1.5, 1, "with_replacement", "kseq"), "sum to 1"),
    "NaN": (lambda t, d: (t.masked_fill(t > 0.2, float("nan")), d, 1, "with_replacement", "rrs"), "NaN"),
    "inf": (lambda t, d: (t, d.masked_fill(d > 0.2, float("inf")), 1, "with_replacement", "rrs"), "NaN or infinite"),
    "bad generator": (lambda t, d: (t, d, 1, "with_replacement", "rrs", np.random.default_rng(0)), "generator"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_quickdraft_error(name):
    make_args, message = BAD_INPUTS[name]
    target, draft = _pair()
    with pytest.raises(QuickdraftError, match=message):
        sample_step(*make_args(target, draft))


def test_with_replacement_allows_more_drafts_than_support():
    target, draft = _pair(rows=200)
    out = sample_step(target, draft, 9, "with_replacement", "rrs", torch.Generator().manual_seed(0))
    assert out.drafts.shape == (200, 9)


def test_numpy_integer_num_drafts_is_accepted():
    target, draft = _pair(rows=10)
    out = sample_step(target, draft, np.int64(2), "greedy", "optimal_greedy", torch.Generator().manual_seed(0))
    assert out.drafts.shape == (10, 2)
