"""Exponential races: the counter-based arrival times, race sampling, ERSD losslessness and
drafter invariance."""

from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.stats
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.verification.race import (
    _signed,
    accept_race_branches,
    arrival_times,
    mix64,
    mix64_int,
    race_candidates,
    race_keys,
    race_sample,
    seed_words,
)
from quickdraft.verification.rules import ExponentialRace, VerifyContext
from quickdraft.verification.sampling import SamplingParams, logits_to_probs
from quickdraft.verification.verify import verify_chain

PASS = 1e-4
FAIL = 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")


def chi2_pvalue(codes: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value of outcomes ``codes`` against ``probs``, small cells pooled (as in
    tests/test_rules.py); an outcome of probability 0 gives 0."""
    probs = np.asarray(probs, dtype=np.float64) / np.sum(probs)
    counts = np.bincount(codes, minlength=probs.size)
    if counts[probs == 0].any():
        return 0.0
    expected = codes.size * probs
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum()).astype(float)
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < min_expected:  # pool too small: fold it into the smallest kept cell
        j = int(np.argmin(exp[:-1]))
        obs[j] += obs[-1]
        exp[j] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    if obs.size < 2:
        return 1.0
    return float(scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


# -- the hash -----------------------------------------------------------------------------------


def test_mix64_matches_python_reference_with_wraparound():
    values = [0, 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF, 0xFEDCBA9876543210]
    got = mix64(torch.tensor([_signed(v) for v in values])).tolist()
    assert [g & (2**64 - 1) for g in got] == [mix64_int(v) for v in values]


def test_keys_are_deterministic_and_distinct():
    rows = torch.arange(50).unsqueeze(1)
    positions = torch.arange(2000).unsqueeze(0)
    keys = race_keys(7, rows, positions)
    assert keys.shape == (50, 2000)
    assert torch.equal(keys, race_keys(7, rows, positions))
    assert torch.unique(keys).numel() == keys.numel()
    assert not torch.equal(keys, race_keys(8, rows, positions))
    with pytest.raises(QuickdraftError, match="seed"):
        race_keys(1.5, rows, positions)


def test_arrival_times_are_exponential_and_uncorrelated():
    keys = race_keys(0, torch.arange(40), torch.zeros(40, dtype=torch.long))
    e = arrival_times(keys, 5000)  # [40, 5000]
    assert e.dtype == torch.float32 and (e > 0).all() and torch.isfinite(e).all()
    assert torch.equal(e, arrival_times(keys, 5000))
    assert scipy.stats.kstest(e.reshape(-1).double().numpy(), "expon").pvalue > PASS
    # neighbouring tokens and neighbouring keys (rows) are uncorrelated
    assert abs(np.corrcoef(e[:, :-1].reshape(-1), e[:, 1:].reshape(-1))[0, 1]) < 0.01
    assert abs(np.corrcoef(e[:-1].reshape(-1), e[1:].reshape(-1))[0, 1]) < 0.01
    # the negative control: a shifted exponential is rejected
    assert scipy.stats.kstest(e.reshape(-1).double().numpy() + 0.01, "expon").pvalue < FAIL
    # chunked regeneration does not depend on how many rows are asked for at once
    assert torch.equal(arrival_times(keys[3:4], 5000)[0], e[3])


# -- race sampling ------------------------------------------------------------------------------


def probs_for(kind: str, v: int, seed: int) -> torch.Tensor:
    logits = torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 2
    params = {
        "random": SamplingParams(temperature=1.0),
        "peaked": SamplingParams(temperature=0.25),
        "truncated": SamplingParams(temperature=0.8, top_k=20, top_p=0.9),
    }[kind]
    return logits_to_probs(logits, params)


@pytest.mark.parametrize("kind", ["random", "peaked", "truncated"])
def test_race_sample_goodness_of_fit(kind):
    n, v = 100_000, 200
    p = probs_for(kind, v, seed=1)
    keys = race_keys(3, torch.arange(n), torch.zeros(n, dtype=torch.long))
    winners = race_sample(p.expand(n, v), keys).numpy()
    assert chi2_pvalue(winners, p.double().numpy()) > PASS
    # negative control: the same races scored against a different distribution
    q = probs_for(kind, v, seed=2)
    assert chi2_pvalue(winners, q.double().numpy()) < FAIL


def test_race_candidates_are_the_earliest_arrivals():
    p = probs_for("random", 300, seed=4).expand(64, 300)
    keys = race_keys(0, torch.arange(64), torch.full((64,), 9))
    cand = race_candidates(p, keys, 5)
    assert cand.shape == (64, 5)
    assert torch.equal(cand[:, 0], race_sample(p, keys))
    ratio = arrival_times(keys, 300) / p  # E_v / p(v), ascending along the candidates
    r = ratio.gather(1, cand)
    assert (r[:, 1:] >= r[:, :-1]).all()
    others = torch.ones_like(ratio, dtype=torch.bool).scatter_(1, cand, False)
    assert (ratio.masked_fill(~others, float("inf")).min(1).values >= r[:, -1]).all()
    for bad in (0, 301, 2.5):
        with pytest.raises(QuickdraftError, match="candidates"):
            race_candidates(p, keys, bad)


def test_zero_probability_tokens_never_win():
    p = torch.zeros(10_000, 50)
    p[:, [3, 17]] = torch.tensor([1e-6, 1.0 - 1e-6])
    winners = race_sample(p, race_keys(0, torch.arange(10_000), torch.zeros(10_000, dtype=torch.long)))
    assert set(winners.tolist()) <= {3, 17}


def test_regenerating_arrivals_is_cheap():
    """B = 1, K = 8, V = 151,936: the target's winners at K + 1 positions."""
    v = 151_936
    probs = torch.rand(1, 9, v).softmax(-1)
    keys = race_keys(0, torch.zeros(1, 1, dtype=torch.long), torch.arange(9).unsqueeze(0))
    race_sample(probs, keys)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        race_sample(probs, keys)
        times.append(time.perf_counter() - t0)
    ms = 1000 * min(times)
    print(f"\nrace_sample [1, 9, {v}]: best of 5 = {ms:.1f} ms")
    assert ms < 250  # generous: the machine is shared; ~10-20 ms when idle


# -- ERSD through verify_chain ------------------------------------------------------------------


class Markov:
    """A first-token distribution and a next-token table; ``dist(prev)`` with prev = -1 at the start."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.table = logits_to_probs(logits, params)  # [V+1, V]: row 0 = first token

    def dist(self, prev: torch.Tensor) -> torch.Tensor:
        return self.table[prev + 1]


def markov_models(v: int, seed: int, noise: float, params=SamplingParams(temperature=1.0)):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(v + 1, v, generator=g) * 2
    return Markov(logits, params), Markov(logits + noise * torch.randn(v + 1, v, generator=g), params)


def ersd_step(rule, target, draft, prev, positions, row_ids, k, propose=None):
    """One chain ERSD step after tokens ``prev [B]``; drafts via the rule unless ``propose`` given."""
    ctx = VerifyContext(positions=positions, extra={"row_ids": row_ids})
    ids, dprobs, tprobs = [], [], [target.dist(prev)]
    last = prev
    for i in range(k):
        q = draft.dist(last)
        x = rule.propose(q, ctx, offset=i) if propose is None else propose(q, i)
        ids.append(x)
        dprobs.append(q)
        tprobs.append(target.dist(x))
        last = x
    return verify_chain(torch.stack(ids, 1), torch.stack(dprobs, 1), torch.stack(tprobs, 1), rule, ctx=ctx)


def generate(rule, target, draft, b, n_tokens, k, propose=None):
    """Speculative generation of ``n_tokens`` per row; rows advance at their own pace."""
    seqs = [[] for _ in range(b)]
    row_ids = torch.arange(b) * 7 + 100  # stable ids that are not the batch index
    while min(len(s) for s in seqs) < n_tokens:
        prev = torch.tensor([s[-1] if s else -1 for s in seqs])
        positions = torch.tensor([len(s) for s in seqs])
        out = ersd_step(rule, target, draft, prev, positions, row_ids, k, propose)
        for r in range(b):
            seqs[r].extend(out.output_ids[r, : int(out.num_accepted[r]) + 1].tolist())
    return [s[:n_tokens] for s in seqs], row_ids


def race_target_alone(seed, target, row_ids, n_tokens):
    prev = torch.full((row_ids.shape[0],), -1)
    out = []
    for t in range(n_tokens):
        prev = race_sample(target.dist(prev), race_keys(seed, row_ids, torch.full_like(row_ids, t)))
        out.append(prev)
    return torch.stack(out, 1).tolist()


@pytest.mark.parametrize("k", [1, 3, 6])
def test_drafter_invariance_token_for_token(k):
    v, b, n_tokens, seed = 40, 12, 24, 11
    rule = ExponentialRace(seed=seed)
    target, close_draft = markov_models(v, seed=0, noise=0.3)
    _, far_draft = markov_models(v, seed=1, noise=5.0)
    uniform = Markov(torch.zeros(v + 1, v), SamplingParams(temperature=1.0))
    reference = race_target_alone(seed, target, torch.arange(b) * 7 + 100, n_tokens)  # generate()'s row ids
    for draft in (target, close_draft, far_draft, uniform):
        seqs, _ = generate(rule, target, draft, b, n_tokens, k)
        assert seqs == reference
    # arbitrary draft tokens that are not race winners at all
    rng = torch.Generator().manual_seed(5)
    seqs, _ = generate(rule, target, close_draft, b, n_tokens, k, propose=lambda q, i: torch.randint(0, v, (q.shape[0],), generator=rng))
    assert seqs == reference
    # and the draft actually helps when it is close: some tokens were accepted
    out = ersd_step(rule, target, close_draft, torch.full((b,), -1), torch.zeros(b, dtype=torch.long), torch.arange(b), k)
    assert (out.num_accepted > 0).any()


def test_verify_chain_output_is_the_target_race_whatever_the_draft():
    b, k, v, seed = 64, 4, 30, 2
    g = torch.Generator().manual_seed(0)
    target_probs = torch.randn(b, k + 1, v, generator=g).mul(2).softmax(-1)
    positions = torch.randint(0, 500, (b,), generator=g)
    row_ids = torch.randperm(b, generator=g)
    keys = race_keys(seed, row_ids.unsqueeze(1), positions.unsqueeze(1) + torch.arange(k + 1))
    winners = race_sample(target_probs, keys)  # [B, K+1]
    rule = ExponentialRace(seed=seed)
    for trial in range(5):
        draft_probs = torch.randn(b, k, v, generator=g).mul(trial).softmax(-1)
        ctx = VerifyContext(positions=positions, extra={"row_ids": row_ids})
        draft_ids = torch.stack([rule.propose(draft_probs[:, i], ctx, offset=i) for i in range(k)], 1)
        if trial == 0:  # the draft proposes the target's own winners: everything is accepted
            draft_ids = winners[:, :k]
        out = verify_chain(draft_ids, draft_probs, target_probs, rule, ctx=ctx)
        for r in range(b):
            n = int(out.num_accepted[r])
            assert out.output_ids[r, : n + 1].tolist() == winners[r, : n + 1].tolist()
        if trial == 0:
            assert (out.num_accepted == k).all()


def two_token_ersd(rule, target, draft, n, chunk=10_000):
    y1s, y2s = [], []
    for start in range(0, n, chunk):
        b = min(chunk, n - start)
        row_ids = torch.arange(start, start + b)
        first = ersd_step(rule, target, draft, torch.full((b,), -1), torch.zeros(b, dtype=torch.long), row_ids, 2)
        y1, y2 = first.output_ids[:, 0], first.output_ids[:, 1].clone()
        need = (first.num_accepted == 0).nonzero().squeeze(-1)
        if need.numel():
            second = ersd_step(rule, target, draft, y1[need], torch.ones(need.numel(), dtype=torch.long), row_ids[need], 2)
            y2[need] = second.output_ids[:, 0]
        y1s.append(y1)
        y2s.append(y2)
    return torch.cat(y1s).numpy(), torch.cat(y2s).numpy()


class AcceptAllRace(ExponentialRace):
    """Negative control: the draft's race winners are always accepted — the output follows q."""

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return torch.ones_like(draft_ids, dtype=torch.bool), None


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=10, top_p=0.9)], ids=["plain", "truncated"]
)
def test_ersd_goodness_of_fit(params):
    v, n = 60, 100_000
    target, draft = markov_models(v, seed=3, noise=1.0, params=params)
    p1 = target.table[0].double()
    joint = (p1.unsqueeze(1) * target.table[1:].double()).reshape(-1).numpy()
    y1, y2 = two_token_ersd(ExponentialRace(seed=4), target, draft, n)
    assert chi2_pvalue(y1, p1.numpy()) > PASS
    assert chi2_pvalue(y1 * v + y2, joint) > PASS
    y1, y2 = two_token_ersd(AcceptAllRace(seed=4), target, draft, n)
    assert chi2_pvalue(y1, p1.numpy()) < FAIL and chi2_pvalue(y1 * v + y2, joint) < FAIL


