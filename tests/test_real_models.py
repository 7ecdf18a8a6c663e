"""End to end on the real default pair (Qwen2.5-Coder 1.5B target / 0.5B draft) on the torch backend.

Every method generates on one pipeline with a float32 target (and a bf16 draft), where greedy
speculative output is compared with plain greedy output token for token. The torch kernels are not batch-invariant: a token verified
in a block of K + 1 gets logits that differ from those of one-token decoding (float32: ~1e-5;
bf16 and weight-only int8 with bf16 activations: up to ~0.25), so where the target's top two
logits are that close greedy speculative output can part from plain greedy output. The bf16 and
int8 tests measure that difference and assert that the outputs part only at such a near tie.
"""

from __future__ import annotations

import pytest
import torch

from quickdraft.methods import METHOD_NAMES, build_method
from quickdraft.decoding.policies import Constant
from quickdraft.verification.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Write a Python function that returns the sum of a list of numbers."

#: largest |block logits - one-token logits| each precision is allowed (measured on an AMD EPYC
#: with AVX-512 BF16: float32 2.1e-5, bf16 0.25, int8 with bf16 activations 0.25)
BLOCK_LOGIT_BOUND = {"float32": 1e-4, "bfloat16": 0.5, "int8": 0.5}


@pytest.fixture(scope="module")
def pipe(real_models):
    from quickdraft.pipeline import Pipeline

    # the draft's precision never changes a lossless method's output, only its speed
    return Pipeline.from_specs("target", "draft", dtype="float32", draft_dtype="bfloat16")


@pytest.fixture(scope="module")
def plain_greedy(pipe):
    return pipe.generate([PROMPT], method="ar", max_new_tokens=16).completions[0]


def test_the_default_pair_shares_one_vocabulary(pipe):
    assert pipe.vocab_size == 151_936
    assert pipe.draft_model.config.vocab_size == pipe.target_model.config.vocab_size


_DATASTORE = {}


def _solutions_datastore(pipe):
    """A retrieval index over the prompts and canonical solutions of HumanEval, built once."""
    if "index" not in _DATASTORE:
        from quickdraft.evaluation.datasets import load_humaneval_problems
        from quickdraft.decoding.retrieval import RetrievalIndex

        texts = [p["prompt"] + p["canonical_solution"] for p in load_humaneval_problems()]
        _DATASTORE["index"] = RetrievalIndex.from_texts(texts, pipe.tokenizer)
    return _DATASTORE["index"]


@pytest.mark.parametrize("method", [m for m in METHOD_NAMES if m != "ar"])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_method_generates_code_on_the_real_pair(pipe, plain_greedy, method, temperature):
    sampling = SamplingParams(temperature=temperature)
    spec = build_method(method, k=4, sampling=sampling, seed=1)
    # retrieval methods draft from a datastore: HumanEval's canonical solutions (real Python code)
    datastore = _solutions_datastore(pipe) if spec.needs_datastore else None
    out = pipe.generate([PROMPT], method=spec.engine_method, rule=spec.rule, policy=spec.policy,
                        sampling=sampling, max_new_tokens=16, seed=1, datastore=datastore)
    completion = out.completions[0]
    m = completion.metrics
    assert m.new_tokens == 16 or completion.finish_reason == "eos"
    assert completion.text.strip()
    assert m.steps >= 1 and m.mean_acceptance_length >= 1.0
    assert m.target_forwards < m.new_tokens + 2  # prefill + at most one forward per token
    if spec.needs_draft:
        assert m.draft_forwards >= m.steps
    if temperature == 0.0 and spec.rule.lossless:
        # lossless at temperature 0 is greedy decoding: every token equals plain decoding's
        assert completion.token_ids == plain_greedy.token_ids


def _block_vs_one_token(model, prompt_ids: list[int], n: int = 5) -> float:
    """max |logits of n greedy tokens verified in one block - their logits decoded one at a time|."""
    from quickdraft.backends.runner import ModelRunner

    runner = ModelRunner(model, "target")
    runner.reset(1)
    tokens = [int(runner.forward(torch.tensor([prompt_ids])).logits[0, -1].argmax())]
    single = []
    for _ in range(n):
        logits = runner.forward(torch.tensor([[tokens[-1]]])).logits[0, -1]
        single.append(logits)
        tokens.append(int(logits.argmax()))
    runner.truncate(runner.lengths - n)
    block = runner.forward(torch.tensor([tokens[:n]])).logits[0]  # [n, V]
    return float((block - torch.stack(single)).abs().max())


