"""ERSD with several race candidates per position (a race tree) on the tree machinery.

Step level (Markov tables, exact)
---------------------------------
A first-order Markov "target" and "draft" over a small vocabulary (``V = 12``): the distribution
after a node depends only on its token, so :func:`quickdraft.decoding.tree.build_tree` can run with table
lookups in place of draft forwards and :func:`quickdraft.decoding.tree_decoding.verify_tree` with the
target's table rows as the tree forward. ``race_tree_generate`` runs whole tree steps on
``N = 100,000`` independent rows (distinct row ids key distinct arrival times) until every row
has 3 tokens; the emitted 3-token sequences are compared with the exact joint
``p(y1) p(y2 | y1) p(y3 | y2)`` (1,728 cells, expected counts < 5 pooled) by Pearson's chi-square:
pass at p > 1e-4; the negative control — arrival times keyed without the position, so every
position races with the same noise — must give p < 1e-6.

End to end (tiny fp32 Qwen2 models from conftest)
-------------------------------------------------
Drafter invariance: for n in {1, 2, 3} and several depths K, with drafts of every quality, the
output is token for token the target's race sample alone (``generate(method="ar",
rule=ExponentialRace(seed))``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.verification.race import arrival_times, race_candidates, race_keys, race_order, race_sample
from quickdraft.verification.rules import ExponentialRace
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs
from quickdraft.decoding.tree import TreeConfig, build_tree
from quickdraft.decoding.tree_decoding import generate_tree, verify_tree

from conftest import chi_square_pvalue, perturbed_copy, tiny_lm

P_PASS = 1e-4
P_FAIL = 1e-6
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# race_order
# ---------------------------------------------------------------------------------------------


def test_race_order_matches_race_candidates_and_reports_margins():
    g = torch.Generator().manual_seed(0)
    probs = torch.randn(50, 40, generator=g).mul(2).softmax(-1)
    probs[:, 5] = 0.0  # a token that never arrives
    keys = race_keys(1, torch.arange(50), torch.full((50,), 3))
    ids, margin = race_order(probs, arrival_times(keys, 40), 40)
    assert torch.equal(ids[:, :4], race_candidates(probs, keys, 4))
    assert (margin[:, 0] == 0).all() and (margin[:, 1:] <= margin[:, :-1]).all()
    assert torch.isneginf(margin[:, -1]).all() and (ids[:, -1] == 5).all()
    # every node at one depth races with the same arrival times: one [V] vector broadcast over nodes
    shared = arrival_times(keys[:1], 40)  # [1, V]
    node_ids, _ = race_order(probs[:3], shared, 2)
    assert torch.equal(node_ids, race_candidates(probs[:3], keys[:1].expand(3), 2))
    with pytest.raises(QuickdraftError, match="candidates"):
        race_order(probs, arrival_times(keys, 40), 0)


# ---------------------------------------------------------------------------------------------
# step level: Markov tables
# ---------------------------------------------------------------------------------------------

V = 12


class Markov:
    """Logits of the next token after each token: ``[V, V]``."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def probs(self, params: SamplingParams) -> torch.Tensor:
        return logits_to_probs(self.logits, params)


def markov_pair(seed: int, noise: float) -> tuple[Markov, Markov]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g) * 1.5
    return Markov(logits), Markov(logits + noise * torch.randn(V, V, generator=g))


def race_tree_step(target, draft, last, positions, row_ids, config, params, seed, keyed_by_position=True):
    """One ERSD tree step for every row after token ``last [B]`` at ``positions [B]``."""
    b = last.shape[0]
    depth = config.tree_depth
    offsets = torch.arange(depth + 1)
    if keyed_by_position:
        keys = race_keys(seed, row_ids.unsqueeze(1), positions.unsqueeze(1) + offsets)  # [B, D+1]
    else:  # negative control: the noise ignores the position
        keys = race_keys(seed, row_ids, torch.zeros_like(row_ids)).unsqueeze(1).expand(b, depth + 1)

    def expand(tokens, depths, mask, valid):
        return draft.logits[tokens]  # [B, f, V]

    tree = build_tree(last, draft.logits[last], expand, config, params, race_keys=keys[:, :-1].contiguous())
    target_probs = target.probs(params)[tree.tokens]  # [B, M, V] after every node
    return verify_tree(tree, target_probs, race_keys=keys)