def test_ersd_at_temperature_zero_is_greedy():
    target, draft = markov_models(50, seed=6, noise=2.0, params=SamplingParams(temperature=0.0))
    seqs, _ = generate(ExponentialRace(seed=9), target, draft, 4, 12, 3)
    prev, greedy = torch.tensor(-1), []
    for _ in range(12):
        prev = target.dist(prev).argmax()
        greedy.append(int(prev))
    assert all(s == greedy for s in seqs)


def test_ersd_needs_positions_and_validates():
    rule = ExponentialRace()
    with pytest.raises(QuickdraftError, match="positions"):
        rule.propose(torch.full((2, 5), 0.2), VerifyContext())
    for bad in (dict(seed=1.5), dict(candidates=0), dict(candidates=True)):
        with pytest.raises(QuickdraftError):
            ExponentialRace(**bad)
    ctx = VerifyContext(positions=torch.zeros(2, dtype=torch.long), extra={"row_ids": torch.arange(3)})
    with pytest.raises(QuickdraftError, match="row_ids"):
        rule.propose(torch.full((2, 5), 0.2), ctx)


def test_row_ids_default_to_the_batch_index_and_key_the_noise():
    rule = ExponentialRace(seed=1)
    q = torch.full((2000, 20), 0.05)
    pos = torch.zeros(2000, dtype=torch.long)
    by_index = rule.propose(q, VerifyContext(positions=pos))
    assert torch.equal(by_index, rule.propose(q, VerifyContext(positions=pos, extra={"row_ids": torch.arange(2000)})))
    shifted = rule.propose(q, VerifyContext(positions=pos, extra={"row_ids": torch.arange(2000) + 1}))
    assert torch.equal(shifted[:-1], by_index[1:])  # row ids, not batch slots, carry the randomness
    assert not torch.equal(shifted, by_index)


