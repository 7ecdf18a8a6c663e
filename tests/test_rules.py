"""Acceptance rules: exact identities, goodness of fit through verify_chain, hand-built cases.

The goodness-of-fit tests run a two-token speculative generation on small Markov "language models"
(a first-token distribution and a V x V next-token table, for the target and for the draft),
through ``rule.propose`` and :func:`quickdraft.verification.verify.verify_chain` with K = 2, 100,000 times, and
compare the first output token and the (first, second) pair with the target's distributions by a
chi-square test (cells with expected count < 5 pooled). Seeds are fixed, so each test is
deterministic; the bound is a real p-value (> 1e-4) and a negative control must fall below 1e-6.
The negative controls are the gross bug (accept every draft) and realistic ones: a residual built
from the wrong position's draft distribution, one uniform reused at two positions, and
verification against the target at another temperature than the one sampled at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import scipy.stats
import torch

from quickdraft.verification.divergences import DIVERGENCES, get_divergence, jsd
from quickdraft.errors import QuickdraftError
from quickdraft.verification.rules import (
    Fuzzy,
    Greedy,
    Lossless,
    Typical,
    VerifyContext,
    acceptance_probability,
    residual,
    typical_threshold,
)
from quickdraft.verification.sampling import SamplingParams, argmax, logits_to_probs, sample
from quickdraft.verification.verify import verify_chain, verify_greedy_ids

N_SAMPLES = 100_000
K = 2
PASS = 1e-4  # a correct rule must not be rejected at this level
FAIL = 1e-6  # a wrong rule must be rejected at this level


pytestmark = pytest.mark.usefixtures("one_thread")


# -- goodness of fit ----------------------------------------------------------------------------


def chi2_pvalue(codes: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness-of-fit p-value of integer outcomes ``codes`` against ``probs``.

    Cells with expected count < ``min_expected`` are pooled into one cell (merged into the
    smallest other cell if the pool itself is too small). An outcome of probability 0 gives 0.
    """
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(codes, minlength=probs.size)
    if counts[probs == 0].any():
        return 0.0
    expected = codes.size * probs
    big = expected >= min_expected
    obs, exp = list(counts[big].astype(float)), list(expected[big])
    rest_o, rest_e = counts[~big].sum(), expected[~big].sum()
    if rest_e > 0:
        if rest_e >= min_expected or not obs:
            obs.append(rest_o)
            exp.append(rest_e)
        else:
            j = int(np.argmin(exp))
            obs[j] += rest_o
            exp[j] += rest_e
    if len(obs) < 2:
        return 1.0
    exp = np.asarray(exp) * (sum(obs) / sum(exp))
    return float(scipy.stats.chisquare(obs, exp).pvalue)


def test_chi2_pvalue_has_power_and_pools():
    rng = np.random.default_rng(0)
    probs = np.r_[0.5, 0.3, 0.2, np.full(100, 1e-7)]
    assert chi2_pvalue(rng.choice(probs.size, 10_000, p=probs / probs.sum()), probs) > PASS
    assert chi2_pvalue(rng.choice(3, 10_000, p=[0.45, 0.35, 0.2]), probs) < FAIL
    assert chi2_pvalue(np.array([0, 1, 2]), np.array([0.5, 0.5, 0.0])) == 0.0


# -- Markov "language models" and a two-token speculative generation ----------------------------


@dataclass
class MarkovLM:
    first: torch.Tensor  # [V] distribution of the first token
    next: torch.Tensor  # [V, V] row t: distribution after token t

    def dist(self, prev: torch.Tensor | None, b: int) -> torch.Tensor:
        return self.first.expand(b, -1) if prev is None else self.next[prev]

    def joint(self) -> np.ndarray:
        """[V * V] probabilities of (first, second) flattened as first * V + second."""
        return (self.first.double().unsqueeze(1) * self.next.double()).reshape(-1).numpy()


def markov_pair(kind: str, seed: int = 0, v: int = 100) -> tuple[MarkovLM, MarkovLM]:
    """(target, draft) Markov models over ``v`` tokens (8 for ``disjoint``); the draft's logits
    are the target's plus noise."""
    g = torch.Generator().manual_seed(seed)
    if kind == "disjoint":  # the target lives on the lower half of the vocabulary, the draft on the upper
        v = 8
        logits = torch.randn(v + 1, v, generator=g)
        low = torch.arange(v) < v // 2
        t_logits = logits.masked_fill(~low, -math.inf)
        d_logits = logits.masked_fill(low, -math.inf)
        params_t = params_d = SamplingParams(temperature=1.0)
    else:
        scale = {"random": 2.0, "peaked": 8.0, "truncated": 2.0}[kind]
        t_logits = torch.randn(v + 1, v, generator=g) * scale
        d_logits = t_logits + torch.randn(v + 1, v, generator=g) * 1.0
        if kind == "truncated":  # different truncations: zeros in different places
            params_t = SamplingParams(temperature=0.8, top_k=30)
            params_d = SamplingParams(temperature=0.8, top_p=0.8)
        else:
            params_t = params_d = SamplingParams(temperature=1.0)
    tp = logits_to_probs(t_logits, params_t)
    dp = logits_to_probs(d_logits, params_d)
    return MarkovLM(tp[0], tp[1:]), MarkovLM(dp[0], dp[1:])


