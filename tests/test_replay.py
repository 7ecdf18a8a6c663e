"""Replay of greedy speculative decoding: the walk's arithmetic, the clairvoyant bound against brute
force, and exact agreement of replayed step counts with the engine on tiny models."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Confidence, Constant, CostAware, Heuristic, SpecDecPP
from quickdraft.adaptive.replay import clairvoyant, draft_chains, race_proposer, walk
from quickdraft.backends.costs import StepCost, measure_step_cost
from quickdraft.verification.rules import ExponentialRace
from quickdraft.verification.sampling import SamplingParams
from quickdraft.backends.runner import ModelRunner

from conftest import TINY_VOCAB
from test_policies import confidence_head, drawing, random_head

COST = StepCost(target=(1.0, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6), draft=0.3, overhead=0.02)


def test_walk_counts_steps_by_hand():
    # starts 0..7; k = 3: step at 0 accepts 3 (emits 4) -> 4 accepts 0 -> 5 drafts 2 (3 tokens left:
    # 2 drafts and the bonus), accepts 2 (emits 3) -> 8 = end
    match = [5, 0, 0, 0, 0, 2, 0, 0]
    r = walk(8, match, lambda j: 3, COST, first=0)
    assert (r.steps, r.drafted, r.accepted, r.lengths) == (3, 8, 5, [3, 3, 2])
    assert r.seconds == pytest.approx(2 * (3 * 0.3 + 1.2 + 0.02) + (2 * 0.3 + 1.1 + 0.02))
    # k = 1: starts 0 (accepts 1) -> 2 -> 3 -> 4 -> 5 (accepts 1) -> 7 (the last token: no draft) -> end
    r1 = walk(8, match, lambda j: 1, first=0)
    assert (r1.steps, r1.drafted, r1.accepted, r1.seconds) == (6, 5, 2, 0.0)
    assert r1.lengths == [1, 1, 1, 1, 1, 0]
    # as the engine runs, after the prefill's token: starts 1 -> 2 -> 3 -> 4 -> 5 (2 drafts, both accepted) -> end
    r2 = walk(8, match, lambda j: 3)
    assert (r2.steps, r2.drafted, r2.accepted, r2.lengths) == (5, 14, 2, [3, 3, 3, 3, 2])


def test_walk_rejects_bad_input():
    with pytest.raises(QuickdraftError, match="match length"):
        walk(4, [1, 1], lambda j: 1)
    with pytest.raises(QuickdraftError, match=">= 0"):
        walk(2, [0, 0], lambda j: -1)
    with pytest.raises(QuickdraftError, match="min_k"):
        clairvoyant(2, [0, 0], COST, 2, min_k=3)
    with pytest.raises(QuickdraftError, match="verification"):
        COST.step(7)
    with pytest.raises(QuickdraftError, match="positive"):
        StepCost(target=(), draft=0.1)


def test_a_plain_step_emits_one_token_and_tells_the_policy():
    """A choice of 0 is a plain step: one target forward over one token, no draft, and the policy
    hears ``update(0, 0)``; a draft cut to nothing by the end of the output is not reported."""
    heard = []
    r = walk(6, [3, 3, 0, 0, 0, 0], lambda j: 0 if j < 3 else 2, COST, update=lambda k, a: heard.append((k, a)))
    # starts 1, 2 plain; 3: 2 drafts, none accepted; 4: 1 draft (cut by the end); 5: none left
    assert (r.steps, r.drafted, r.accepted, r.lengths) == (5, 3, 0, [0, 0, 2, 1, 0])
    assert r.seconds == pytest.approx(2 * (1.0 + 0.02) + (2 * 0.3 + 1.1 + 0.02) + (0.3 + 1.05 + 0.02) + (1.0 + 0.02))
    assert heard == [(0, 0), (0, 0), (2, 0), (1, 0)]


def _brute_force(n, match, cost, max_k, j=1, min_k=1):  # from the first token after the prefill's
    if j >= n:
        return 0.0
    drafts = {min(k, n - j - 1) for k in range(min_k, max_k + 1)}  # the engine drafts no more than is left
    return min(cost.step(k) + _brute_force(n, match, cost, max_k, j + min(match[j], k) + 1, min_k) for k in drafts)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("min_k", [1, 0])
def test_clairvoyant_equals_brute_force_and_beats_every_fixed_k(seed, min_k):
    rng = random.Random(seed)
    n, max_k = 9, 4
    match = [rng.choice([0, 0, 1, 2, 4, 6]) for _ in range(n)]
    best = clairvoyant(n, match, COST, max_k, min_k=min_k)
    assert best.seconds == pytest.approx(_brute_force(n, match, COST, max_k, min_k=min_k))
    fixed = [walk(n, match, lambda j, k=k: k, COST).seconds for k in range(min_k, max_k + 1)]
    assert best.seconds <= min(fixed) + 1e-12
    # and it is no better than brute force over every per-start choice (the bound is attained)
    choices = itertools.product(range(min_k, max_k + 1), repeat=n)
    assert min(walk(n, match, lambda j, c=c: c[j], COST).seconds for c in choices) == pytest.approx(best.seconds)
    if min_k == 0:  # plain steps can only help
        assert best.seconds <= clairvoyant(n, match, COST, max_k).seconds + 1e-12


def _engine_run(target_model, draft_model, prompt, policy, n, rule=None, sampling=SamplingParams(temperature=0.0)):
    out = generate(ModelRunner(target_model, "target"), [prompt], method="sd",
                   drafter=ModelDrafter(ModelRunner(draft_model, "draft"), TINY_VOCAB), policy=policy,
                   rule=rule, sampling=sampling, max_new_tokens=n)
    return out.sequences[0], out.batch_metrics


def _factories(draft_model):
    return {
        "k3": lambda: Constant(3),
        "confidence": lambda: Confidence(p_min=0.1, max_k=8, output_head=draft_model.lm_head),
        "specdecpp": lambda: SpecDecPP(random_head(0), threshold=0.5, max_k=8),
        "specdecpp_stats": lambda: SpecDecPP(
            confidence_head([1.0, 0.0, 0.0, 1.0], bias=1.0, mean=[0.09, 0, 0, -3.0], std=[0.02, 1, 1, 0.5]),
            threshold=0.5, max_k=8),
        "specdecpp_drawing": lambda: SpecDecPP(
            drawing(confidence_head([1.0, 0.0, 0.0, 1.0], bias=1.0, mean=[0.09, 0, 0, -3.0], std=[0.02, 1, 1, 0.5])),
            threshold=0.5, max_k=8),
    }


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 5], [9, 10, 11, 12, 13, 14, 15]])
def test_replay_reproduces_the_engine_step_by_step(tiny_target, tiny_draft, prompt):
    n, max_k = 40, 8
    factories = _factories(tiny_draft)
    output, _ = _engine_run(tiny_target, tiny_draft, prompt, Constant(2), n)
    table = draft_chains(ModelRunner(tiny_draft, "draft"), prompt, output, factories, max_k, TINY_VOCAB)
    assert len(table.match) == len(output) == n
    checked = 0
    for name, make in factories.items():
        seq, metrics = _engine_run(tiny_target, tiny_draft, prompt, make(), n)
        assert seq == output  # greedy: every policy emits the same text
        r = walk(n, table.match, lambda j, s=table.stops[name]: s[j])
        assert (r.steps, r.drafted) == (metrics.steps, metrics.drafted_tokens), name
        # the last step may accept draft tokens beyond the output's end, which the replay cannot see
        assert metrics.accepted_tokens - r.lengths[-1] <= r.accepted <= metrics.accepted_tokens, name
        checked += len(set(r.lengths)) > 1
    assert checked >= 2  # the adaptive policies really varied the length
    pol = Heuristic(initial_k=2, max_k=8)
    seq, metrics = _engine_run(tiny_target, tiny_draft, prompt, Heuristic(initial_k=2, max_k=8), n)
    r = walk(n, table.match, lambda j: pol.begin_step(), update=lambda k, a: pol.update(k, torch.tensor([a])))
    assert (r.steps, r.drafted) == (metrics.steps, metrics.drafted_tokens)
    # the cost policy, stateful and free to make plain steps: a curve where one draft token pays
    # only at a high acceptance rate, so that the run mixes plain steps, probes and drafts
    costs = StepCost(target=(1.0, 1.3, 1.5, 1.7, 1.9, 2.1, 2.3, 2.5, 2.7), draft=0.12)
    pol = CostAware(max_k=8, costs=costs)
    seq, metrics = _engine_run(tiny_target, tiny_draft, prompt, CostAware(max_k=8, costs=costs), n)
    r = walk(n, table.match, lambda j: pol.begin_step(), costs,
             update=lambda k, a: pol.update(k, torch.tensor([a])))
    assert seq == output and (r.steps, r.drafted) == (metrics.steps, metrics.drafted_tokens)
    assert 0 in r.lengths and max(r.lengths) > 0, r.lengths


SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)


@pytest.mark.parametrize("seed", [0, 5])
def test_ersd_replay_reproduces_the_engine_at_temperature(tiny_target, tiny_draft, seed):
    """ERSD is drafter-invariant: at T = 0.8 every policy emits the same text, and the race chains
    replay the engine's steps and drafted tokens exactly."""
    prompt, n, max_k = [1, 2, 3, 4, 5], 40, 8
    rule = ExponentialRace(seed=seed)
    factories = _factories(tiny_draft)
    output, _ = _engine_run(tiny_target, tiny_draft, prompt, Constant(2), n, rule, SAMPLED)
    table = draft_chains(ModelRunner(tiny_draft, "draft"), prompt, output, factories, max_k, TINY_VOCAB,
                         propose=race_proposer(seed, SAMPLED))
    assert 0 < sum(m > 0 for m in table.match) < n  # the race chains hit and miss
    greedy_out, _ = _engine_run(tiny_target, tiny_draft, prompt, Constant(2), n)
    assert output != greedy_out  # really sampled
    for name, make in factories.items():
        seq, metrics = _engine_run(tiny_target, tiny_draft, prompt, make(), n, rule, SAMPLED)
        assert seq == output, name
        r = walk(n, table.match, lambda j, s=table.stops[name]: s[j])
        assert (r.steps, r.drafted) == (metrics.steps, metrics.drafted_tokens), name
    # negative control: the chains of another seed's race do not replay this run
    other = draft_chains(ModelRunner(tiny_draft, "draft"), prompt, output, {"k3": lambda: Constant(3)}, max_k,
                         TINY_VOCAB, propose=race_proposer(seed + 1, SAMPLED))
    _, metrics = _engine_run(tiny_target, tiny_draft, prompt, Constant(3), n, rule, SAMPLED)
    r = walk(n, other.match, lambda j: 3)
    assert (r.steps, r.accepted) != (metrics.steps, metrics.accepted_tokens)


