"""The optimal static race tree (quickdraft.decoding.tree_shapes): rank counting, the shape, losslessness, its value.

* Counting: ranks counted by :func:`race_ranks` over many arrival-time vectors follow the exact law
  :func:`quickdraft.theory.ersd.race_rank_distribution` (chi-square, N = 200,000; a shifted law must fail).
* Shape: the engine's static tree is :func:`optimal_draft_tree`'s paths; depth caps are respected.
* Lossless: the static Tunstall race tree on Markov tables (V = 12) emits the target's 3-token joint law
  (chi-square, N = 100,000, p > 1e-4) and the negative control (noise not keyed by position) fails at
  p < 1e-6; on tiny fp32 models its output is token for token the target's race sample alone at T > 0
  and plain greedy decoding at T = 0.
* Value: with the same (p, q) at every position (the stationary model) the measured tokens per call of
  the optimal tree and of a chain equal eq. (1)'s expected tokens within 4 standard errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.verification.race import race_keys
from quickdraft.verification.rules import ExponentialRace
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs
from quickdraft.theory.ersd import draft_tree_expected_tokens, optimal_draft_tree, race_rank_distribution
from quickdraft.decoding.tree import TreeConfig, compile_paths
from quickdraft.decoding.tree_decoding import generate_tree
from quickdraft.decoding.tree_shapes import (
    NEVER, RankLaw, RankLawFile, chain_paths, estimate_rank_law, greedy_ranks, non_increasing, optimal_race_tree,
    optimal_tree_config, race_ranks, rank_law_from_ranks,
)

from conftest import chi_square_pvalue, perturbed_copy
from test_ersd_tree import Markov, V, exact_joint, markov_pair, race_target_alone, race_tree_generate, race_tree_step

P_PASS = 1e-4
P_FAIL = 1e-6
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# counting ranks
# ---------------------------------------------------------------------------------------------


def _pair(seed: int, v: int = 10, noise: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(v, generator=g) * 1.5
    return logits.softmax(-1), (logits + noise * torch.randn(v, generator=g)).softmax(-1)


def test_counted_ranks_follow_the_exact_rank_law_and_a_shifted_law_fails():
    n = 200_000
    target, draft = _pair(0)
    draft[3] = 0.0  # a token the draft never proposes
    draft /= draft.sum()
    keys = race_keys(5, torch.arange(n), torch.full((n,), 7))
    ranks = race_ranks(target.expand(n, -1), draft.expand(n, -1), keys).numpy()
    exact = race_rank_distribution(target.numpy(), draft.numpy())  # [V] Pr[R = r]
    probs = np.append(exact, 1.0 - exact.sum())  # last cell: never
    counts = np.bincount(np.where(ranks == NEVER, len(exact) + 1, ranks) - 1, minlength=len(exact) + 1)
    assert (ranks == NEVER).any() and probs[-1] == pytest.approx(float(target[3]), abs=1e-6)
    assert chi_square_pvalue(counts.astype(float), probs) > P_PASS
    shifted = np.roll(counts, 1).astype(float)  # rank r counted as r + 1
    assert chi_square_pvalue(shifted, probs) < P_FAIL


def test_greedy_ranks_are_the_argmax_position_in_the_draft_order():
    target_logits = torch.tensor([[0.0, 3.0, 1.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    draft_logits = torch.tensor([[2.0, 1.0, 3.0, 0.0], [-float("inf"), 1.0, 0.0, 0.0]])
    assert greedy_ranks(target_logits, draft_logits).tolist() == [3, NEVER]


def test_rank_law_and_pooling():
    law = rank_law_from_ranks(np.array([1, 1, 2, NEVER, 70]), max_rank=4)
    assert law.tolist() == [0.4, 0.2, 0.0, 0.0]
    assert non_increasing([0.5, 0.3, 0.1]).tolist() == [0.5, 0.3, 0.1]
    pooled = non_increasing([0.4, 0.1, 0.3, 0.0, 0.05])
    assert (np.diff(pooled) <= 1e-15).all() and pooled.sum() == pytest.approx(0.85)
    with pytest.raises(QuickdraftError):
        rank_law_from_ranks(np.array([], dtype=int))


def test_estimated_law_on_tiny_models_matches_the_exact_per_position_laws(soft_target):
    """Monte Carlo ranks on logged distributions against the average of the exact per-position laws."""
    target, draft = ModelRunner(soft_target), ModelRunner(perturbed_copy(soft_target, scale=0.5, seed=3))
    sampling = SamplingParams(temperature=0.8)
    sequences = [(list(range(1, 9)), 3), (list(range(20, 40)), 5)]
    law = estimate_rank_law(target, draft, sequences, sampling, seed=1, draws=400, max_rank=64)
    assert law.positions == (8 - 3 + 1) + (20 - 5 + 1) and law.draws == 400 and law.never == 0.0
    exact = np.zeros(64)
    rows = []  # (target, draft) distributions at every counted position
    for ids, prompt_len in sequences:
        for runner in (target, draft):
            runner.reset(1)
        tokens = torch.tensor([ids])
        p = logits_to_probs(target.forward(tokens).logits[0, prompt_len - 1 :], sampling).double().numpy()
        q = logits_to_probs(draft.forward(tokens).logits[0, prompt_len - 1 :], sampling).double().numpy()
        for pi, qi in zip(p, q):
            exact += race_rank_distribution(pi, qi)
            rows.append((pi, qi))
    exact /= law.positions
    n = law.positions * law.draws
    counts = np.asarray(law.probs) * n
    head = 8  # ranks 1..8 as cells, the rest pooled
    obs = np.append(counts[:head], n - counts[:head].sum())
    exp = np.append(exact[:head], 1.0 - exact[:head].sum())
    assert chi_square_pvalue(obs, exp) > P_PASS
    # T = 0: the rank of the target's argmax in the draft's descending order, counted by hand
    greedy = estimate_rank_law(target, draft, sequences, SamplingParams(temperature=0.0))
    assert greedy.temperature == 0.0 and greedy.draws == 1 and greedy.positions == law.positions
    by_hand = np.zeros(64)
    for p_row, q_row in rows:
        by_hand[int(np.flatnonzero(np.argsort(-q_row, kind="stable") == p_row.argmax())[0])] += 1
    assert np.allclose(greedy.probs, by_hand / law.positions)


# ---------------------------------------------------------------------------------------------
# the shape
# ---------------------------------------------------------------------------------------------

LAW = [0.55, 0.2, 0.08, 0.04, 0.02, 0.01]


@pytest.mark.parametrize("budget", [1, 4, 8, 16, 40])
def test_engine_shape_is_optimal_draft_tree(budget):
    config = optimal_tree_config(LAW, budget)
    expected = optimal_draft_tree(LAW, budget)
    assert [list(p) for p in config.paths] == expected.paths  # the same paths, in pop order
    assert config.scheme == "race" and config.budget == budget == len(config.paths)
    assert config.tree_depth == max(len(p) for p in expected.paths)
    compile_paths(list(config.paths))  # a valid static tree: no skipped sibling rank
    assert optimal_race_tree(LAW, budget).expected_tokens == pytest.approx(expected.expected_tokens)


def test_depth_cap_gives_the_best_tree_no_deeper_than_the_cap():
    capped = optimal_race_tree(LAW, 10, max_depth=2)
    assert max(len(p) for p in capped.paths) <= 2 and len(capped.paths) == 10
    # brute force over all 10-node trees of depth <= 2 with ranks < 6: choose (a, b_0..b_5) children
    best = 0.0
    for a in range(1, 7):
        rest = 10 - a
        if rest < 0:
            continue
        # with a fixed root fan-out the best grandchildren are the largest products, greedily
        cand = sorted((LAW[i] * LAW[j] for i in range(a) for j in range(6)), reverse=True)
        if len(cand) >= rest:
            best = max(best, 1 + sum(LAW[:a]) + sum(cand[:rest]))
    assert capped.expected_tokens == pytest.approx(best)
    assert optimal_race_tree(LAW, 3, max_depth=1).paths == [[0], [1], [2]]


def test_a_non_monotone_law_gives_a_valid_tree():
    tree = optimal_tree_config([0.3, 0.05, 0.4, 0.01], 6)
    compile_paths(list(tree.paths))
    with pytest.raises(QuickdraftError, match="rank 1"):
        optimal_race_tree([0.0, 0.0], 3)
    with pytest.raises(QuickdraftError, match="budget"):
        optimal_race_tree(LAW, 0)


# ---------------------------------------------------------------------------------------------
# lossless: Markov tables and tiny models
# ---------------------------------------------------------------------------------------------


def _markov_rank_law(target: Markov, draft: Markov, params: SamplingParams) -> np.ndarray:
    """The rank law averaged over the tables' rows (a stand-in for an estimate)."""
    p, q = target.probs(params).double().numpy(), draft.probs(params).double().numpy()
    return np.mean([race_rank_distribution(p[i], q[i]) for i in range(V)], axis=0)