def spec_step(rule, target, draft, prev, k, gen, positions, row_ids):
    """One speculative step of K drafted tokens after ``prev`` ([B] or None); returns Verification.

    ``target`` is the model whose distributions the verifier is handed (the goodness-of-fit tests
    compare the output with the true target, which a negative control may replace here)."""
    b = row_ids.shape[0]
    ctx = VerifyContext(generator=gen, positions=positions, extra={"row_ids": row_ids})
    ids, draft_probs, target_probs = [], [], [target.dist(prev, b)]
    q = draft.dist(prev, b)
    for i in range(k):
        x = rule.propose(q, ctx, offset=i)
        ids.append(x)
        draft_probs.append(q)
        target_probs.append(target.next[x])
        q = draft.next[x]
    return verify_chain(
        torch.stack(ids, 1), torch.stack(draft_probs, 1), torch.stack(target_probs, 1), rule, ctx=ctx
    )


def generate_two(rule, target, draft, n=N_SAMPLES, k=K, seed=0, chunk=5000):
    """The first two generated tokens of ``n`` independent sequences, ``(y1 [n], y2 [n])``.

    A second speculative step (from the prefix y1, at position 1) runs for the rows whose first
    step emitted only one token.
    """
    gen = torch.Generator().manual_seed(seed)
    y1s, y2s = [], []
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        row_ids = torch.arange(start, start + b)
        first = spec_step(rule, target, draft, None, k, gen, torch.zeros(b, dtype=torch.long), row_ids)
        y1 = first.output_ids[:, 0]
        y2 = first.output_ids[:, 1].clone()
        need = (first.num_accepted == 0).nonzero().squeeze(-1)
        if need.numel():
            second = spec_step(
                rule, target, draft, y1[need], k, gen, torch.ones(need.numel(), dtype=torch.long), row_ids[need]
            )
            y2[need] = second.output_ids[:, 0]
        y1s.append(y1)
        y2s.append(y2)
    return torch.cat(y1s).numpy(), torch.cat(y2s).numpy()


def gof(rule, target, draft, verified=None, **kw) -> tuple[float, float]:
    """p-values of the first token and of the (first, second) pair against ``target``; the
    verifier is handed ``verified``'s distributions (default: ``target``'s)."""
    y1, y2 = generate_two(rule, target if verified is None else verified, draft, **kw)
    v = target.first.shape[0]
    return chi2_pvalue(y1, target.first.double().numpy()), chi2_pvalue(y1 * v + y2, target.joint())


class AlwaysAccept(Lossless):
    """Negative control: sampled drafts, every one accepted — the output follows the draft."""

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return torch.ones_like(draft_ids, dtype=torch.bool), None


class OffByOneResidual(Lossless):
    """Negative control: the recovered token comes from a residual built with the draft
    distribution of the wrong position, norm(max(0, p_i − q_{i+1})) (the last position takes
    q_{i−1}): an indexing slip that leaves acceptance itself correct."""

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        ctx.extra["all_draft_probs"] = draft_probs  # [B, K, V]
        return super().accept(draft_ids, draft_probs, target_probs, ctx)

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        all_draft = ctx.extra["all_draft_probs"][ctx.extra["rows"]]  # [b, K, V]
        k = all_draft.shape[1]
        wrong = torch.where(offsets + 1 < k, offsets + 1, offsets - 1)
        return sample(residual(target_probs, all_draft[torch.arange(offsets.shape[0]), wrong]), ctx.generator)


class StaleNoise(Lossless):
    """Negative control: one uniform per row, reused at every draft position (u_1 = u_2), so a
    position's acceptance is correlated with the previous one's: P(accept x_2 | x_1 accepted) =
    min(1, a_2 / a_1) instead of a_2."""

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        p = target_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)  # [B, K]
        q = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1)
        u = torch.rand(p.shape[0], 1, generator=ctx.generator).expand_as(p)
        return u < acceptance_probability(p, q), None


def tempered(lm_logits: tuple[torch.Tensor, torch.Tensor], temperature: float) -> MarkovLM:
    """The Markov LM of (first-token logits [V], next-token logits [V, V]) at ``temperature``."""
    first, nxt = lm_logits
    params = SamplingParams(temperature=temperature)
    return MarkovLM(logits_to_probs(first, params), logits_to_probs(nxt, params))


