"""The torch engine and the vLLM plugin's accept step on a CUDA device.

Skipped without a CUDA device (CI has none; ``bash scripts/test_cuda.sh`` runs this file on a GPU
machine). The statements are the CPU suite's, on tensors that live on the GPU: greedy speculative
decoding (chains, lookup drafts, trees) equals plain greedy decoding token for token and the CPU's
greedy output; speculative sampling through the whole engine, chains and trees, follows the target's
exact two-token law, and a broken rule fails the same test; token trees are built and walked on the
host, their forwards run on the GPU; seeded sampling is reproducible; the
vLLM plugin's ragged accept step equals ``verify_chain`` on the padded batch, both on the GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter, NGramModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.backends.vllm_plugin import verify_requests
from quickdraft.decoding.policies import Constant
from quickdraft.verification.rules import ExponentialRace, Fuzzy, Lossless, Typical, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams
from quickdraft.decoding.tree import TreeConfig
from quickdraft.decoding.tree_decoding import generate_tree
from quickdraft.verification.verify import verify_chain

from conftest import TINY_VOCAB, chi_square_pvalue, perturbed_copy, tiny_lm
from test_engine import _exact_two_token_distribution, _two_token_counts
from test_vllm_plugin import _padded_reference, _ragged_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

CUDA = "cuda"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]
REPEATING = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [9, 9, 1, 2, 9, 9, 1]]  # prompts lookup drafting finds


def on_cuda(model):
    return copy.deepcopy(model).to(CUDA)


@pytest.fixture(scope="module")
def cuda_pair(tiny_target, tiny_draft):
    return on_cuda(tiny_target), on_cuda(tiny_draft)


def test_runner_lives_on_the_device(cuda_pair):
    runner = ModelRunner(cuda_pair[0], "target")
    runner.reset(2)
    out = runner.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert out.logits.device.type == CUDA and runner.lengths.device.type == CUDA


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_speculative_equals_plain_greedy_and_the_cpu(tiny_target, cuda_pair, k):
    target = ModelRunner(cuda_pair[0], "target")
    drafter = ModelDrafter(ModelRunner(cuda_pair[1], "draft"), TINY_VOCAB)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=40)
    cpu = generate(ModelRunner(tiny_target, "target"), PROMPTS, method="ar", max_new_tokens=40)
    assert plain.sequences == cpu.sequences
    spec = generate(target, PROMPTS, method="sd", drafter=drafter, policy=Constant(k), max_new_tokens=40)
    assert spec.sequences == plain.sequences
    assert spec.batch_metrics.accepted_tokens > 0


def test_lookup_drafters_greedy_equal_plain_greedy(cuda_pair):
    target = ModelRunner(cuda_pair[0], "target")
    plain = generate(target, REPEATING, method="ar", max_new_tokens=30)
    lookup = generate(target, REPEATING, method="ngram", drafter=NGramDrafter(TINY_VOCAB), policy=Constant(4),
                      max_new_tokens=30)
    assert lookup.sequences == plain.sequences
    both = NGramModelDrafter(NGramDrafter(TINY_VOCAB), ModelDrafter(ModelRunner(cuda_pair[1], "draft"), TINY_VOCAB))
    mixed = generate(target, REPEATING, method="ngram_sd", drafter=both, policy=Constant(4), max_new_tokens=30)
    assert mixed.sequences == plain.sequences


def test_tree_greedy_equals_plain_greedy(cuda_pair):
    target, draft = ModelRunner(cuda_pair[0], "target"), ModelRunner(cuda_pair[1], "draft")
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=40)
    tree = generate_tree(target, draft, PROMPTS, config=TreeConfig(depth=3, topk=2, budget=6), max_new_tokens=40)
    assert tree.sequences == plain.sequences


def test_tree_sampling_matches_the_target(tiny_target):
    """10,000 rows of depth-2 trees (children drawn without replacement, recursive rejection
    sampling) on the GPU: the two tokens after the prefill's follow the target's exact law; walking the same
    trees as if every row were greedy (the target's argmax) fails."""
    params = SamplingParams(temperature=1.0)
    exact = _exact_two_token_distribution(tiny_target, [1, 2, 3], params)
    target = ModelRunner(on_cuda(tiny_target))
    draft = ModelRunner(on_cuda(perturbed_copy(tiny_target, scale=0.6, seed=5)))
    config = TreeConfig(depth=2, topk=3, budget=7, scheme="without_replacement")
    out = generate_tree(target, draft, [[1, 2, 3]] * 10_000, config=config, verifier="rrs", sampling=params,
                        max_new_tokens=3, seed=2)
    assert out.batch_metrics.accepted_tokens > 10_000 // 4
    assert chi_square_pvalue(_two_token_counts(out.sequences), exact) > 1e-4
    greedy = generate_tree(target, draft, [[1, 2, 3]] * 2_000, config=TreeConfig(depth=2, topk=3, budget=7),
                           max_new_tokens=3, seed=2)
    assert chi_square_pvalue(_two_token_counts(greedy.sequences), exact) < 1e-6


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=10, top_p=0.9)])
def test_speculative_sampling_matches_the_target(tiny_target, params):
    """20,000 three-token continuations drawn through the engine on the GPU, with a draft that often
    disagrees: the two tokens after the prefill's follow the target's exact law (computed on the
    CPU); accepting every draft fails."""
    prompt = [1, 2, 3]
    exact = _exact_two_token_distribution(tiny_target, prompt, params)
    n = 20_000
    target = ModelRunner(on_cuda(tiny_target))
    drafter = ModelDrafter(ModelRunner(on_cuda(tiny_lm(seed=7))), TINY_VOCAB)
    out = generate(target, [prompt] * n, method="sd", drafter=drafter, rule=Lossless(), policy=Constant(3),
                   sampling=params, max_new_tokens=3, seed=11)
    assert chi_square_pvalue(_two_token_counts(out.sequences), exact) > 1e-4

    class AcceptAll(Lossless):
        def accept(self, draft_ids, draft_probs, target_probs, ctx):
            return torch.ones_like(draft_ids, dtype=torch.bool), None

    bad = generate(target, [prompt] * n, method="sd", drafter=drafter, rule=AcceptAll(), policy=Constant(3),
                   sampling=params, max_new_tokens=3, seed=11)
    assert chi_square_pvalue(_two_token_counts(bad.sequences), exact) < 1e-6


