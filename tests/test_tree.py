"""Token trees on tiny fp32 models: compilation, tree attention, KV compaction, greedy equality and
the exact law of the emitted 2-token sequences.

Goodness of fit
---------------
``test_depth2_tree_emits_the_target_joint`` draws N = 100,000 tree steps in one batch for every
(scheme, verifier) pair: a real depth-2 tree built by :func:`build_tree` from the tiny draft model's
distributions and verified by :func:`verify_tree` against the tiny target's. To stay fast the two
models are run once on every possible path (V = 64 first tokens), and the per-row forwards are
looked up in those tables (the tree attention that makes the real forwards equal to these tables
is tested separately, token for token). When the walk leaves the tree after one token, the
second token is drawn from the exact target conditional, which is what the next step does by
the same (tested) argument. The emitted pair is compared with the exact joint ``p(t1) p(t2 | t1)``
(4,096 cells, expected counts < 5 pooled) by Pearson's chi-square; pass at p > 1e-4 (6 lossless
cases: a false alarm has probability ≤ 6e-4), and a negative control — a top-k (deterministic)
tree verified as if its children were samples of the draft, the bug EAGLE-2-style trees invite —
must give p < 1e-6 already at 30,000 samples. ``test_generate_tree_end_to_end_matches_the_target`` runs the whole loop
(real tree forwards, KV compaction, second steps) on 10,000 rows for one pair.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.verification.rules import Fuzzy, Typical
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs
from quickdraft.decoding.tree import TokenTree, TreeConfig, ancestor_mask, build_tree, compile_paths, sampled_plan
from quickdraft.decoding.tree_decoding import generate_tree

from conftest import (TINY_VOCAB, chi_square_pvalue as _chi_square_pvalue, counts_after_first, exact_after_first,
                      perturbed_copy, tiny_lm, tree_pair_counts)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
PROMPT = [1, 2, 3]
N = 100_000
P_PASS = 1e-4
P_FAIL = 1e-6


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# structure
# ---------------------------------------------------------------------------------------------


def test_compile_paths_gives_parents_depths_mask_and_retrieve_indices():
    t = compile_paths([[1], [0, 0], [0], [0, 1], [0, 0, 0]])
    assert t.paths == [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 3]
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 3]
    assert t.num_children.tolist() == [2, 2, 0, 1, 0, 0]
    assert t.retrieve_indices.tolist() == [[0, 2, -1, -1], [0, 1, 4, -1], [0, 1, 3, 5]]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for node in range(6):
        a = node
        while a >= 0:
            expected[node, a] = True
            a = int(t.parents[a])
    assert torch.equal(t.mask, expected)


def test_the_module_doctests_pass():
    """The worked examples in quickdraft.decoding.tree's docstrings are run, not just read."""
    import doctest

    import quickdraft.decoding.tree

    result = doctest.testmod(quickdraft.decoding.tree, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result


@pytest.mark.parametrize("paths, message", [
    ([], "at least one path"), ([[0, 0]], "no parent"), ([[0], [2]], "skips rank"), ([[0], [0]], "duplicate"),
    ([[0], [-1]], "child ranks"),
])
def test_compile_paths_rejects_bad_trees(paths, message):
    with pytest.raises(QuickdraftError, match=message):
        compile_paths(paths)


def test_config_and_plan_validation():
    assert sampled_plan(3, 4, 16) == [[4], [4, 2], [4, 2]]
    assert sum(map(sum, sampled_plan(5, 3, 20))) <= 20
    assert TreeConfig(depth=4, topk=4, budget=16).max_nodes == 17
    with pytest.raises(QuickdraftError, match="budget"):
        TreeConfig(budget=0)
    with pytest.raises(QuickdraftError, match="scheme"):
        TreeConfig(scheme="beam")


# ---------------------------------------------------------------------------------------------
# tree attention and KV compaction
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_node_logits_equal_running_each_path_alone(attn):
    model = tiny_lm(seed=4)
    model.config._attn_implementation = attn
    runner = ModelRunner(model)
    runner.reset(2)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, TINY_VOCAB, (2, 6), generator=gen)
    valid = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]], dtype=torch.bool)  # row 1 left-padded (holes)
    runner.forward(prefix, valid)
    # two different trees in one batch: row 0 is paths [[0],[1],[0,0],[0,1],[0,0,0]], row 1 a chain
    trees = [compile_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]]).parents, torch.tensor([-1, 0, 1, 2, 3, 4])]
    parents = torch.stack(trees)
    depths = torch.stack([compile_paths([[0], [1], [0, 0], [0, 1], [0, 0, 0]]).depths, torch.arange(6)])
    tokens = torch.randint(0, TINY_VOCAB, (2, 6), generator=gen)
    runner.begin_tree()
    out = runner.forward_tree(tokens, depths, ancestor_mask(parents))
    mask = ancestor_mask(parents)
    for row in range(2):
        ctx = prefix[row][valid[row]]
        for node in range(6):
            path = tokens[row][mask[row, node]]  # ancestors in index order = root-to-node order
            with torch.no_grad():
                alone = model(torch.cat([ctx, path]).unsqueeze(0)).logits[0, -1]
            assert torch.allclose(out.logits[row, node], alone, atol=1e-5), (row, node)
    # keep root -> 1 -> 3 in row 0 and root -> 1 in row 1; the next token sees exactly those paths
    runner.commit_tree(torch.tensor([[0, 1, 3], [0, 1, 0]]), torch.tensor([3, 2]))
    assert runner.lengths.tolist() == [9, 5] and runner.tree_start is None
    nxt = torch.randint(0, TINY_VOCAB, (2, 1), generator=gen)
    after = runner.forward(nxt)
    for row, kept in enumerate([[0, 1, 3], [0, 1]]):
        seq = torch.cat([prefix[row][valid[row]], tokens[row, kept], nxt[row]])
        with torch.no_grad():
            alone = model(seq.unsqueeze(0)).logits[0, -1]
        assert torch.allclose(after.logits[row, -1], alone, atol=1e-5)