# -- Lossless -----------------------------------------------------------------------------------

#: (kind, V) of the goodness-of-fit cases: 100,000 samples over V = 1000 cost ~10 s on this
#: machine (torch.multinomial dominates), so the largest vocabulary goes to the truncated case
GOF_CASES = [("random", 100), ("peaked", 100), ("disjoint", 8), ("truncated", 1000)]


@pytest.mark.parametrize("kind", ["random", "peaked", "disjoint", "truncated"])
def test_lossless_identity_from_its_own_acceptance_probabilities(kind):
    target, draft = markov_pair(kind, v=1000)
    p = torch.cat([target.first.unsqueeze(0), target.next]).double()  # [V+1, V]
    q = torch.cat([draft.first.unsqueeze(0), draft.next]).double()
    a = acceptance_probability(p, q)
    r = residual(p, q)
    accepted_mass = (q * a).sum(-1, keepdim=True)
    torch.testing.assert_close(q * a + (1 - accepted_mass) * r, p, atol=1e-6, rtol=0)
    # the identity is not vacuous: the draft differs, so rejections (and the residual) matter
    assert (accepted_mass < 0.99).any()


def test_lossless_identity_when_draft_equals_target():
    p = logits_to_probs(torch.randn(5, 50, generator=torch.Generator().manual_seed(1)), SamplingParams(1.0)).double()
    a = acceptance_probability(p, p)
    assert (a == 1).all()
    torch.testing.assert_close(p * a + (1 - (p * a).sum(-1, keepdim=True)) * residual(p, p), p)


@pytest.mark.parametrize("kind,v", GOF_CASES)
def test_lossless_goodness_of_fit(kind, v):
    target, draft = markov_pair(kind, v=v)
    p_first, p_pair = gof(Lossless(), target, draft)
    assert p_first > PASS and p_pair > PASS, (p_first, p_pair)


def test_negative_control_always_accept_is_rejected():
    target, draft = markov_pair("random")
    p_first, p_pair = gof(AlwaysAccept(), target, draft, n=N_SAMPLES)
    assert p_first < FAIL and p_pair < FAIL, (p_first, p_pair)


def test_negative_control_off_by_one_residual_is_rejected():
    """Recovered tokens from the wrong position's residual: the first token (recovered from
    max(0, p_1 − q_2) when x_1 is rejected) already fails, on the samples and bound the correct
    rule passes."""
    target, draft = markov_pair("random")
    p_first, p_pair = gof(OffByOneResidual(), target, draft)
    assert p_first < FAIL and p_pair < FAIL, (p_first, p_pair)


def test_negative_control_stale_noise_is_rejected():
    """The same uniform at both draft positions: the first token is still right (its acceptance
    and residual are), the pair is not."""
    target, draft = markov_pair("random")
    p_first, p_pair = gof(StaleNoise(), target, draft)
    assert p_first > PASS and p_pair < FAIL, (p_first, p_pair)


def test_negative_control_wrong_temperature_is_rejected():
    """Sampling at T = 0.8 (the draft samples at 0.8) but verifying against the target's
    distributions at T = 1 (the raw ones, say): the output follows the target at T = 1. The
    correct verification against T = 0.8 passes the same test."""
    g = torch.Generator().manual_seed(0)
    v = 100
    t_logits = torch.randn(v + 1, v, generator=g) * 2.0
    d_logits = t_logits + torch.randn(v + 1, v, generator=g) * 1.0
    target = tempered((t_logits[0], t_logits[1:]), 0.8)
    draft = tempered((d_logits[0], d_logits[1:]), 0.8)
    assert min(gof(Lossless(), target, draft)) > PASS
    p_first, p_pair = gof(Lossless(), target, draft, verified=tempered((t_logits[0], t_logits[1:]), 1.0))
    assert p_first < FAIL and p_pair < FAIL, (p_first, p_pair)


# -- Greedy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", [Greedy(), Lossless()], ids=["greedy", "lossless"])
def test_temperature_zero_reproduces_greedy_decoding(rule):
    g = torch.Generator().manual_seed(4)
    v = 300
    greedy = SamplingParams(temperature=0.0)
    t_logits = torch.randn(v + 1, v, generator=g) * 2
    d_logits = t_logits + torch.randn(v + 1, v, generator=g) * 2  # the draft often disagrees
    tp, dp = logits_to_probs(t_logits, greedy), logits_to_probs(d_logits, greedy)
    target, draft = MarkovLM(tp[0], tp[1:]), MarkovLM(dp[0], dp[1:])
    first = int(t_logits[0].argmax())
    second = int(t_logits[1 + first].argmax())
    y1, y2 = generate_two(rule, target, draft, n=2000, k=3, chunk=500)
    assert (y1 == first).all() and (y2 == second).all()


