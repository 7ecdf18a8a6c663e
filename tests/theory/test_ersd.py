"""ERSD rank law, token bounds and the optimal drafting tree: exact enumeration, the real race, brute force."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from quickdraft.verification import race
from quickdraft.errors import QuickdraftError
from quickdraft.theory import (
    DraftTree,
    draft_tree_expected_tokens,
    ersd_expected_tokens,
    ersd_kl_lower_bound,
    ersd_upper_bound,
    optimal_draft_tree,
    race_acceptance,
    race_expected_tokens,
    race_log_rank_bound,
    race_rank_distribution,
    race_rank_entropy,
)
from quickdraft.theory import ersd


def zipf(v: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, v + 1) ** s
    return w / w.sum()


def pairs(seed: int, v: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(shape, target_probs, draft_probs): flat, peaked and Zipf pairs, all with full support."""
    rng = np.random.default_rng(seed)
    return [
        ("flat", rng.dirichlet(np.full(v, 5.0)), rng.dirichlet(np.full(v, 5.0))),
        ("peaked", rng.dirichlet(np.full(v, 0.3)), rng.dirichlet(np.full(v, 0.3))),
        ("zipf", zipf(v, 1.2), zipf(v, 0.8)[rng.permutation(v)] * 0.5 + zipf(v, 0.8) * 0.5),
    ]