def race_tree_generate(target, draft, n_rows, n_tokens, config, params, seed, first=0, keyed_by_position=True):
    """Tree ERSD on ``n_rows`` independent rows (ids ``0 … n_rows − 1``) until each has ``n_tokens``.

    Returns ``tokens [n_rows, n_tokens]`` and the per-step accepted counts of the first step."""
    row_ids = torch.arange(n_rows)
    tokens = torch.full((n_rows, n_tokens), -1, dtype=torch.long)
    length = torch.zeros(n_rows, dtype=torch.long)
    first_accepted = None
    while (length < n_tokens).any():
        last = torch.where(length > 0, tokens.gather(1, (length - 1).clamp_min(0).unsqueeze(1)).squeeze(1), first)
        res = race_tree_step(target, draft, last, length + 1, row_ids, config, params, seed, keyed_by_position)
        if first_accepted is None:
            first_accepted = res.num_accepted.clone()
        for j in range(res.output_ids.shape[1]):
            put = (j <= res.num_accepted) & (length < n_tokens)
            rows = put.nonzero().squeeze(-1)
            tokens[rows, length[rows]] = res.output_ids[rows, j]
            length[rows] += 1
    return tokens, first_accepted


def race_target_alone(target, n_rows, n_tokens, params, seed, first=0):
    probs = target.probs(params)
    row_ids = torch.arange(n_rows)
    last = torch.full((n_rows,), first)
    out = []
    for t in range(n_tokens):
        last = race_sample(probs[last], race_keys(seed, row_ids, torch.full_like(row_ids, t + 1)))
        out.append(last)
    return torch.stack(out, 1)


def exact_joint(target, params, first=0) -> np.ndarray:
    p = target.probs(params).double()
    p1 = p[first]
    return (p1[:, None, None] * p[:, :, None] * p[None, :, :]).numpy()  # [y1, y2, y3]


PARAMS = {
    "T1": SamplingParams(temperature=1.0),
    "T0.7-top": SamplingParams(temperature=0.7, top_k=8, top_p=0.9),
}


@pytest.mark.parametrize("params", list(PARAMS), ids=list(PARAMS))
@pytest.mark.parametrize("config", [TreeConfig(depth=2, topk=3, budget=12, scheme="race"),
                                    TreeConfig(depth=3, topk=2, budget=5, scheme="race")], ids=["d2n3", "d3n2-rerank"])
def test_race_tree_goodness_of_fit_with_negative_control(params, config):
    n, seed = 100_000, 7
    target, draft = markov_pair(seed=1, noise=1.0)
    sp = PARAMS[params]
    tokens, accepted = race_tree_generate(target, draft, n, 3, config, sp, seed)
    assert accepted.float().mean() > 0.3  # the draft's candidates do get accepted
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(tokens.T.numpy()), 1)
    assert counts.sum() == n
    assert chi_square_pvalue(counts, exact_joint(target, sp)) > P_PASS
    # negative control: one noise vector for every position of a row
    bad, _ = race_tree_generate(target, draft, n, 3, config, sp, seed, keyed_by_position=False)
    bad_counts = np.zeros((V, V, V))
    np.add.at(bad_counts, tuple(bad.T.numpy()), 1)
    assert chi_square_pvalue(bad_counts, exact_joint(target, sp)) < P_FAIL


@pytest.mark.parametrize("n_cand", [1, 2, 3])
@pytest.mark.parametrize("depth", [1, 3, 5])
def test_markov_race_tree_is_the_target_race_token_for_token(n_cand, depth):
    target, close = markov_pair(seed=2, noise=0.5)
    _, far = markov_pair(seed=3, noise=6.0)
    sp = SamplingParams(temperature=0.9)
    reference = race_target_alone(target, 500, 8, sp, seed=4)
    config = TreeConfig(depth=depth, topk=n_cand, budget=max(depth, 6), scheme="race")
    for draft in (target, close, far, Markov(torch.zeros(V, V))):
        tokens, _ = race_tree_generate(target, draft, 500, 8, config, sp, seed=4)
        assert torch.equal(tokens, reference)