@pytest.mark.parametrize("budget", [6, 12])
def test_optimal_race_tree_goodness_of_fit_with_negative_control(budget):
    n, seed = 100_000, 7
    target, draft = markov_pair(seed=1, noise=1.0)
    sp = SamplingParams(temperature=1.0)
    config = optimal_tree_config(_markov_rank_law(target, draft, sp), budget)
    assert config.topk >= 2 and config.tree_depth >= 2  # a real tree, not a chain or a fan
    tokens, accepted = race_tree_generate(target, draft, n, 3, config, sp, seed)
    assert accepted.float().mean() > 0.5
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(tokens.T.numpy()), 1)
    assert chi_square_pvalue(counts, exact_joint(target, sp)) > P_PASS
    bad, _ = race_tree_generate(target, draft, n, 3, config, sp, seed, keyed_by_position=False)
    bad_counts = np.zeros((V, V, V))
    np.add.at(bad_counts, tuple(bad.T.numpy()), 1)
    assert chi_square_pvalue(bad_counts, exact_joint(target, sp)) < P_FAIL


def test_optimal_race_tree_is_the_target_race_on_markov_tables():
    target, draft = markov_pair(seed=2, noise=0.5)
    sp = SamplingParams(temperature=0.9)
    config = optimal_tree_config(_markov_rank_law(target, draft, sp), 9)
    tokens, _ = race_tree_generate(target, draft, 500, 8, config, sp, seed=4)
    assert torch.equal(tokens, race_target_alone(target, 500, 8, sp, seed=4))