def rank_pmf_by_enumeration(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Pr[R = r] by inclusion–exclusion over the sets of tokens that beat the target's winner (small V)."""
    v_count = p.shape[0]
    out = np.zeros(v_count)
    for v in np.flatnonzero((p > 0) & (q > 0)):
        d = q / q[v] - p / p[v]
        beaters = [u for u in range(v_count) if d[u] > 0]
        for r in range(len(beaters) + 1):
            for s in itertools.combinations(beaters, r):
                rest = sum(d[u] for u in beaters if u not in s)
                for size in range(r + 1):
                    for t in itertools.combinations(s, size):
                        out[r] += (-1) ** size / (1.0 / p[v] + rest + sum(d[u] for u in t))
    return out


def all_trees(num_children: int, k: int) -> set[frozenset]:
    """Every prefix-closed set of k nodes (paths) of the infinite tree with num_children children per node."""
    level = {frozenset()}
    for _ in range(k):
        nxt = set()
        for tree in level:
            for parent in [()] + list(tree):
                for j in range(num_children):
                    child = parent + (j,)
                    if child not in tree:
                        nxt.add(tree | {child})
        level = nxt
    return level


def race_ranks(p: np.ndarray, q: np.ndarray, depth: int, trials: int, seed: int) -> np.ndarray:
    """``[trials, depth]`` 0-based ranks of the target's race winner in the draft's race, from quickdraft.verification.race."""
    v = p.shape[0]
    keys = race.race_keys(seed, torch.arange(trials).unsqueeze(1), torch.arange(depth).unsqueeze(0))  # [B, D]
    arrivals = race.arrival_times(keys, v)  # [B, D, V]
    winners, _ = race.race_order(torch.as_tensor(p), arrivals.double(), 1)  # [B, D, 1] the target's race winner
    order, _ = race.race_order(torch.as_tensor(q), arrivals.double(), v)  # [B, D, V] the draft's arrival order
    assert torch.equal(winners[:64, 0, 0], race.race_sample(torch.as_tensor(p).expand(64, v), keys[:64, 0]))
    return (order == winners).long().argmax(dim=-1).numpy()


def walk(tree: list[list[int]], ranks: np.ndarray, v: int) -> np.ndarray:
    """``[trials]`` tokens per call: accepted depth of the rank sequences in the tree, plus one."""
    ids = {(): 0}
    for path in sorted(map(tuple, tree), key=len):
        ids[path] = len(ids)
    child = np.full((len(ids), v), -1)
    for path, i in ids.items():
        if path:
            child[ids[path[:-1]], path[-1]] = i
    node = np.zeros(ranks.shape[0], dtype=int)
    tokens = np.ones(ranks.shape[0])
    for i in range(ranks.shape[1]):
        node = np.where(node >= 0, child[np.maximum(node, 0), ranks[:, i]], -1)
        tokens += node >= 0
    return tokens


# ----------------------------------------------------------------------------------------------------
# Rank law and expected tokens: exact
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v", [3, 5, 7])
def test_rank_distribution_equals_enumeration(v):
    for shape, p, q in pairs(v, v):
        assert np.abs(race_rank_distribution(p, q) - rank_pmf_by_enumeration(p, q)).max() < 1e-12, shape


def test_rank_distribution_matches_race_acceptance_and_zeros():
    rng = np.random.default_rng(5)
    for _ in range(10):
        p = rng.dirichlet(np.full(9, 0.5))
        q = rng.dirichlet(np.full(9, 0.5))
        q[rng.integers(0, 9)] = 0.0
        q /= q.sum()
        pmf = race_rank_distribution(p, q)
        assert pmf.sum() == pytest.approx(1.0 - p[q == 0].sum(), abs=1e-12)  # rest: never drafted
        for n in (1, 2, 4):
            assert pmf[:n].sum() == pytest.approx(race_acceptance(p, q, n), abs=1e-10)
    assert race_rank_distribution([0.3, 0.7], [0.3, 0.7]).tolist() == pytest.approx([1.0, 0.0], abs=1e-13)


def test_chain_and_single_step_are_trees():
    p, q = pairs(2, 6)[0][1:]
    k = 4
    chain = [[0] * i for i in range(1, k + 1)]
    step = [[j] for j in range(k)]
    chain_value = race_expected_tokens([race_acceptance(p, q)] * k)
    assert ersd_expected_tokens(p, q, chain) == pytest.approx(chain_value, abs=1e-12)
    assert ersd_expected_tokens(p, q, step) == pytest.approx(1.0 + race_acceptance(p, q, k), abs=1e-10)
    assert ersd_expected_tokens(p, q, []) == 1.0


@pytest.mark.parametrize("v", [4, 8])
def test_expected_tokens_against_race_implementation(v):
    """Optimal rank tree, chain (accept_race_branches) and k candidates, by quickdraft.verification.race; shifted draft rejected."""
    trials = 12_000
    for i, (shape, p, q) in enumerate(pairs(10 + v, v)):
        pmf = race_rank_distribution(p, q)
        tree = optimal_draft_tree(pmf, 6)
        depth = max(len(path) for path in tree.paths) + 1
        tokens = walk(tree.paths, race_ranks(p, q, depth, trials, seed=100 * v + i), v)
        se = tokens.std() / math.sqrt(trials)
        exact = ersd_expected_tokens(p, q, tree.paths)
        assert exact == pytest.approx(tree.expected_tokens, abs=1e-12)
        assert abs(tokens.mean() - exact) < 4.5 * se, shape
        assert ersd_kl_lower_bound(p, q, 6) - 4.5 * se <= tokens.mean() <= ersd_upper_bound(p, q, 6) + 4.5 * se
        # negative control: the same tree's value under a shifted draft distribution is rejected
        shifted = np.roll(q, 1)
        assert abs(tokens.mean() - ersd_expected_tokens(p, shifted, tree.paths)) > 4.5 * se, shape

    shape, p, q = pairs(3, v)[2]
    k = 3
    keys = race.race_keys(7, torch.arange(trials).unsqueeze(1), torch.arange(k + 1).unsqueeze(0))  # [B, K+1]
    winners = race.race_sample(torch.as_tensor(p).expand(trials, k + 1, v), keys)  # [B, K+1]
    drafts = race.race_candidates(torch.as_tensor(q).expand(trials, k, v), keys[:, :k], 1)  # [B, K, 1]
    _, accepted, _ = race.accept_race_branches(drafts, winners.unsqueeze(-1))
    tokens = accepted.double().numpy() + 1
    se = tokens.std() / math.sqrt(trials)
    assert abs(tokens.mean() - ersd_expected_tokens(p, q, [[0] * i for i in range(1, k + 1)])) < 4.5 * se
    assert abs(tokens.mean() - ersd_expected_tokens(p, q, [[0] * i for i in range(1, k)])) > 4.5 * se

    n = 3
    step = race.race_candidates(torch.as_tensor(q).expand(trials, v), keys[:, 0], n)  # [B, n]
    hits = (step == winners[:, :1]).any(dim=1).double().numpy()
    se = hits.std() / math.sqrt(trials)
    assert abs(1 + hits.mean() - ersd_expected_tokens(p, q, [[j] for j in range(n)])) < 4.5 * se
    assert abs(1 + hits.mean() - ersd_expected_tokens(p, q, [[j] for j in range(n - 1)])) > 4.5 * se


# ----------------------------------------------------------------------------------------------------
# Bounds
# ----------------------------------------------------------------------------------------------------


def test_entropy_identity_behind_the_upper_bound():
    """H(word) = E[T] H[R] for the parse the tree induces (the proof of the bound), by enumerating the words."""
    p, q = pairs(4, 5)[1][1:]
    q = q.copy()
    q[0] = 0.0
    q /= q.sum()
    law = ersd._rank_with_never(p, q)  # outcomes 0..V-1 and "never" (index V)
    tree = [[0], [0, 0], [1], [0, 1], [2]]
    nodes = [()] + [tuple(t) for t in tree]
    words = []
    for node in nodes:
        reach = math.prod(law[r] for r in node)
        for r in range(law.shape[0]):
            if node + (r,) not in nodes:
                words.append(reach * law[r])
    words = np.asarray(words)
    assert words.sum() == pytest.approx(1.0, abs=1e-12)
    h_words = -(words[words > 0] * np.log(words[words > 0])).sum()
    assert h_words == pytest.approx(ersd_expected_tokens(p, q, tree) * race_rank_entropy(p, q), abs=1e-10)
    assert (words > 0).sum() <= (len(tree) + 1) * p.shape[0]  # the count in the bound


@pytest.mark.parametrize("v", [4, 8, 16])
@pytest.mark.parametrize("k", [0, 1, 4, 16, 64])
def test_bounds_sandwich_the_optimal_tree(v, k):
    for shape, p, q in pairs(20 + v, v):
        best = optimal_draft_tree(race_rank_distribution(p, q), k).expected_tokens
        assert ersd_kl_lower_bound(p, q, k) <= best + 1e-12, shape
        assert best <= ersd_upper_bound(p, q, k) + 1e-12, shape
        for tree in ([[0] * i for i in range(1, k + 1)], [[j] for j in range(min(k, v))]):
            assert ersd_expected_tokens(p, q, tree) <= ersd_upper_bound(p, q, len(tree)) + 1e-12


def test_log_rank_bound_and_negative_controls():
    for v in (4, 8, 16):
        for shape, p, q in pairs(30 + v, v):
            pmf = race_rank_distribution(p, q)
            e_log_rank = (pmf * np.log(np.arange(1, v + 1))).sum()
            assert e_log_rank <= race_log_rank_bound(p, q) + 1e-12, shape
    # negative control 1: without the constant the bound fails for nearby distributions
    p = zipf(8, 1.0)
    q = 0.95 * p + 0.05 / 8
    pmf = race_rank_distribution(p, q)
    assert (pmf * np.log(np.arange(1, 9))).sum() > race_log_rank_bound(p, q) - math.log(2.0)
    # negative control 2: dropping log V from the upper bound is violated by the optimal tree
    shape, p, q = pairs(9, 8)[0]
    k = 16
    best = optimal_draft_tree(race_rank_distribution(p, q), k).expected_tokens
    assert best > math.log(k + 1) / race_rank_entropy(p, q)
    assert best <= ersd_upper_bound(p, q, k)


def test_bound_edge_cases():
    p = np.array([0.2, 0.3, 0.5])
    assert race_rank_entropy(p, p) == pytest.approx(0.0, abs=1e-12)
    assert ersd_upper_bound(p, p, 3) == math.inf
    assert race_log_rank_bound([0.5, 0.5, 0.0], [1.0, 0.0, 0.0]) == math.inf
    assert ersd_kl_lower_bound([0.5, 0.5, 0.0], [1.0, 0.0, 0.0], 10) == 1.0
    assert ersd_kl_lower_bound(p, p, 0) == 1.0
    # identical distributions: every rank is 1, a_n = 1 - log 2 / log(n + 1)
    assert ersd_kl_lower_bound(p, p, 2) == pytest.approx(2.0 - math.log(2) / math.log(3))


# ----------------------------------------------------------------------------------------------------
# Optimal drafting tree
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_children,k", [(2, 1), (2, 4), (2, 7), (3, 3), (3, 6)])
def test_greedy_equals_brute_force_iid(num_children, k):
    rng = np.random.default_rng(10 * num_children + k)
    for _ in range(3):
        c = rng.dirichlet(np.full(num_children, 0.7)) * rng.uniform(0.5, 1.0)  # may sum to < 1
        brute = max(draft_tree_expected_tokens(c, [list(x) for x in t]) for t in all_trees(num_children, k))
        tree = optimal_draft_tree(c, k)
        assert len(tree.paths) == k
        assert tree.expected_tokens == pytest.approx(brute, abs=1e-12)
        assert draft_tree_expected_tokens(c, tree.paths) == pytest.approx(tree.expected_tokens, abs=1e-12)
        assert all(a >= b for a, b in zip(tree.reach_probs, tree.reach_probs[1:]))


@pytest.mark.parametrize("num_children,k", [(2, 6), (3, 5)])
def test_greedy_equals_brute_force_markov_source(num_children, k):
    """Per-node distributions: a synthetic Markov source, child j = next token j, row of the last token."""
    rng = np.random.default_rng(num_children + k)
    transition = rng.dirichlet(np.full(num_children, 0.5), size=num_children)  # [V, V]
    start = rng.dirichlet(np.ones(num_children))  # [V]
    calls = []

    def node_probs(path):
        calls.append(path)
        return start if not path else transition[path[-1]]

    brute = max(draft_tree_expected_tokens(node_probs, [list(x) for x in t]) for t in all_trees(num_children, k))
    calls.clear()
    tree = optimal_draft_tree(node_probs, k)
    assert tree.expected_tokens == pytest.approx(brute, abs=1e-12)
    assert len(set(calls)) <= k + 1  # only the root and the taken nodes are evaluated
    # negative control: expanding leaves in FIFO (breadth-first) order is worse here
    levels = (itertools.product(range(num_children), repeat=d) for d in range(1, k + 1))
    bfs = [list(x) for x in itertools.islice(itertools.chain.from_iterable(levels), k)]
    assert draft_tree_expected_tokens(node_probs, bfs) < brute - 1e-6


def test_greedy_scales_and_matches_tunstall_growth():
    c = zipf(50, 1.1)
    tree = optimal_draft_tree(c, 20_000)
    assert len(tree.paths) == 20_000
    assert len({tuple(x) for x in tree.paths}) == 20_000
    entropy = -(c * np.log(c)).sum()
    # Tunstall: E[T] H <= log((k + 1) V), and the greedy tree comes within a constant of it
    assert tree.expected_tokens * entropy <= math.log(20_001 * 50)
    assert tree.expected_tokens * entropy > math.log(20_001) - 2 * math.log(50)


def test_doctest_tree_example():
    tree = optimal_draft_tree([0.6, 0.3, 0.1], 3)
    assert isinstance(tree, DraftTree)
    assert tree.paths == [[0], [0, 0], [1]]
    assert tree.reach_probs == pytest.approx([0.6, 0.36, 0.3])


# ----------------------------------------------------------------------------------------------------
# Input validation
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: ersd_expected_tokens([0.5, 0.5], [0.5, 0.5], [[0, 0]]), "no parent"),
        (lambda: ersd_expected_tokens([0.5, 0.5], [0.5, 0.5], [[0], [0]]), "duplicate"),
        (lambda: ersd_expected_tokens([0.5, 0.5], [0.5, 0.5], [[-1]]), "integers >= 0"),
        (lambda: ersd_expected_tokens([0.5, 0.5], [0.5, 0.5], [[2]]), "child index 2"),
        (lambda: ersd_expected_tokens([0.5, 0.5], [0.5, 0.5], [[]]), "non-empty"),
        (lambda: ersd_expected_tokens([0.5, 0.5], [0.5, 0.5], "01"), "list of paths"),
        (lambda: ersd_expected_tokens([0.5, 0.5], [1.0], [[0]]), "differ in vocabulary size"),
        (lambda: ersd_upper_bound([0.5, 0.5], [0.5, 0.5], -1), "num_drafted"),
        (lambda: ersd_kl_lower_bound([0.5, 0.5], [0.5, 0.5], 2.0), "num_drafted"),
        (lambda: optimal_draft_tree([0.7, 0.6], 2), "sums to"),
        (lambda: optimal_draft_tree([0.5, -0.1], 2), ">= 0"),
        (lambda: optimal_draft_tree([[0.5, 0.5]], 2), "1-D"),
        (lambda: optimal_draft_tree(lambda path: [0.5, float("nan")], 2), "finite"),
        (lambda: optimal_draft_tree([0.5, 0.5], True), "num_nodes"),
        (lambda: race_rank_distribution(np.ones(300) / 300, np.ones(300) / 300), "V <= 256"),
        (lambda: race_rank_entropy([0.5, 0.6], [0.5, 0.5]), "not a distribution"),
    ],
)
def test_invalid(call, message):
    with pytest.raises(QuickdraftError, match=message):
        call()
