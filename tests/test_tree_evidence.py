"""Evidence for token trees (issue 5) that tests/test_tree.py does not give.

1. **Exact law of depth-2 trees on a small vocabulary (V = 8).** Target and draft are tables of
   distributions — after the root and after every first token — of four kinds: independent
   random, peaked (both put ~0.9 on one token, the same token in half of the contexts), disjoint
   supports (nothing is ever accepted: the output is all residual) and partially overlapping
   supports. For every tree (scheme, verifier) pair, :func:`quickdraft.decoding.tree.build_tree` grows a
   real depth-2 tree from the draft table and :func:`quickdraft.decoding.tree_decoding.verify_tree` walks it;
   the emitted pair of tokens (a second token drawn from the exact target conditional when the
   walk stops after one) is compared over all 64 cells with ``p(t1) p(t2 | t1)`` by Pearson's
   chi-square on N = 100,000 pairs. With 64 cells the test has power: at 1e-4 it rejects a
   total-variation error of roughly 1 %. Pass at p > 1e-4 (24 such cases, fixed seeds: a
   false alarm has probability ≤ 2.4e-3); two realistic bugs — children verified under the wrong
   draft law — must give p < 1e-6.
2. **Whole-loop law.** :func:`generate_tree` on a vocabulary-8 tiny fp32 model pair, 10,000
   rows (the loop's per-row bookkeeping costs about 0.5 ms a row, so 100,000 would take about a
   minute a case; the step law itself is tested at 100,000 in 1.), three tokens, so most rows take
   a second step after KV compaction: the emitted triples against the exact
   ``p(t1) p(t2 | t1) p(t3 | t1, t2)`` of the target (512 cells, expected counts < 5 pooled). This
   catches bookkeeping errors (a wrong KV slot kept, a wrong position after compaction), which
   change the conditionals grossly, not subtle biases of a verifier; negative control: the same
   counts must reject (p < 1e-6) the law of a loop that lost the second token's KV slot,
   ``p(t1) p(t2 | t1) p(t3 | t1)``. Sampled trees of depth 3 get the same test on 15,000 rows with
   four tokens to generate, so that a first step's walk can emit all three tested tokens.
3. **Tree attention on real dynamic trees.** Trees grown by the draft model through several
   :meth:`ModelRunner.forward_tree` calls in one session (rerank, duplicate and padding nodes,
   left-padded rows of different lengths): every expanded node's draft distribution and every
   valid node's target logits equal running the node's path alone (fp32).
4. **Greedy equality for the benchmark's tree shapes** (budgets 8 … 64, depth up to 8), token
   for token against plain greedy decoding, batch of 3 rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.decoding.drafters import pending_block
from quickdraft.decoding.engine import generate
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs
from quickdraft.decoding.tree import TokenTree, TreeConfig, build_tree
from quickdraft.decoding.tree_decoding import generate_tree

from conftest import (chi_square_pvalue, counts_after_first, exact_after_first, exact_law, perturbed_copy, tiny_lm,
                      tree_pair_counts)

V = 8
N = 100_000
N_LOOP = 10_000
P_PASS = 1e-4
P_FAIL = 1e-6
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]

#: every lossless (children scheme, verifier) pair on trees
TREE_COMBOS = [
    ("topk", "rrs"),
    ("with_replacement", "rrs"),
    ("with_replacement", "kseq"),
    ("without_replacement", "rrs"),
    ("greedy", "rrs"),
    ("greedy", "optimal_greedy"),
]
KINDS = ["random", "peaked", "disjoint", "partial"]


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# 1. depth-2 trees on tables of distributions
# ---------------------------------------------------------------------------------------------


def _pair(kind: str, rng: np.random.Generator, same_peak: bool) -> tuple[np.ndarray, np.ndarray]:
    """One (target, draft) pair of distributions over V tokens for one context."""
    p, q = np.zeros(V), np.zeros(V)
    if kind == "random":
        return rng.dirichlet(np.ones(V)), rng.dirichlet(np.ones(V))
    if kind == "peaked":
        p, q = 0.1 * rng.dirichlet(np.ones(V)), 0.1 * rng.dirichlet(np.ones(V))
        top_p = int(rng.integers(V))
        top_q = top_p if same_peak else (top_p + 1 + int(rng.integers(V - 1))) % V
        p[top_p] += 0.9
        q[top_q] += 0.9
        return p, q
    perm = rng.permutation(V)
    if kind == "disjoint":  # p on half the tokens, q on the other half
        p[perm[: V // 2]] = rng.dirichlet(np.ones(V // 2))
        q[perm[V // 2 :]] = rng.dirichlet(np.ones(V - V // 2))
        return p, q
    if kind == "partial":  # p on 5 tokens, q on 5 tokens, 2 shared
        p[perm[:5]] = rng.dirichlet(np.ones(5))
        q[perm[3:]] = rng.dirichlet(np.ones(V - 3))
        return p, q
    raise ValueError(kind)


class Tables:
    """Target and draft distributions after the root (``*1 [V]``) and after each first token (``*2 [V, V]``)."""

    def __init__(self, kind: str, seed: int = 0):
        rng = np.random.default_rng(seed)
        pairs = [_pair(kind, rng, same_peak=c % 2 == 0) for c in range(V + 1)]
        self.p1 = torch.tensor(pairs[0][0])
        self.q1 = torch.tensor(pairs[0][1])
        self.p2 = torch.tensor(np.stack([pp for pp, _ in pairs[1:]]))
        self.q2 = torch.tensor(np.stack([qq for _, qq in pairs[1:]]))

    def joint(self) -> np.ndarray:
        return (self.p1.unsqueeze(1) * self.p2).numpy()  # [V(first), V(second)]

    def emit_pairs(self, scheme: str, verifier: str, n: int, seed: int, relabel: str | None = None) -> np.ndarray:
        """Counts ``[V, V]`` of the first two emitted tokens over ``n`` independent depth-2 tree steps."""
        gen = torch.Generator().manual_seed(seed)
        config = TreeConfig(depth=2, topk=3, budget=7, scheme=scheme)
        params = SamplingParams(temperature=1.0)
        roots = torch.zeros(n, dtype=torch.long)  # the root's token is never read from the tables
        q1_logits = self.q1.log().float().expand(n, -1)  # log 0 = -inf: softmax gives the table back
        q2_logits = self.q2.log().float()

        def expand(tokens, depths, mask, valid):  # depth-1 frontier [n, f] -> draft logits [n, f, V]
            return q2_logits[tokens]

        tree = build_tree(roots, q1_logits, expand, config, params, gen)
        if relabel is not None:  # negative control: the verifier is told the wrong draft law
            tree = TokenTree(**{**tree.__dict__, "scheme": relabel})
        # the tree's own draft distributions are the tables (float32 round trip through the logits)
        assert torch.allclose(tree.expanded_probs[:, 0].double(), self.q1.expand(n, -1), atol=1e-6)
        counts, self.accepted = tree_pair_counts(tree, self.p1, self.p2, verifier, gen)
        return counts


@pytest.fixture(scope="module")
def tables() -> dict[str, Tables]:
    return {kind: Tables(kind, seed=i) for i, kind in enumerate(KINDS)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scheme, verifier", TREE_COMBOS, ids=[f"{s}-{v}" for s, v in TREE_COMBOS])
def test_depth2_tree_law_on_a_small_vocabulary(tables, kind, scheme, verifier):
    t = tables[kind]
    seed = 100 * KINDS.index(kind) + TREE_COMBOS.index((scheme, verifier))
    counts = t.emit_pairs(scheme, verifier, N, seed=seed)
    assert counts.sum() == N
    if kind == "disjoint":
        assert t.accepted == 0  # no draft can pass: every token is a residual sample
    else:
        assert t.accepted > N // 50  # the walk does go down the trees
    pvalue = chi_square_pvalue(counts, t.joint())
    assert pvalue > P_PASS, f"{scheme}/{verifier} on {kind}: chi-square p = {pvalue:.2e}"


@pytest.mark.parametrize("scheme, wrong", [
    ("topk", "with_replacement"),  # EAGLE-2 top-k children verified as if sampled from q
    ("without_replacement", "with_replacement"),  # sampled without replacement, verified as i.i.d.
])
def test_depth2_negative_controls_fail(tables, scheme, wrong):
    t = tables["random"]
    counts = t.emit_pairs(scheme, "rrs", N, seed=7, relabel=wrong)
    assert chi_square_pvalue(counts, t.joint()) < P_FAIL


# ---------------------------------------------------------------------------------------------
# 2. the whole generate_tree loop on a vocabulary-8 model pair
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pair():
    target = tiny_lm(seed=11, vocab=V, layers=2, max_positions=64)
    with torch.no_grad():
        target.lm_head.weight.mul_(4.0)  # far from uniform, still with full support
    return target, perturbed_copy(target, scale=0.5, seed=12)


def _lost_kv_law(model, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """The law of new tokens 2 … 4 that a compaction bug losing the KV slot of a step's second
    token would give: the first step after the prefill emits ``t2``, ``t3``, ``t4`` and draws ``t4``
    from ``p(t4 | t1, t2)``, ``[V, V, V]`` with ``t1`` marginalised out (power check of the
    whole-loop tests)."""
    law3 = exact_law(model, prompt, params, 3)  # [t1, t2, t3]
    mass = law3.sum(axis=2, keepdims=True)
    cond = np.divide(law3, mass, out=np.zeros_like(law3), where=mass > 0)  # p(next | t1, t2)
    return (law3[..., None] * cond[:, :, None, :]).sum(axis=0)


@pytest.mark.parametrize("scheme, verifier, params", [
    ("topk", "rrs", SamplingParams(temperature=1.0)),
    ("with_replacement", "kseq", SamplingParams(temperature=1.0)),
    ("greedy", "optimal_greedy", SamplingParams(temperature=0.8, top_k=5)),
], ids=["topk-rrs", "with_replacement-kseq", "greedy-optimal_greedy-top5"])
def test_generate_tree_three_token_law(small_pair, scheme, verifier, params):
    target, draft = small_pair
    prompt = [1, 2, 3]
    out = generate_tree(
        ModelRunner(target), ModelRunner(draft), [prompt] * N_LOOP,
        config=TreeConfig(depth=2, topk=3, budget=6, scheme=scheme), verifier=verifier,
        sampling=params, max_new_tokens=4, seed=3,
    )
    assert np.array(out.sequences).shape == (N_LOOP, 4)
    assert out.batch_metrics.accepted_tokens > N_LOOP // 4  # the walk does go down the trees
    counts = counts_after_first(out.sequences, V, 3)  # the tokens after the prefill's
    pvalue = chi_square_pvalue(counts, exact_after_first(target, prompt, params, 3))
    assert pvalue > P_PASS, f"{scheme}/{verifier}: chi-square p = {pvalue:.2e}"
    # negative control: the same counts reject the law of a loop that lost a step's second token's KV
    assert chi_square_pvalue(counts, _lost_kv_law(target, prompt, params)) < P_FAIL


@pytest.mark.parametrize("scheme, verifier", [("without_replacement", "rrs"), ("with_replacement", "kseq")])
def test_generate_tree_depth3_sampled_trees_three_token_law(small_pair, scheme, verifier):
    """Sampled depth-3 trees (children drawn from the draft, every drawn child kept): with five
    tokens to generate (the first from the prefill) the first step keeps its full depth, so a row
    can emit its next three tokens from one walk three nodes deep. Those triples follow the
    target's exact law; the same counts reject the law of a loop that lost a step's second token's
    KV slot."""
    target, draft = small_pair
    prompt, n = [1, 2, 3], 15_000
    params = SamplingParams(temperature=1.0)
    out = generate_tree(
        ModelRunner(target), ModelRunner(draft), [prompt] * n,
        config=TreeConfig(depth=3, topk=2, budget=8, scheme=scheme), verifier=verifier,
        sampling=params, max_new_tokens=5, seed=4,
    )
    # the walks do reach depth 3: rows that emitted all four tokens after the prefill's in one step
    deep = sum(m.steps == 1 and m.accepted_tokens == 3 for m in out.metrics)
    assert deep > n // 20, deep
    counts = counts_after_first(out.sequences, V, 3)
    pvalue = chi_square_pvalue(counts, exact_after_first(target, prompt, params, 3))
    assert pvalue > P_PASS, f"{scheme}/{verifier} depth 3: chi-square p = {pvalue:.2e}"
    assert chi_square_pvalue(counts, _lost_kv_law(target, prompt, params)) < P_FAIL


# ---------------------------------------------------------------------------------------------
# 3. tree attention on dynamic trees grown by the draft model
# ---------------------------------------------------------------------------------------------


def _path(tree: TokenTree, row: int, node: int) -> list[int]:
    """Tokens of the nodes from depth 1 down to ``node`` (the root is the prompt's last token)."""
    out = []
    while node > 0:
        out.append(int(tree.tokens[row, node]))
        node = int(tree.parents[row, node])
    return out[::-1]


@pytest.mark.parametrize("config, params", [
    (TreeConfig(depth=4, topk=3, budget=12, scheme="topk"), SamplingParams(temperature=1.0)),
    (TreeConfig(depth=3, topk=3, budget=10, scheme="with_replacement"), SamplingParams(temperature=1.0, top_k=3)),
    (TreeConfig(depth=3, topk=3, budget=10, scheme="without_replacement"), SamplingParams(temperature=0.9, top_k=2)),
], ids=["topk", "with_replacement-duplicates", "without_replacement-padding"])
def test_dynamic_tree_forwards_equal_running_each_path_alone(tiny_target, tiny_draft, config, params):
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    b = len(PROMPTS)
    for runner in (target, draft):  # prefill everything but the root, left-padded rows
        runner.reset(b)
        ids, valid = pending_block([p[:-1] for p in PROMPTS], runner.lengths)
        runner.forward(ids, valid, logits_to_keep=1)
    ids, valid = pending_block(PROMPTS, draft.lengths)
    root_logits = draft.forward(ids, valid, logits_to_keep=1).logits[:, -1]
    draft.begin_tree()

    def expand(tokens, depths, mask, valid):
        return draft.forward_tree(tokens, depths, mask, valid).logits

    gen = torch.Generator().manual_seed(0)
    roots = torch.tensor([p[-1] for p in PROMPTS])
    tree = build_tree(roots, root_logits, expand, config, params, gen)
    assert draft.num_forwards == 1 + 1 + (config.depth - 1)  # prefill, root, one per further layer
    if config.scheme != "topk":
        assert bool((~tree.valid).any())  # duplicate or padding nodes are present

    # the draft's distribution after every expanded node = the draft run on that path alone
    checked = 0
    for row in range(b):
        for node in range(tree.num_nodes):
            e = int(tree.expanded[row, node])
            if e < 0 or not tree.valid[row, node]:
                continue
            with torch.no_grad():
                alone = tiny_draft(torch.tensor([PROMPTS[row] + _path(tree, row, node)])).logits[0, -1]
            assert torch.allclose(tree.expanded_probs[row, e], logits_to_probs(alone, params), atol=1e-5), (row, node)
            checked += 1
    assert checked >= b * config.depth  # root and deeper layers on every row

    # the target's logits at every valid node = the target run on that path alone
    target.begin_tree()
    out = target.forward_tree(tree.tokens, tree.depths, tree.mask(), tree.valid)
    for row in range(b):
        for node in range(tree.num_nodes):
            if not tree.valid[row, node]:
                continue
            with torch.no_grad():
                alone = tiny_target(torch.tensor([PROMPTS[row] + _path(tree, row, node)])).logits[0, -1]
            assert torch.allclose(out.logits[row, node], alone, atol=1e-5), (row, node)
    assert int(tree.depths[tree.valid].max()) >= 2


# ---------------------------------------------------------------------------------------------
# 4. greedy equality for the benchmark's tree shapes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    TreeConfig(depth=4, topk=2, budget=8),
    TreeConfig(depth=5, topk=3, budget=16),
    TreeConfig(depth=6, topk=4, budget=32),
    TreeConfig(depth=8, topk=4, budget=64),
    TreeConfig(depth=5, topk=3, budget=16, scheme="greedy"),  # at T = 0 every tree is a topk tree
], ids=["N8-d4-k2", "N16-d5-k3", "N32-d6-k4", "N64-d8-k4", "N16-greedy-scheme"])
def test_greedy_tree_equals_plain_greedy_for_benchmark_shapes(tiny_target, tiny_draft, config):
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=48)
    tree = generate_tree(target, draft, PROMPTS, config=config, max_new_tokens=48)
    assert tree.sequences == plain.sequences
    assert tree.batch_metrics.mean_acceptance_length > 1.5