@pytest.mark.parametrize("sampled", [False, True])
def test_chains_drafted_in_batch_rows_equal_one_at_a_time(tiny_target, tiny_draft, sampled):
    prompt, n, max_k = [1, 2, 3, 4, 5], 30, 8
    sampling = SAMPLED if sampled else SamplingParams(temperature=0.0)
    rule = ExponentialRace(seed=2) if sampled else None
    output, _ = _engine_run(tiny_target, tiny_draft, prompt, Constant(2), n, rule, sampling)
    propose = race_proposer(2, sampling) if sampled else None
    runner = ModelRunner(tiny_draft, "draft")
    one = draft_chains(runner, prompt, output, _factories(tiny_draft), max_k, TINY_VOCAB, propose=propose)
    for rows in (4, 7, 64):  # groups that do not divide n, and one group for all starts
        many = draft_chains(runner, prompt, output, _factories(tiny_draft), max_k, TINY_VOCAB, propose=propose,
                            rows=rows)
        assert (many.match, many.stops) == (one.match, one.stops), rows
        assert many.forwards == one.forwards
    assert len(set(one.match)) > 2 and len(set(one.stops["specdecpp"])) > 1  # not a degenerate table
    with pytest.raises(QuickdraftError, match="rows"):
        draft_chains(runner, prompt, output, _factories(tiny_draft), max_k, TINY_VOCAB, rows=0)