def test_greedy_accepts_exactly_the_target_argmax():
    target_probs = torch.tensor([[[0.1, 0.6, 0.3], [0.5, 0.2, 0.3], [0.2, 0.2, 0.6]]])
    draft_probs = torch.full((1, 2, 3), 1 / 3)
    out = verify_chain(torch.tensor([[1, 2]]), draft_probs, target_probs, Greedy())
    assert out.output_ids.tolist() == [[1, 0, -1]] and out.num_accepted.tolist() == [1]


def test_argmax_is_torch_argmax_on_every_layout():
    """The NumPy route gives torch.argmax's answer: the first index on ties, for rows, batches, a
    strided view, one row, a -inf filled row, bf16 and a tensor that needs grad (torch's route)."""
    g = torch.Generator().manual_seed(5)
    ties = torch.randint(0, 3, (6, 4, 50), generator=g).float()  # many ties per row
    wide = torch.randn(3, 151_936, generator=g)
    cases = [ties, ties[:, 1:3, 10:40], ties.transpose(0, 1), wide, wide[0], torch.full((2, 9), float("-inf")),
             ties.bfloat16(), ties.clone().requires_grad_()]
    for x in cases:
        got, want = argmax(x), x.argmax(dim=-1)
        assert got.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("k", [0, 1, 4])
def test_verify_greedy_ids_equals_verify_chain_with_one_hot_distributions(k):
    """The engine's token-id verification at temperature 0 walks exactly as verify_chain does with the
    greedy rule and the one-hot distributions logits_to_probs makes: same outputs, acceptances and
    recoveries, for drafts that agree with the target at random, rows that drafted fewer tokens,
    rows that drafted none and logits with ties."""
    g = torch.Generator().manual_seed(11)
    b, v = 64, 7
    greedy = SamplingParams(temperature=0.0)
    t_logits = torch.randint(0, 4, (b, k + 1, v), generator=g).float()  # small integers: many ties
    target_ids = t_logits.argmax(dim=-1)
    agree = torch.rand(b, k, generator=g) < 0.7
    draft_ids = torch.where(agree, target_ids[:, :k], torch.randint(0, v, (b, k), generator=g))
    lengths = torch.randint(0, k + 1, (b,), generator=g)
    draft_probs = torch.zeros(b, k, v).scatter_(-1, draft_ids.unsqueeze(-1), 1.0)
    for draft_lengths in (None, lengths):
        expected = verify_chain(draft_ids, draft_probs, logits_to_probs(t_logits, greedy), Greedy(),
                                draft_lengths=draft_lengths)
        got = verify_greedy_ids(draft_ids, target_ids, draft_lengths)
        assert torch.equal(got.output_ids, expected.output_ids)
        assert torch.equal(got.num_accepted, expected.num_accepted)
        assert torch.equal(got.num_lossy, expected.num_lossy)
    if k:  # the cases the comparison covers: full acceptance, a rejection at the first token, one later
        n = verify_greedy_ids(draft_ids, target_ids).num_accepted
        assert (n == 0).any() and (n == k).any()
        assert k == 1 or ((n > 0) & (n < k)).any()
    with pytest.raises(QuickdraftError, match="target_ids"):
        verify_greedy_ids(draft_ids, target_ids[:, :k])


# -- Fuzzy (FSD) --------------------------------------------------------------------------------


def two_point(a: float) -> torch.Tensor:
    return torch.tensor([a, 1 - a, 0.0, 0.0])


def fsd_case():
    """One row, K = 3, with textbook JS divergences (``jsd``) 0, ~0.22, 0 (V = 4)."""
    draft = torch.stack([two_point(0.5), torch.tensor([0.2, 0.5, 0.3, 0]), two_point(0.5)]).unsqueeze(0)
    target = torch.stack([two_point(0.5), torch.tensor([0.0, 0.1, 0.9, 0]), two_point(0.5), two_point(0.5)]).unsqueeze(0)
    return draft, target