def _law_file(tmp_path, laws) -> str:
    path = tmp_path / "law.json"
    RankLawFile(pair={"target": "tiny"}, prompts=[], max_new_tokens=0, command="test",
                laws=[RankLaw(temperature=t, probs=list(law), positions=1, draws=1) for t, law in laws]).save(path)
    return str(path)


def test_optimal_tree_method_is_lossless_on_tiny_models(soft_target, tiny_target, tiny_draft, tmp_path):
    law_file = _law_file(tmp_path, [(0.0, [0.6, 0.2, 0.1]), (0.8, [0.5, 0.25, 0.1])])
    # T > 0: token for token the target's race sample alone
    params = SamplingParams(temperature=0.8)
    spec = build_method("tree", tree_rule="ersd", tree_shape="optimal", rank_law=law_file, tree_budget=10, depth=6,
                        sampling=params, seed=13)
    assert spec.engine_method == "tree" and spec.tree.paths is not None
    assert [list(p) for p in spec.tree.paths] == optimal_draft_tree([0.5, 0.25, 0.1], 10).paths
    target = ModelRunner(soft_target)
    draft = ModelRunner(perturbed_copy(soft_target, scale=0.5, seed=3))
    reference = generate(target, PROMPTS, method="ar", rule=ExponentialRace(seed=13), sampling=params,
                         max_new_tokens=24).sequences
    out = generate_tree(target, draft, PROMPTS, config=spec.tree, rule=spec.rule, sampling=params, max_new_tokens=24)
    assert out.sequences == reference
    assert out.batch_metrics.mean_acceptance_length > 1.5
    # T = 0: plain greedy decoding
    greedy = build_method("tree", tree_rule="ersd", tree_shape="optimal", rank_law=law_file, tree_budget=8,
                          sampling=SamplingParams(temperature=0.0))
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=30)
    out = generate_tree(target, draft, PROMPTS, config=greedy.tree, rule=greedy.rule, max_new_tokens=30)
    assert out.sequences == plain.sequences
    assert out.batch_metrics.mean_acceptance_length > 1.5