def test_three_candidates_accept_at_least_one_candidate_on_the_same_noise():
    """Pathwise: the race tree keeps the chain of the draft's winners (race margin 0), so on the
    same noise it accepts at least what one candidate (chain ERSD) accepts; and strictly more on
    average (paired z-score > 5 on 20,000 steps)."""
    n, seed = 20_000, 9
    target, draft = markov_pair(seed=5, noise=1.5)
    sp = SamplingParams(temperature=1.0)
    row_ids = torch.arange(n)
    last = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(0))
    positions = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(1))
    accepted = {}
    for n_cand in (1, 3):
        config = TreeConfig(depth=4, topk=n_cand, budget=12, scheme="race")
        accepted[n_cand] = race_tree_step(target, draft, last, positions, row_ids, config, sp, seed).num_accepted
    assert (accepted[3] >= accepted[1]).all()
    diff = (accepted[3] - accepted[1]).double()
    z = diff.mean() / (diff.std() / n**0.5)
    assert z > 5, f"mean gain {diff.mean():.3f} tokens/step, z = {z:.1f}"


# ---------------------------------------------------------------------------------------------
# end to end on tiny models
# ---------------------------------------------------------------------------------------------



@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=20, top_p=0.9)],
                         ids=["T0.8", "top"])
def test_generate_tree_ersd_is_drafter_invariant(soft_target, params):
    target = ModelRunner(soft_target)
    drafts = {
        "close": perturbed_copy(soft_target, scale=0.3, seed=1),
        "far": perturbed_copy(soft_target, scale=3.0, seed=2),
        "unrelated": tiny_lm(seed=7),
        "self": soft_target,
    }
    seed = 13
    reference = generate(target, PROMPTS, method="ar", rule=ExponentialRace(seed=seed), sampling=params,
                         max_new_tokens=24).sequences
    lengths = {}
    for name, model in drafts.items():
        draft = ModelRunner(model)
        for n_cand in (1, 2, 3):
            for depth in (1, 3, 5):
                config = TreeConfig(depth=depth, topk=n_cand, budget=12, scheme="race")
                out = generate_tree(target, draft, PROMPTS, config=config, rule=ExponentialRace(seed=seed, candidates=n_cand),
                                    sampling=params, max_new_tokens=24)
                assert out.sequences == reference, (name, n_cand, depth)
                lengths[name, n_cand, depth] = out.batch_metrics.mean_acceptance_length
        # any tree is lossless under the race: a sampled (non-race) tree gives the same output too
        out = generate_tree(target, draft, PROMPTS, config=TreeConfig(depth=3, topk=2, budget=6, scheme="with_replacement"),
                            rule=ExponentialRace(seed=seed), sampling=params, max_new_tokens=24)
        assert out.sequences == reference
    assert lengths["self", 1, 5] == pytest.approx(6.0, abs=1.0)  # a perfect draft is accepted to the leaf
    assert lengths["close", 3, 3] > 1.5  # and an imperfect one still gets accepted


def test_one_candidate_tree_is_chain_ersd(soft_target):
    target, draft = ModelRunner(soft_target), ModelRunner(perturbed_copy(soft_target, scale=0.5, seed=3))
    params = SamplingParams(temperature=0.8)
    for k in (2, 4):
        rule = ExponentialRace(seed=5)
        chain = generate(target, PROMPTS, method="sd", drafter=_drafter(draft), rule=rule, sampling=params,
                         policy=build_method("sd", k=k).policy, max_new_tokens=30)
        tree = generate_tree(target, draft, PROMPTS, config=TreeConfig(depth=k, topk=1, budget=k, scheme="race"),
                             rule=rule, sampling=params, max_new_tokens=30)
        assert tree.sequences == chain.sequences
        assert [m.accepted_tokens for m in tree.metrics] == [m.accepted_tokens for m in chain.metrics]
        assert [m.steps for m in tree.metrics] == [m.steps for m in chain.metrics]


def _drafter(runner):
    from quickdraft.decoding.drafters import ModelDrafter

    return ModelDrafter(runner, int(runner.model.config.vocab_size))