def test_fsd_accepts_longest_prefix_below_threshold_regardless_of_token():
    draft, target = fsd_case()
    d = jsd(target[:, :3], draft)
    assert d[0, 0] == 0 and 0.2 < d[0, 1] < 0.25 and d[0, 2] == 0
    rule = Fuzzy(divergence="jsd", threshold=0.1, use_raw=False)
    for ids in ([[0, 0, 1]], [[1, 3, 0]]):  # the decision ignores which token was drafted
        accepted, lossy = rule.accept(torch.tensor(ids), draft, target[:, :3], VerifyContext())
        assert accepted.tolist() == [[True, False, True]] and torch.equal(lossy, accepted)
        out = verify_chain(torch.tensor(ids), draft, target, rule, generator=torch.Generator().manual_seed(0))
        assert out.num_accepted.tolist() == [1] and out.num_lossy.tolist() == [1]
        assert out.output_ids[0, 0] == ids[0][0]
        assert out.output_ids[0, 1] in (1, 2)  # a sample of the target at the rejected position
    loose = verify_chain(torch.tensor([[0, 0, 1]]), draft, target, Fuzzy(divergence="jsd", threshold=0.3, use_raw=False))
    assert loose.num_accepted.tolist() == [3] and loose.num_lossy.tolist() == [3]


def test_fsd_threshold_limits():
    draft, target = fsd_case()
    ids = torch.tensor([[0, 0, 1]])
    # T = 0 accepts nothing, even where the distributions are identical (D = 0)
    zero = verify_chain(ids, draft, target, Fuzzy(threshold=0.0, use_raw=False))
    assert zero.num_accepted.tolist() == [0]
    # T = inf accepts everything, even an infinite KL (disjoint supports)
    disjoint_draft = torch.tensor([[[0.0, 0, 0, 1]] * 3])
    for div in ("kl", "kl_reverse", "js", "topp_kl"):
        out = verify_chain(ids, disjoint_draft, target, Fuzzy(divergence=div, threshold=math.inf, use_raw=False))
        assert out.num_accepted.tolist() == [3]


def test_fsd_recovers_from_the_target_not_the_residual():
    # target (0.5, 0.5), greedy draft of token 0 with q = one-hot: the residual is one-hot at 1,
    # the target sample is 0 or 1 with probability 1/2 each
    b = 4000
    target = torch.tensor([0.5, 0.5]).expand(b, 2, 2).contiguous()
    draft = torch.tensor([1.0, 0.0]).expand(b, 1, 2).contiguous()
    ids = torch.zeros(b, 1, dtype=torch.long)
    out = verify_chain(ids, draft, target, Fuzzy(threshold=0.1, use_raw=False), generator=torch.Generator().manual_seed(1))
    assert out.num_accepted.sum() == 0
    share = (out.output_ids[:, 0] == 0).float().mean().item()
    assert 0.45 < share < 0.55
    # the bonus is a target sample too (not the argmax, although drafts are greedy)
    bonus = verify_chain(ids, draft, target, Fuzzy(threshold=math.inf, use_raw=False), generator=torch.Generator().manual_seed(2))
    assert 0.45 < (bonus.output_ids[:, 1] == 0).float().mean().item() < 0.55


def test_fsd_uses_raw_distributions_when_asked():
    # processed (temperature 0) distributions agree, raw ones do not
    processed = torch.tensor([[[0.0, 1.0, 0.0]]])
    target = torch.cat([processed, processed], dim=1)
    raw_draft = torch.tensor([[[0.05, 0.9, 0.05]]])
    raw_target = torch.tensor([[[0.45, 0.5, 0.05], [0.3, 0.3, 0.4]]])
    ctx = lambda: VerifyContext(raw_draft_probs=raw_draft, raw_target_probs=raw_target)  # noqa: E731
    ids = torch.tensor([[1]])
    rule = Fuzzy(divergence="tv", threshold=0.2)
    assert rule.needs_raw and not Fuzzy(use_raw=False).needs_raw
    assert verify_chain(ids, processed, target, rule, ctx=ctx()).num_accepted.tolist() == [0]  # TV = 0.4
    assert verify_chain(ids, processed, target, Fuzzy(divergence="tv", threshold=0.2, use_raw=False), ctx=ctx()).num_accepted.tolist() == [1]
    # without raw distributions in the context, the processed ones are used
    assert verify_chain(ids, processed, target, rule).num_accepted.tolist() == [1]


def test_fsd_draft_modes_and_validation():
    assert Fuzzy().greedy_drafts and not Fuzzy(greedy_drafts=False).greedy_drafts
    assert not Fuzzy(hybrid=True).greedy_drafts
    assert Fuzzy(hybrid=True, threshold=0).lossless and not Fuzzy(hybrid=True, threshold=0.1).lossless
    assert Fuzzy(threshold=0).lossless and not Fuzzy(threshold=1e-9).lossless
    probs = torch.tensor([[0.2, 0.5, 0.3]])
    assert Fuzzy().propose(probs, VerifyContext()).tolist() == [1]
    for bad, msg in [
        (dict(threshold=-0.1), "threshold"),
        (dict(threshold=float("nan")), "threshold"),
        (dict(divergence="jensen_shannon"), "unknown divergence"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(hybrid=True, greedy_drafts=True), "sampled drafts"),
    ]:
        with pytest.raises(QuickdraftError, match=msg):
            Fuzzy(**bad)
    assert Fuzzy(threshold=math.inf).threshold == math.inf