# -- several candidates (small trees) -----------------------------------------------------------


def test_accept_race_branches_worked_example():
    cand = torch.tensor([[[7, 7, 2], [1, 4, 9]]])  # [B=1, K=2, n=3]: branches [7,1], [7,4], [2,9]
    winners = torch.tensor([[[7, 7, 7], [4, 4, 3], [5, 5, 0]]])  # after [7] -> 4, after [7,4] -> 5
    out, n_acc, branch = accept_race_branches(cand, winners)
    assert out.tolist() == [[7, 4, 5]] and n_acc.tolist() == [2] and branch.tolist() == [1]
    # no match at depth 0: the target's winner is emitted
    out, n_acc, branch = accept_race_branches(cand, torch.full((1, 3, 3), 8))
    assert out.tolist() == [[8, -1, -1]] and n_acc.tolist() == [0] and branch.tolist() == [0]
    with pytest.raises(QuickdraftError, match="target_winners"):
        accept_race_branches(cand, winners[:, :2])


def test_branches_are_drafter_invariant_and_more_candidates_accept_more():
    v, b, k, n, seed = 30, 300, 3, 3, 5
    target, draft = markov_models(v, seed=8, noise=1.5)
    rule = ExponentialRace(seed=seed, candidates=n)
    row_ids = torch.arange(b)
    pos = torch.full((b,), 4)
    ctx = VerifyContext(positions=pos, extra={"row_ids": row_ids})
    prev = torch.randint(0, v, (b,), generator=torch.Generator().manual_seed(0))
    # branch j: the draft's j-th earliest arrival at depth 0, then the draft's race winners
    cand = [rule.propose_candidates(draft.dist(prev), ctx, 0)]  # [B, n]
    assert torch.equal(cand[0][:, 0], rule.propose(draft.dist(prev), ctx, 0))
    for i in range(1, k):
        q = draft.dist(cand[-1].reshape(-1)).reshape(b, n, v)
        keys = rule.keys(ctx, b, i, q.device).unsqueeze(1).expand(b, n)
        cand.append(race_sample(q, keys))
    cand = torch.stack(cand, 1)  # [B, K, n]
    # the target's winners after each branch prefix
    winners = [race_sample(target.dist(prev), rule.keys(ctx, b, 0, prev.device)).unsqueeze(1).expand(b, n)]
    for i in range(1, k + 1):
        keys = rule.keys(ctx, b, i, prev.device).unsqueeze(1).expand(b, n)
        winners.append(race_sample(target.dist(cand[:, i - 1].reshape(-1)).reshape(b, n, v), keys))
    winners = torch.stack(winners, 1)  # [B, K+1, n]
    out, n_acc, branch = accept_race_branches(cand, winners)
    # the output is the target's own race, token for token
    reference, last = [], prev
    for i in range(k + 1):
        last = race_sample(target.dist(last), rule.keys(ctx, b, i, prev.device))
        reference.append(last)
    reference = torch.stack(reference, 1)
    for r in range(b):
        m = int(n_acc[r])
        assert out[r, : m + 1].tolist() == reference[r, : m + 1].tolist()
    # one candidate (branch 0 alone) is chain ERSD; more candidates never accept less
    out1, n_acc1, _ = accept_race_branches(cand[:, :, :1], winners[:, :, :1])
    assert (n_acc >= n_acc1).all() and (n_acc > n_acc1).any()
    chain = ExponentialRace(seed=seed)
    draft_probs = torch.stack([draft.dist(prev)] + [draft.dist(cand[:, i - 1, 0]) for i in range(1, k)], 1)
    target_probs = torch.stack([target.dist(prev)] + [target.dist(cand[:, i, 0]) for i in range(k)], 1)
    via_chain = verify_chain(cand[:, :, 0], draft_probs, target_probs, chain, ctx=ctx)
    assert torch.equal(via_chain.output_ids, out1) and torch.equal(via_chain.num_accepted, n_acc1)


def test_race_keys_take_one_seed_per_row():
    """A tensor of seeds (their 64-bit patterns) keys each row as the scalar seed would, including
    seeds outside int64 (reduced modulo 2**64) and negative ones; bad seeds are named."""
    seeds = [0, 7, 2 ** 64 - 1, -5, 2 ** 70 + 3]
    rows = torch.tensor([0, 3, 1, 2, 0])
    positions = torch.tensor([[4, 5, 6]] * 5)
    keyed = race_keys(seed_words(seeds).unsqueeze(1), rows.unsqueeze(1), positions)
    for r, s in enumerate(seeds):
        assert torch.equal(keyed[r], race_keys(s, rows[r], positions[r]))
    assert torch.equal(race_keys(seed_words([-5]), rows[:1], positions[0, :1]), race_keys(2 ** 64 - 5, rows[:1], positions[0, :1]))
    assert len(set(keyed[:, 0].tolist())) == 5  # different seeds, different keys
    with pytest.raises(QuickdraftError, match="race seed must be an integer"):
        seed_words([1, "2"])
    with pytest.raises(QuickdraftError, match="int64"):
        race_keys(torch.tensor([1.0]), rows[:1], positions[0, :1])