def _top2_margin(model, ids: list[int]) -> float:
    """The target's top-1 minus top-2 logit after ``ids`` (one forward over the whole prefix)."""
    with torch.inference_mode():
        top = model(torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return float(top[0] - top[1])


def _greedy_parts_only_at_near_ties(pipe, prompts: list[list[int]], bound: float, max_new_tokens: int) -> list:
    """Greedy ``ngram`` (one-hot drafts verified in blocks) against plain greedy decoding; returns
    (first differing index or None) per prompt, asserting that a departure happens only where the
    target's top two logits are within ``2 * bound`` (plus ``bound`` for the margin's own forward)."""
    firsts = []
    for ids in prompts:
        kw = dict(max_new_tokens=max_new_tokens, policy=Constant(4))
        plain = pipe.generate([""], prompt_ids=[ids], method="ar", **kw).completions[0].token_ids
        spec = pipe.generate([""], prompt_ids=[ids], method="ngram", **kw).completions[0]
        assert spec.metrics.accepted_tokens > 0  # blocks of several tokens were verified
        first = next((i for i, (a, b) in enumerate(zip(plain, spec.token_ids)) if a != b), None)
        if first is None:
            assert spec.token_ids == plain
        else:
            margin = _top2_margin(pipe.target_model, ids + plain[:first])
            assert margin <= 3 * bound, (first, margin)
        firsts.append(first)
    return firsts


def test_float32_block_logits_are_within_the_bound(pipe):
    ids = pipe.encode(PROMPT)
    assert _block_vs_one_token(pipe.target_model, ids) <= BLOCK_LOGIT_BOUND["float32"]


def test_bf16_and_int8_greedy_speculative_output_parts_only_at_near_ties(real_models):
    """The default precision on a CPU with native bf16, then ``--quantize int8`` of the same
    weights: block logits stay within their bound, and greedy output with verification in blocks
    equals plain greedy output up to a near tie of the target. Measured on an AMD EPYC with
    AVX-512 BF16 over 64 tokens of 2 HumanEval and 2 MT-Bench prompts: bf16 identical on 3 of 4
    (first departure at token 51), int8 on 1 of 4 (tokens 7, 25, 51); on the HumanEval prompt
    used here int8 parts at token 7, where the target's top two logits are 0.125 apart."""
    from quickdraft.evaluation.datasets import load_dataset
    from quickdraft.pipeline import Pipeline
    from quickdraft.backends.quant import quantize_by_name

    pipe = Pipeline.from_specs("target", None, dtype="bfloat16")
    prompts = [pipe.encode_messages(load_dataset("humaneval", 2)[1].messages)]  # int8 parted at token 7
    for precision in ("bfloat16", "int8"):
        if precision == "int8":
            quantize_by_name(pipe.target_model, "int8")
        bound = BLOCK_LOGIT_BOUND[precision]
        assert _block_vs_one_token(pipe.target_model, prompts[0]) <= bound
        _greedy_parts_only_at_near_ties(pipe, prompts, bound, max_new_tokens=24)


@pytest.mark.parametrize("method", ["sd", "tree"])
def test_feature_drafter_greedy_equals_plain_greedy_on_the_real_pair(pipe, method):
    """An EAGLE-style feature drafter over the float32 target (its layer a copy of the target's
    last layer, not trained: equality holds for any drafter) drafts chains and trees whose greedy
    output is the target's own, token for token, for 48 tokens of two prompts."""
    from quickdraft.backends.runner import ModelRunner
    from quickdraft.decoding.feature_model import FeatureDraftModel
    from quickdraft.training.feature_drafter import init_from_target

    model = FeatureDraftModel(pipe.target_model).float()
    init_from_target(model, pipe.target_model)
    pipe.feature_draft = ModelRunner(model.eval(), "feature drafter")
    prompts = [PROMPT, "Explain what a Python generator is, in two sentences."]
    try:
        plain = pipe.generate(prompts, method="ar", max_new_tokens=48)
        out = pipe.generate(prompts, method=method, drafter="feature", max_new_tokens=48)
    finally:
        pipe.feature_draft = None
        pipe.target.record_hidden = False
    for a, b in zip(out.completions, plain.completions):
        assert a.token_ids == b.token_ids
    assert out.metrics.draft_forwards > 0