def test_fsd_topk_divergence_uses_top_k():
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(2, 3, 100, generator=g).softmax(-1)
    target = torch.randn(2, 4, 100, generator=g).softmax(-1)
    d1 = Fuzzy(divergence="topk_js", top_k=1).divergences(draft, target[:, :3], VerifyContext())
    d50 = Fuzzy(divergence="topk_js", top_k=50).divergences(draft, target[:, :3], VerifyContext())
    assert d1.shape == (2, 3) and (d1 < d50).all()


def test_fsd_topp_divergence_uses_top_p():
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(2, 3, 100, generator=g).softmax(-1)
    target = torch.randn(2, 4, 100, generator=g).softmax(-1)
    for top_p in (0.3, 0.9):
        got = Fuzzy(divergence="topp_js", top_p=top_p).divergences(draft, target[:, :3], VerifyContext())
        assert got.shape == (2, 3)
        torch.testing.assert_close(got, get_divergence("topp_js", top_p=top_p)(target[:, :3], draft))


def test_hybrid_threshold_zero_is_exactly_lossless_draw_for_draw():
    target, draft = markov_pair("random", seed=3)
    a = generate_two(Lossless(), target, draft, n=20_000, seed=7)
    b = generate_two(Fuzzy(hybrid=True, threshold=0.0), target, draft, n=20_000, seed=7)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_hybrid_threshold_zero_goodness_of_fit():
    target, draft = markov_pair("random", seed=5)
    p_first, p_pair = gof(Fuzzy(hybrid=True, threshold=0.0), target, draft)
    assert p_first > PASS and p_pair > PASS, (p_first, p_pair)


def test_hybrid_counts_only_decisive_fuzzy_acceptances():
    # disjoint supports: the lossless test always rejects; T = inf accepts all by the fuzzy rule
    b = 200
    target = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(b, 3, 4).contiguous()
    draft = torch.tensor([0.0, 0.0, 0.5, 0.5]).expand(b, 2, 4).contiguous()
    ids = torch.full((b, 2), 2, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    out = verify_chain(ids, draft, target, Fuzzy(hybrid=True, threshold=math.inf, use_raw=False), generator=gen)
    assert (out.num_accepted == 2).all() and (out.num_lossy == 2).all()
    # T = 0: nothing accepted, recovery from the residual (= the target here)
    out = verify_chain(ids, draft, target, Fuzzy(hybrid=True, threshold=0.0, use_raw=False), generator=gen)
    assert (out.num_accepted == 0).all() and (out.num_lossy == 0).all()
    assert set(out.output_ids[:, 0].tolist()) == {0, 1}
    # identical distributions: the lossless test accepts anyway, so no acceptance is counted lossy
    same = verify_chain(ids, draft, torch.cat([draft, draft[:, :1]], 1), Fuzzy(hybrid=True, threshold=1.0, use_raw=False), generator=gen)
    assert (same.num_accepted == 2).all() and (same.num_lossy == 0).all()


# -- Typical acceptance -------------------------------------------------------------------------


def test_typical_threshold_formula():
    g = torch.Generator().manual_seed(0)
    p = torch.randn(6, 40, generator=g).mul(3).softmax(-1).double()
    h = -(p * p.log()).sum(-1)
    torch.testing.assert_close(typical_threshold(p, 0.09, 0.3), torch.minimum(torch.full_like(h, 0.09), 0.3 * torch.exp(-h)))
    # uniform over 4 tokens: H = ln 4, so δ·exp(-H) = δ/4
    assert typical_threshold(torch.full((4,), 0.25), 0.09, 0.3).item() == pytest.approx(0.075)


def test_typical_boundaries():
    ctx = VerifyContext()
    two = torch.tensor([[[0.5, 0.5, 0.0]]])
    ids = torch.tensor([[0]])
    # threshold = min(ε, δ/2) = ε = 0.5 exactly: p(x) = 0.5 is not strictly above it
    assert Typical(epsilon=0.5, delta=10.0).accept(ids, two, two, ctx)[0].tolist() == [[False]]
    assert Typical(epsilon=0.4999, delta=10.0).accept(ids, two, two, ctx)[0].tolist() == [[True]]
    # δ binding: threshold = δ·exp(-ln 2) = δ/2
    assert Typical(epsilon=1.0, delta=0.98).accept(ids, two, two, ctx)[0].tolist() == [[True]]
    assert Typical(epsilon=1.0, delta=1.02).accept(ids, two, two, ctx)[0].tolist() == [[False]]
    # a one-hot target (H = 0) accepts its argmax iff min(ε, δ) < 1, never another token
    one_hot = torch.tensor([[[0.0, 1.0, 0.0]]])
    assert Typical().accept(torch.tensor([[1]]), one_hot, one_hot, ctx)[0].tolist() == [[True]]
    assert Typical().accept(torch.tensor([[0]]), one_hot, one_hot, ctx)[0].tolist() == [[False]]
    assert Typical(epsilon=1.0, delta=2.0).accept(torch.tensor([[1]]), one_hot, one_hot, ctx)[0].tolist() == [[False]]


def test_typical_recovery_and_lossy_count():
    b = 4000
    target = torch.tensor([0.6, 0.4, 0.0]).expand(b, 2, 3).contiguous()
    draft = torch.tensor([0.0, 0.0, 1.0]).expand(b, 1, 3).contiguous()
    ids = torch.full((b, 1), 2, dtype=torch.long)  # p(x) = 0: always rejected
    gen = torch.Generator().manual_seed(0)
    argmax = verify_chain(ids, draft, target, Typical(recover="argmax"), generator=gen)
    assert (argmax.num_accepted == 0).all() and (argmax.output_ids[:, 0] == 0).all()
    sampled = verify_chain(ids, draft, target, Typical(recover="sample"), generator=gen)
    assert 0.37 < (sampled.output_ids[:, 0] == 1).float().mean().item() < 0.43
    ok = verify_chain(torch.zeros((b, 1), dtype=torch.long), draft, target, Typical(), generator=gen)
    assert (ok.num_accepted == 1).all() and (ok.num_lossy == 1).all()


def test_typical_validation():
    for bad, msg in [
        (dict(epsilon=0.0), "epsilon"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(delta=0.0), "delta"),
        (dict(delta=math.inf), "delta"),
        (dict(recover="residual"), "recover"),
    ]:
        with pytest.raises(QuickdraftError, match=msg):
            Typical(**bad)
    assert not Typical().lossless and Typical(epsilon=1.0).epsilon == 1.0


def test_rule_registry_and_flags():
    from quickdraft.verification.rules import RULES, ExponentialRace

    assert set(RULES) == {"lossless", "greedy", "fsd", "typical", "ersd", "lantern", "contrastive"}
    assert all(RULES[name]().name == name for name in RULES)
    assert [RULES[n]().lossless for n in ("lossless", "greedy", "fsd", "typical", "ersd", "lantern", "contrastive")] == [
        True, True, False, False, True, False, False]
    assert not ExponentialRace().needs_raw and Fuzzy().needs_raw and not Fuzzy(hybrid=True, threshold=0).needs_raw


# -- one validation of probability inputs for verify_chain and multidraft.sample_step -------------


def _valid_chain(b=3, k=2, v=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    draft_probs = torch.rand(b, k, v, generator=gen).softmax(-1)
    target_probs = torch.rand(b, k + 1, v, generator=gen).softmax(-1)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, v), 1, generator=gen).reshape(b, k)
    return draft_ids, draft_probs, target_probs