def test_seeded_sampling_is_reproducible(cuda_pair):
    target = ModelRunner(cuda_pair[0], "target")
    drafter = ModelDrafter(ModelRunner(cuda_pair[1], "draft"), TINY_VOCAB)
    runs = [generate(target, PROMPTS, method="sd", drafter=drafter, policy=Constant(3),
                     sampling=SamplingParams(temperature=1.0), max_new_tokens=30, seed=5).sequences for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("rule", [Lossless(), Typical(), Fuzzy(threshold=0.5, use_raw=False), ExponentialRace(seed=5)],
                         ids=lambda r: r.name)
def test_vllm_accept_step_equals_verify_chain_on_the_device(rule):
    num_drafts, vocab = [2, 0, 3, 1, 3], 11
    batch = [t.to(CUDA) for t in _ragged_batch(num_drafts, vocab, seed=0)]
    draft_ids, cu, draft_probs, target_logits, bonus = batch
    is_greedy = torch.tensor([False, False, True, False, False], device=CUDA)
    positions = torch.tensor([7, 3, 12, 5, 9], device=CUDA)
    row_ids = torch.tensor([101, 102, 103, 104, 105], device=CUDA)
    rows = [0, 1, 2, 4]
    got = verify_requests(rule, torch.tensor(rows, device=CUDA), draft_ids, cu, draft_probs, target_logits, bonus,
                          is_greedy, positions, row_ids, torch.Generator(device=CUDA).manual_seed(9))
    assert got.output_ids.device.type == CUDA

    cpu = [t.cpu() for t in batch]
    ids, q, p, lengths = _padded_reference(num_drafts, rows, cpu[0], cpu[2], cpu[3], cpu[4], is_greedy.tolist(), vocab)
    ids, q, p, lengths = ids.to(CUDA), q.to(CUDA), p.to(CUDA), lengths.to(CUDA)
    ctx = VerifyContext(positions=positions[rows], raw_draft_probs=q, raw_target_probs=p,
                        extra={"row_ids": row_ids[rows]})
    want = verify_chain(ids, q, p, rule, torch.Generator(device=CUDA).manual_seed(9), ctx=ctx, draft_lengths=lengths)
    assert torch.equal(got.output_ids, want.output_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