def test_commit_tree_rejects_a_non_path_and_forward_inside_a_session(tiny_target):
    runner = ModelRunner(tiny_target)
    runner.reset(1)
    runner.forward(torch.tensor([[1, 2, 3]]))
    runner.begin_tree()
    runner.forward_tree(torch.tensor([[4, 5, 6]]), torch.tensor([[0, 1, 1]]), ancestor_mask(torch.tensor([[-1, 0, 0]])))
    with pytest.raises(QuickdraftError, match="tree session is open"):
        runner.forward(torch.tensor([[1]]))
    with pytest.raises(QuickdraftError, match="root-to-node path"):
        runner.commit_tree(torch.tensor([[0, 2, 1]]), torch.tensor([3]))  # nodes 1 and 2 are siblings
    runner.commit_tree(torch.tensor([[0, 2]]), torch.tensor([2]))
    assert runner.num_slots == 5 and runner.cache.get_seq_length() == 5


# ---------------------------------------------------------------------------------------------
# greedy trees reproduce plain greedy decoding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", [
    TreeConfig(depth=3, topk=2, budget=6),
    TreeConfig(depth=5, topk=4, budget=24),
    TreeConfig(paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))),
])
def test_greedy_tree_decoding_equals_plain_greedy(tiny_target, tiny_draft, config):
    target = ModelRunner(tiny_target)
    draft = ModelRunner(tiny_draft)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=40)
    for prompts in (PROMPTS[:1], PROMPTS):  # B = 1 and B = 3 (rows with different trees)
        tree = generate_tree(target, draft, prompts, config=config, max_new_tokens=40)
        assert tree.sequences == plain.sequences[: len(prompts)]
        m = tree.batch_metrics
        assert m.mean_acceptance_length > 1.5  # the trees do get accepted
        assert m.steps < sum(len(s) for s in tree.sequences)