def _spoil(probs, how):
    probs = probs.clone()
    if how == "unnormalised":
        probs[0, ...] *= 1.5
    elif how == "negative":
        probs[0, ..., 0] -= 0.5
        probs[0, ..., 1] += 0.5  # still sums to 1
    elif how == "all-zero":
        probs[0, ...] = 0.0
    elif how == "infinite":
        probs[0, ..., 0] = float("inf")
    elif how == "NaN":
        probs[0, ..., 0] = float("nan")
    return probs


BAD_PROBS = {"unnormalised": "sum to 1", "negative": "negative probabilities", "all-zero": "all-zero",
             "infinite": "infinite", "NaN": "NaN"}


@pytest.mark.parametrize("how", list(BAD_PROBS))
@pytest.mark.parametrize("which", ["draft_probs", "target_probs"])
def test_verify_chain_and_sample_step_reject_the_same_bad_distributions(how, which):
    from quickdraft.verification.multidraft import sample_step

    draft_ids, draft_probs, target_probs = _valid_chain()
    if which == "draft_probs":
        draft_probs = _spoil(draft_probs, how)
    else:
        target_probs = _spoil(target_probs, how)
    pattern = f"{which} .*{BAD_PROBS[how]}"
    for rule in (Lossless(), Greedy()):
        with pytest.raises(QuickdraftError, match=pattern):
            verify_chain(draft_ids, draft_probs, target_probs, rule, torch.Generator().manual_seed(0))
    step_args = (target_probs[:, 0], draft_probs[:, 0])
    with pytest.raises(QuickdraftError, match=pattern):
        sample_step(*step_args, 1, "with_replacement", "rrs", torch.Generator().manual_seed(0))