# ---------------------------------------------------------------------------------------------
# value: eq. (1) against measured tokens per call
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("noise", [0.7, 1.5])
def test_expected_tokens_match_measured_tokens_per_call_in_the_stationary_model(noise):
    """Same (p, q) after every token: ranks are i.i.d. with the exact law, so eq. (1) is exact."""
    n, seed = 40_000, 3
    g = torch.Generator().manual_seed(11)
    row = torch.randn(V, generator=g) * 1.5
    target = Markov(row.expand(V, V).clone())
    draft = Markov((row + noise * torch.randn(V, generator=g)).expand(V, V).clone())
    sp = SamplingParams(temperature=1.0)
    law = race_rank_distribution(target.probs(sp)[0].double().numpy(), draft.probs(sp)[0].double().numpy())
    last = torch.zeros(n, dtype=torch.long)
    positions = torch.randint(0, 10_000, (n,), generator=torch.Generator().manual_seed(1))
    for config in (optimal_tree_config(law, 8), optimal_tree_config(law, 12, max_depth=3),
                   TreeConfig(depth=4, topk=1, budget=4, scheme="race", paths=tuple(map(tuple, chain_paths(4))))):
        res = race_tree_step(target, draft, last, positions, torch.arange(n), config, sp, seed)
        tokens = (res.num_accepted + 1).double()
        predicted = draft_tree_expected_tokens(law, [list(p) for p in config.paths])
        sem = float(tokens.std()) / n**0.5
        assert abs(float(tokens.mean()) - predicted) < 4 * sem, (config.paths, float(tokens.mean()), predicted)


# ---------------------------------------------------------------------------------------------
# methods, files and errors
# ---------------------------------------------------------------------------------------------


def test_method_options_and_errors(tmp_path):
    law_file = _law_file(tmp_path, [(0.7, LAW)])
    spec = build_method("tree", tree_rule="ersd", tree_shape="optimal", rank_law=law_file, tree_budget=8, depth=3,
                        sampling=SamplingParams(temperature=0.7), seed=2)
    assert spec.tree == optimal_tree_config(LAW, 8, max_depth=3)
    assert spec.rule == ExponentialRace(seed=2, candidates=spec.tree.topk)
    assert build_method("tree", tree_rule="ersd").tree.paths is None  # dynamic by default
    with pytest.raises(QuickdraftError, match="tree shape"):
        build_method("tree", tree_rule="ersd", tree_shape="static")
    with pytest.raises(QuickdraftError, match="rule ersd"):
        build_method("tree", tree_shape="optimal", rank_law=law_file, sampling=SamplingParams(temperature=0.7))
    with pytest.raises(QuickdraftError, match="no rank law at temperature 0.9"):
        build_method("tree", tree_rule="ersd", tree_shape="optimal", rank_law=law_file,
                     sampling=SamplingParams(temperature=0.9))
    with pytest.raises(QuickdraftError, match="cannot read"):
        RankLawFile.load(tmp_path / "missing.json")


def test_the_shipped_default_pair_law_loads():
    laws = RankLawFile.load()
    for temperature in (0.0, 0.7):
        law = laws.at(temperature)
        assert 0.3 < law.probs[0] <= 1.0 and sum(law.probs) <= 1.0 + 1e-9 and law.positions > 500
    assert laws.pair["backend"] == "openvino" and laws.command.startswith("python benchmarks/estimate_rank_law.py")