def test_tree_depth_is_capped_by_the_tokens_left(tiny_target, tiny_draft):
    """Trees 20 deep for a 4-token budget: at most 3, 2, 1, 1 draft layers, the greedy text of
    plain decoding; static trees drop their paths deeper than the cap."""
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=4)
    out = generate_tree(target, draft, PROMPTS, config=TreeConfig(depth=20, topk=2, budget=30), max_new_tokens=4)
    assert out.sequences == plain.sequences
    assert out.batch_metrics.draft_forwards <= 3 + 2 + 1 + 1
    static = TreeConfig(paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    assert static.capped(2).paths == ((0,), (1,), (0, 0), (0, 1), (1, 0)) and static.capped(3) is static
    assert static.capped(0).paths == ((0,), (1,)) and TreeConfig(depth=5).capped(2).depth == 2


def test_eos_stops_a_row(tiny_target, tiny_draft):
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=30)
    eos = plain.sequences[0][5]
    out = generate_tree(target, draft, PROMPTS, config=TreeConfig(3, 2, 6), max_new_tokens=30, eos_token_ids={eos})
    first = plain.sequences[0].index(eos)
    assert out.sequences[0] == plain.sequences[0][: first + 1]
    assert out.finish_reasons[0] == "eos"


# ---------------------------------------------------------------------------------------------
# exact law of the emitted 2-token sequences
# ---------------------------------------------------------------------------------------------


class _Tables:
    """Both models run once on every depth-1 path after PROMPT: logits by first token."""

    def __init__(self, target_model, draft_model, params: SamplingParams):
        with torch.no_grad():
            batch = torch.tensor([PROMPT + [t] for t in range(TINY_VOCAB)])
            self.draft_root = draft_model(torch.tensor([PROMPT])).logits[0, -1]  # [V]
            self.draft_after = draft_model(batch).logits[:, -1]  # [V(first), V]
            self.p1 = logits_to_probs(target_model(torch.tensor([PROMPT])).logits[0, -1], params)  # [V]
            self.p2 = logits_to_probs(target_model(batch).logits[:, -1], params)  # [V(first), V]
        self.params = params

    def joint(self) -> np.ndarray:
        return (self.p1.unsqueeze(1) * self.p2).double().numpy()

    def emit_pairs(self, config: TreeConfig, verifier: str, n: int, seed: int, relabel: str | None = None) -> np.ndarray:
        gen = torch.Generator().manual_seed(seed)
        roots = torch.full((n,), PROMPT[-1], dtype=torch.long)

        def expand(tokens, depths, mask, valid):  # depth-1 frontier nodes -> draft logits after them
            return self.draft_after[tokens]

        tree = build_tree(roots, self.draft_root.expand(n, -1), expand, config, self.params, gen)
        if relabel is not None:  # negative control: tell the verifier the wrong draft law
            tree = TokenTree(**{**tree.__dict__, "scheme": relabel})
        return tree_pair_counts(tree, self.p1, self.p2, verifier, gen)[0]


@pytest.fixture(scope="module")
def tables(tiny_target):
    draft = perturbed_copy(tiny_target, scale=0.6, seed=5)  # agrees often, not always
    return {
        "T1": _Tables(tiny_target, draft, SamplingParams(temperature=1.0)),
        "T0.7-top": _Tables(tiny_target, draft, SamplingParams(temperature=0.7, top_k=12, top_p=0.9)),
    }


CASES = [
    ("T1", "topk", "rrs"),
    ("T1", "with_replacement", "rrs"),
    ("T1", "with_replacement", "kseq"),
    ("T1", "without_replacement", "rrs"),
    ("T1", "greedy", "optimal_greedy"),
    ("T0.7-top", "greedy", "rrs"),
]


@pytest.mark.parametrize("params, scheme, verifier", CASES)
def test_depth2_tree_emits_the_target_joint(tables, params, scheme, verifier):
    t = tables[params]
    config = TreeConfig(depth=2, topk=3, budget=7, scheme=scheme)
    counts = t.emit_pairs(config, verifier, N, seed=CASES.index((params, scheme, verifier)))
    assert counts.sum() == N
    assert _chi_square_pvalue(counts, t.joint()) > P_PASS


def test_negative_control_deterministic_children_verified_as_samples_fails(tables):
    t = tables["T1"]
    counts = t.emit_pairs(TreeConfig(depth=2, topk=3, budget=7, scheme="topk"), "rrs", 30_000, seed=3,
                          relabel="with_replacement")
    assert _chi_square_pvalue(counts, t.joint()) < P_FAIL