def test_replay_step_counts_differ_when_the_chain_is_wrong(tiny_target, tiny_draft):
    """Negative control: the replay of one output's chains does not fit another output."""
    prompt, n = [1, 2, 3, 4, 5], 40
    output, _ = _engine_run(tiny_target, tiny_draft, prompt, Constant(2), n)
    other, _ = _engine_run(tiny_target, tiny_draft, [9, 10, 11, 12, 13, 14, 15], Constant(2), n)
    table = draft_chains(ModelRunner(tiny_draft, "draft"), prompt, other, {"k3": lambda: Constant(3)}, 8, TINY_VOCAB)
    _, metrics = _engine_run(tiny_target, tiny_draft, prompt, Constant(3), n)
    r = walk(n, table.match, lambda j: 3)
    assert (r.steps, r.accepted) != (metrics.steps, metrics.accepted_tokens)


def test_measure_step_cost_times_every_size_and_restores_the_caches(tiny_target, tiny_draft):
    target, draft = ModelRunner(tiny_target, "target"), ModelRunner(tiny_draft, "draft")
    context = list(range(1, 12))
    cost = measure_step_cost(target, draft, context, max_k=4, repeats=2)
    assert len(cost.target) == 5 and min(cost.target) > 0 and cost.draft > 0
    assert int(target.lengths[0]) == int(draft.lengths[0]) == len(context)
    cost.step(4)  # a 5-token verification has a time
    with pytest.raises(QuickdraftError, match="max_k"):
        measure_step_cost(target, draft, context[:4], max_k=4)
    # over batches: every row count of the grid, each over every size; the runners keep one row
    batched = measure_step_cost(target, draft, context, max_k=3, repeats=1, max_rows=3)
    assert [r.rows for r in batched.batched] == [2, 4] and batched.max_rows == 4
    assert all(len(r.target) == 4 and min(r.target) > 0 and r.draft > 0 for r in batched.batched)
    assert target.batch_size == draft.batch_size == 1 and int(target.lengths[0]) == len(context)
    with pytest.raises(QuickdraftError, match="max_rows"):
        measure_step_cost(target, draft, context, max_k=3, max_rows=0)