def test_more_candidates_accept_more_end_to_end(soft_target):
    """Same seeds, 12 prompts x 3 seeds: n = 3 accepts at least as much as n = 1 in total."""
    target, draft = ModelRunner(soft_target), ModelRunner(perturbed_copy(soft_target, scale=0.5, seed=3))
    params = SamplingParams(temperature=0.8)
    prompts = [[i + 1, (3 * i) % 60 + 2, (7 * i) % 60 + 1] for i in range(12)]
    accepted = {1: 0, 3: 0}
    steps = {1: 0, 3: 0}
    for seed in range(3):
        for n_cand in (1, 3):
            out = generate_tree(target, draft, prompts, config=TreeConfig(depth=4, topk=n_cand, budget=12, scheme="race"),
                                rule=ExponentialRace(seed=seed, candidates=n_cand), sampling=params, max_new_tokens=32)
            accepted[n_cand] += out.batch_metrics.accepted_tokens
            steps[n_cand] += out.batch_metrics.steps
    assert accepted[3] / steps[3] > accepted[1] / steps[1]


@pytest.mark.parametrize("n_cand", [2, 3])
def test_greedy_race_tree_equals_plain_greedy(tiny_target, tiny_draft, n_cand):
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=30)
    out = generate_tree(target, draft, PROMPTS, config=TreeConfig(depth=4, topk=n_cand, budget=10),
                        rule=ExponentialRace(seed=1, candidates=n_cand), max_new_tokens=30)
    assert out.sequences == plain.sequences
    assert out.batch_metrics.mean_acceptance_length > 1.5


# ---------------------------------------------------------------------------------------------
# methods and errors
# ---------------------------------------------------------------------------------------------


def test_methods_route_ersd_candidates_to_race_trees():
    spec = build_method("ersd", k=5, candidates=3, tree_budget=10, seed=4)
    assert spec.engine_method == "tree" and spec.needs_draft
    assert spec.tree == TreeConfig(depth=5, topk=3, budget=10, scheme="race")
    assert spec.rule == ExponentialRace(seed=4, candidates=3)
    assert build_method("ersd", k=5).engine_method == "sd"  # one candidate: chain ERSD
    tree = build_method("tree", tree_rule="ersd", topk=2, depth=3, tree_budget=8, seed=2)
    assert tree.tree.scheme == "race" and tree.rule == ExponentialRace(seed=2, candidates=2)
    sampled = build_method("tree", tree_rule="ersd", tree_sampling="without_replacement")
    assert sampled.tree.scheme == "without_replacement"
    with pytest.raises(QuickdraftError, match="policy constant"):
        build_method("ersd", candidates=2, policy="heuristic")
    with pytest.raises(QuickdraftError, match="lossless, fsd or ersd"):
        build_method("tree", tree_rule="race")


def test_race_trees_need_the_race_rule_and_keys(tiny_target, tiny_draft):
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    with pytest.raises(QuickdraftError, match="ersd rule"):
        generate_tree(target, draft, [[1, 2]], config=TreeConfig(scheme="race"), sampling=SamplingParams(temperature=1.0))
    logits = torch.zeros(2, V)
    with pytest.raises(QuickdraftError, match="race_keys"):
        build_tree(torch.zeros(2, dtype=torch.long), logits, lambda *a: None, TreeConfig(depth=2, scheme="race"),
                   SamplingParams(temperature=1.0))


def test_race_tree_rows_keyed_by_their_own_seed_decode_as_alone(soft_target):
    """On race trees too, a row added with seed s and row id i is row i of the batch decoded alone
    with seed s, beside rows of other seeds (the tree's keys take each row's seed)."""
    from quickdraft.decoding.engine import Decoder
    from quickdraft.decoding.tree_decoding import TreeDrafter

    target, draft = ModelRunner(soft_target), ModelRunner(perturbed_copy(soft_target, scale=0.5, seed=3))
    params, config = SamplingParams(temperature=0.8), TreeConfig(depth=3, topk=2, budget=8, scheme="race")
    alone = {s: generate_tree(target, draft, [PROMPTS[0], PROMPTS[1]], config=config,
                              rule=ExponentialRace(seed=s, candidates=2), sampling=params, max_new_tokens=16).sequences
             for s in (4, 9)}
    decoder = Decoder(target, [], method="tree", drafter=TreeDrafter(draft, int(soft_target.config.vocab_size), config),
                      rule=ExponentialRace(seed=0, candidates=2), sampling=params)
    decoder.add_rows([PROMPTS[1], PROMPTS[0]], [16, 16], seeds=[4, 9], row_ids=[1, 0])
    while decoder.active.any():
        decoder.step()
    assert decoder.new_ids == [alone[4][1], alone[9][0]]