def test_generate_tree_end_to_end_matches_the_target(tiny_target):
    """10,000 rows through generate_tree (real tree forwards, compaction, second steps); the
    four-token budget leaves the first step after the prefill's token its full depth-2 trees, and
    the two tokens after the prefill's are tested against the target's law (the first token
    marginalised out)."""
    params = SamplingParams(temperature=1.0)
    draft = perturbed_copy(tiny_target, scale=0.6, seed=5)
    n = 10_000
    out = generate_tree(
        ModelRunner(tiny_target), ModelRunner(draft), [PROMPT] * n,
        config=TreeConfig(depth=2, topk=3, budget=7, scheme="without_replacement"), verifier="rrs",
        sampling=params, max_new_tokens=4, seed=2,
    )
    counts = counts_after_first(out.sequences, TINY_VOCAB, 2)
    assert out.batch_metrics.accepted_tokens > n // 4  # the walk does go down the trees
    assert _chi_square_pvalue(counts, exact_after_first(tiny_target, PROMPT, params, 2)) > P_PASS


def test_bad_combinations_raise(tiny_target, tiny_draft):
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    with pytest.raises(QuickdraftError, match="not lossless"):
        generate_tree(target, draft, [[1, 2]], config=TreeConfig(scheme="topk"), verifier="kseq",
                      sampling=SamplingParams(temperature=1.0))
    with pytest.raises(QuickdraftError, match="unknown verifier"):
        generate_tree(target, draft, [[1, 2]], verifier="beam", sampling=SamplingParams(temperature=1.0))
    with pytest.raises(QuickdraftError, match="empty prompt"):
        generate_tree(target, draft, [[]])


def test_fsd_on_trees_threshold_zero_is_greedy_and_infinity_follows_the_first_child(tiny_target, tiny_draft):
    target, draft = ModelRunner(tiny_target), ModelRunner(tiny_draft)
    config = TreeConfig(depth=3, topk=2, budget=6)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=30)
    exact = generate_tree(target, draft, PROMPTS, config=config, rule=Fuzzy(threshold=0.0), max_new_tokens=30)
    assert exact.sequences == plain.sequences and exact.batch_metrics.lossy_accepted_tokens == 0
    trusting = generate_tree(target, draft, PROMPTS[:1], config=config, rule=Fuzzy(threshold=float("inf")),
                             max_new_tokens=30)
    m = trusting.batch_metrics
    # every step walks the draft's best child to the deepest kept node without any test
    assert m.lossy_accepted_tokens == m.accepted_tokens > 0
    assert m.mean_acceptance_length > 2.5
    some = generate_tree(target, draft, PROMPTS, config=config, rule=Fuzzy(divergence="tv", threshold=0.15),
                         sampling=SamplingParams(temperature=0.8), max_new_tokens=30, seed=1)
    assert 0 < some.batch_metrics.lossy_accepted_tokens < some.batch_metrics.accepted_tokens


def test_tree_method_is_registered():
    spec = build_method("tree", tree_budget=12, depth=3, topk=3, verifier="kseq", tree_sampling="with_replacement",
                        sampling=SamplingParams(temperature=0.7))
    assert spec.engine_method == "tree" and spec.needs_draft and spec.verifier == "kseq"
    assert spec.tree == TreeConfig(depth=3, topk=3, budget=12, scheme="with_replacement")
    assert isinstance(build_method("tree", tree_rule="fsd", threshold=0.2).rule, Fuzzy)
    with pytest.raises(QuickdraftError, match="not lossless"):
        build_method("tree", verifier="optimal_greedy", tree_sampling="topk", sampling=SamplingParams(temperature=1.0))


def test_typical_acceptance_is_refused_on_trees(tiny_target, tiny_draft):
    # (ERSD runs on trees: tests/test_ersd_tree.py)
    with pytest.raises(QuickdraftError, match="not supported on trees"):
        generate_tree(ModelRunner(tiny_target), ModelRunner(tiny_draft), [[1, 2]], rule=Typical())