class _Counting:
    """A runner that records the rows and sizes of its forwards; ``fork=False`` hides ``select_rows``."""

    def __init__(self, runner, fork: bool):
        self.runner, self.fork, self.calls = runner, fork, []

    def __getattr__(self, name):
        if name == "select_rows" and not self.fork:
            raise AttributeError(name)
        return getattr(self.runner, name)

    def forward(self, ids, **kwargs):
        self.calls.append(tuple(ids.shape))
        return self.runner.forward(ids, **kwargs)


@pytest.mark.parametrize("fork", [True, False])
def test_measure_step_cost_prefills_once_where_rows_fork(tiny_target, tiny_draft, fork):
    target = _Counting(ModelRunner(tiny_target, "target"), fork)
    draft = _Counting(ModelRunner(tiny_draft, "draft"), fork)
    context = list(range(1, 12))
    cost = measure_step_cost(target, draft, context, max_k=2, repeats=1, max_rows=4)
    assert [r.rows for r in cost.batched] == [2, 4]
    for runner in (target, draft):
        prefills = [shape for shape in runner.calls if shape[1] == len(context)]
        # forks: one prefill of one row; without select_rows: one per row count, one row again last
        assert prefills == ([(1, 11)] if fork else [(1, 11), (2, 11), (4, 11), (1, 11)])
        assert {shape[0] for shape in runner.calls} == {1, 2, 4}  # every row count timed
        assert runner.batch_size == 1 and int(runner.lengths[0]) == len(context)
    # the forked rows continue like the context in one row
    assert torch.allclose(target.runner.forward(torch.tensor([[5]]), logits_to_keep=1).logits,
                          _alone(tiny_target, context + [5]), atol=1e-5)


def _alone(model, ids):
    runner = ModelRunner(model, "alone")
    runner.reset(1)
    return runner.forward(torch.tensor([ids]), logits_to_keep=1).logits


def test_select_rows_forks_rows_that_continue_like_their_source(tiny_draft):
    runner = ModelRunner(tiny_draft, "draft")
    prompts = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 8]])
    runner.reset(2)
    runner.forward(prompts, torch.tensor([[False, False, True, True, True], [True] * 5]))
    runner.select_rows([1, 1, 0])
    assert runner.lengths.tolist() == [5, 5, 3]
    forked = runner.forward(torch.tensor([[9], [9], [9]]), logits_to_keep=1).logits[:, -1]
    for row, prompt in ((0, [4, 5, 6, 7, 8, 9]), (1, [4, 5, 6, 7, 8, 9]), (2, [1, 2, 3, 9])):
        alone = ModelRunner(tiny_draft, "draft")
        alone.reset(1)
        ref = alone.forward(torch.tensor([prompt]), logits_to_keep=1).logits[0, -1]
        torch.testing.assert_close(forked[row], ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(QuickdraftError, match="out of range"):
        runner.select_rows([3])