def test_distributions_off_by_float_rounding_pass():
    """Engine-like inputs: float32 softmax over a large vocabulary (sums off by ~1e-6), bfloat16
    probabilities (off by up to ~1e-3 / 2), one-hot greedy rows."""
    from quickdraft.verification.sampling import ROW_SUM_TOLERANCE, check_distributions

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 151_936, generator=gen) * 4
    target_probs = logits.softmax(-1)
    check_distributions(target_probs, "target_probs")
    check_distributions(target_probs.bfloat16(), "target_probs")
    draft_probs = torch.nn.functional.one_hot(logits[:, :2].argmax(-1), 151_936).float()
    draft_ids = draft_probs.argmax(-1)
    out = verify_chain(draft_ids, draft_probs, target_probs, Lossless(), gen)
    assert out.output_ids.shape == (2, 3)
    # just inside and just outside the tolerance
    check_distributions(torch.tensor([[0.5, 0.5 + 0.9 * ROW_SUM_TOLERANCE]]), "p")
    with pytest.raises(QuickdraftError, match="sum to 1"):
        check_distributions(torch.tensor([[0.5, 0.5 + 1.1 * ROW_SUM_TOLERANCE]]), "p")


@pytest.mark.parametrize("divergence", sorted(DIVERGENCES))
def test_fsd_at_threshold_zero_is_lossless_draw_for_draw(divergence):
    """``Fuzzy(threshold=0).lossless`` is what the rule does, for every divergence: hybrid FSD
    emits exactly Lossless's tokens (same random stream), plain FSD exactly the target samples of
    plain decoding; neither counts a lossy acceptance. At T > 0 the fuzzy test accepts drafts that
    Lossless rejects (the negative control)."""
    from quickdraft.verification.sampling import sample

    gen = torch.Generator().manual_seed(3)
    b, k, v = 400, 3, 8
    draft_probs = (torch.randn(b, k, v, generator=gen) * 2).softmax(-1)
    target_probs = (torch.randn(b, k + 1, v, generator=gen) * 2).softmax(-1)
    draft_ids = torch.multinomial(draft_probs.reshape(-1, v), 1, generator=gen).reshape(b, k)
    ctx = lambda: VerifyContext(raw_draft_probs=draft_probs, raw_target_probs=target_probs)  # noqa: E731

    def run(rule, seed=5):
        return verify_chain(draft_ids, draft_probs, target_probs, rule, torch.Generator().manual_seed(seed), ctx=ctx())

    exact = run(Lossless())
    hybrid = run(Fuzzy(divergence=divergence, threshold=0, hybrid=True))
    assert Fuzzy(divergence=divergence, threshold=0, hybrid=True).lossless
    assert torch.equal(hybrid.output_ids, exact.output_ids) and torch.equal(hybrid.num_accepted, exact.num_accepted)
    assert int(hybrid.num_lossy.sum()) == 0 and int(exact.num_accepted.sum()) > 0
    plain = run(Fuzzy(divergence=divergence, threshold=0))
    assert Fuzzy(divergence=divergence, threshold=0).lossless
    assert int(plain.num_accepted.sum()) == 0 and int(plain.num_lossy.sum()) == 0
    assert torch.equal(plain.output_ids[:, 0], sample(target_probs[:, 0], torch.Generator().manual_seed(5)))
    loose = Fuzzy(divergence=divergence, threshold=math.inf, hybrid=True)
    assert not loose.lossless
    assert int(run(loose).num_accepted.sum()) > int(exact.num_accepted.sum())


def test_sample_draws_each_row_from_its_own_law_and_rejects_bad_rows():
    """The inverse-CDF sampler: a chi-square fit per row of a batch (zeros never drawn, rows not
    normalised), a control that must fail (counts of one row against the other's law), and clear
    errors for rows that are not distributions."""
    from conftest import chi_square_pvalue

    gen = torch.Generator().manual_seed(7)
    v, n = 500, 20_000
    probs = torch.rand(2, v, generator=gen) ** 4
    probs[:, ::3] = 0.0  # a third of the tokens impossible
    probs[1] *= 5.0  # not normalised
    draws = sample(probs.unsqueeze(1).expand(2, n, v), gen)  # [2, n]
    laws = probs.double().numpy()
    counts = [np.bincount(draws[row].numpy(), minlength=v) for row in range(2)]
    for row in range(2):
        assert counts[row][::3].sum() == 0
        assert chi_square_pvalue(counts[row], laws[row]) > 1e-4
    assert chi_square_pvalue(counts[0], laws[1]) < 1e-6
    for bad in ([[0.5, float("nan")]], [[0.5, -0.1, 0.6]], [[float("inf"), 1.0]], [[0.0, 0.0]]):
        with pytest.raises(QuickdraftError, match="cannot sample"):
            sample(torch.tensor(bad))
