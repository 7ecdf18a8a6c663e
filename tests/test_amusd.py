"""AMUSD (asynchronous drafting): greedy equality with plain decoding over several K and batches,
rows joining a running batch, seeded reproducibility whatever the draft thread's timing, the exact
output distribution at T = 1 with two controls that must fail, the openvino backend (greedy equality
on float32 exports, one inference thread per model), the pipeline, the command line and errors."""

from __future__ import annotations

import json
import random
import time

import numpy as np
import pytest
import torch

from quickdraft.decoding.amusd import AsyncDrafter, AsyncProposer, keyed_draft_tokens, split_threads
from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import Decoder, generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Confidence, Constant
from quickdraft.verification.rules import Fuzzy, Lossless
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams

from conftest import (TINY_VOCAB, chi_square_pvalue, counts_after_first, exact_after_first, perturbed_copy, tiny_lm,
                      word_tokenizer)
from test_cli import _run, tiny_pipeline  # noqa: F401  (tiny_pipeline is a fixture)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Two Python threads each running tiny torch ops on two OpenMP threads spend their time in
    barriers on the 2-core machine."""


@pytest.fixture(scope="module")
def close_draft(tiny_target):
    """A draft close to the target: most blocks are accepted whole, so most steps start with a
    block drafted during the previous verification."""
    return perturbed_copy(tiny_target, scale=0.05, seed=3)


def _amusd(draft):
    return AsyncDrafter(ModelRunner(draft, "draft"), TINY_VOCAB)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_greedy_amusd_equals_plain_greedy(tiny_target, tiny_draft, close_draft, k):
    target = ModelRunner(tiny_target, "target")
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=40)
    for draft in (tiny_draft, close_draft):
        for prompts in (PROMPTS[:1], PROMPTS):  # B = 1 and B = 3
            drafter = _amusd(draft)
            out = generate(target, prompts, method="amusd", drafter=drafter, policy=Constant(k), max_new_tokens=40)
            assert out.sequences == plain.sequences[: len(prompts)], (k, len(prompts))
            m = out.batch_metrics
            assert m.accepted_tokens > 0
            assert m.prefill_tokens + m.emitted_tokens >= m.new_tokens  # before the budget's cut
    # with the close draft most steps start with their block already drafted
    drafter = _amusd(close_draft)
    out = generate(target, PROMPTS[:1], method="amusd", drafter=drafter, policy=Constant(k), max_new_tokens=40)
    if k > 1:
        assert drafter.ready_steps > drafter.steps // 2
        assert out.batch_metrics.steps < 40


def test_a_fully_accepted_block_defers_its_bonus(tiny_target, close_draft):
    """A step whose block is accepted whole emits its K tokens and no bonus: the target's
    distribution after the block verifies the next block's first token, so tokens per target
    forward stay at most K and the metrics count what was emitted."""
    target = ModelRunner(tiny_target)
    out = generate(target, PROMPTS[:1], method="amusd", drafter=_amusd(close_draft), policy=Constant(3),
                   max_new_tokens=40)
    m = out.batch_metrics
    assert m.emitted_tokens < m.accepted_tokens + m.steps  # some steps emitted n, not n + 1
    assert m.new_tokens == 40 and m.emitted_tokens <= 3 * m.steps + 1  # the last step takes its bonus
    sd = generate(target, PROMPTS[:1], method="sd", drafter=ModelDrafter(ModelRunner(close_draft), TINY_VOCAB),
                  policy=Constant(3), max_new_tokens=40).batch_metrics
    assert sd.emitted_tokens == sd.accepted_tokens + sd.steps


def test_eos_and_budget_stop_rows(tiny_target, close_draft):
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=30)
    eos = plain.sequences[0][7]
    out = generate(target, PROMPTS, method="amusd", drafter=_amusd(close_draft), policy=Constant(3),
                   max_new_tokens=30, eos_token_ids={eos})
    first = plain.sequences[0].index(eos)
    assert out.sequences[0] == plain.sequences[0][: first + 1] and out.finish_reasons[0] == "eos"
    for row in (1, 2):
        seq = plain.sequences[row]
        cut = seq.index(eos) + 1 if eos in seq else len(seq)
        assert out.sequences[row] == seq[:cut]


def test_rows_join_and_leave_a_running_batch(tiny_target, close_draft):
    """The ready blocks follow the decoder's stable row ids: rows added and removed between steps
    keep greedy equality."""
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=24).sequences
    decoder = Decoder(target, PROMPTS[:2], method="amusd", drafter=_amusd(close_draft), policy=Constant(3),
                      max_new_tokens=24)
    for _ in range(3):
        decoder.step()
    decoder.add_rows([PROMPTS[2]], [24])
    decoder.step()
    decoder.remove_rows([0])
    while decoder.active.any():
        decoder.step()
    assert decoder.new_ids == [plain[1], plain[2]]


class SlowRunner(ModelRunner):
    """A draft runner whose forwards take random extra time: the draft thread's timing changes
    from run to run."""

    def forward(self, *args, **kwargs):
        time.sleep(random.random() * 0.003)
        return super().forward(*args, **kwargs)


def test_seeded_sampling_is_reproducible_whatever_the_timing(tiny_target, tiny_draft):
    target = ModelRunner(tiny_target)
    params = SamplingParams(temperature=0.9, top_p=0.95)

    def run(seed, runner_class=ModelRunner):
        drafter = AsyncDrafter(runner_class(tiny_draft, "draft"), TINY_VOCAB)
        return generate(target, PROMPTS, method="amusd", drafter=drafter, policy=Constant(3), sampling=params,
                        seed=seed, max_new_tokens=30).sequences

    first = run(5)
    assert run(5, SlowRunner) == first
    assert run(5) == first
    assert run(6) != first


def test_keyed_draft_tokens_follow_the_distribution_and_their_keys():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).expand(30_000, 4)
    rows = torch.arange(30_000)
    tokens = keyed_draft_tokens(probs, 7, rows, torch.full((30_000,), 12))
    counts = np.bincount(tokens.numpy(), minlength=4)
    assert chi_square_pvalue(counts, probs[0].numpy()) > 1e-4 and counts[3] == 0
    again = keyed_draft_tokens(probs, 7, rows, torch.full((30_000,), 12))
    other = keyed_draft_tokens(probs, 7, rows, torch.full((30_000,), 13))
    assert torch.equal(tokens, again) and not torch.equal(tokens, other)


def test_amusd_sampling_matches_the_target(one_thread):
    """At T = 1 on a vocabulary-8 pair with a close draft, 12,000 rows generate five tokens with
    K = 2: blocks accepted whole defer their bonus, and the carried distribution verifies the next
    block's first token. The three tokens after the prefill's follow the target's exact law (512 cells,
    chi-square p > 1e-4). Two broken variants fail the same test (p < 1e-6): accepting every draft,
    and accepting the ready block's first token unverified (carrying the draft's own distribution
    instead of the target's)."""
    v, n = 8, 12_000
    model = tiny_lm(seed=31, vocab=v, max_positions=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    draft = perturbed_copy(model, scale=0.3, seed=2)
    params = SamplingParams(temperature=1.0)
    prompt = [5, 4, 7, 5]
    exact = exact_after_first(model, prompt, params, 3)
    target = ModelRunner(model)

    def run(rule=Lossless(), proposer=AsyncProposer):
        drafter = AsyncDrafter(ModelRunner(draft), v)
        drafter.proposer = lambda policy, rule, sampling: proposer(drafter, policy, rule, sampling)
        out = generate(target, [prompt] * n, method="amusd", drafter=drafter, rule=rule, policy=Constant(2),
                       sampling=params, max_new_tokens=5, seed=17)
        counts = counts_after_first(out.sequences, v, 3)
        return counts, out.batch_metrics

    counts, m = run()
    assert n // 2 < m.steps - (m.emitted_tokens - m.accepted_tokens)  # steps that deferred their bonus
    assert m.accepted_tokens < m.drafted_tokens  # and rejections
    assert chi_square_pvalue(counts, exact) > 1e-4

    class AcceptAll(Lossless):
        def accept(self, draft_ids, draft_probs, target_probs, ctx):
            return torch.ones_like(draft_ids, dtype=torch.bool), None

    class UnverifiedFirstToken(AsyncProposer):
        def propose(self, sequences, active, cap, ctx):
            proposal = super().propose(sequences, active, cap, ctx)
            if proposal.draft.ids.shape[1]:
                proposal.carry = proposal.draft.probs[:, 0]
            return proposal

    assert chi_square_pvalue(run(rule=AcceptAll())[0], exact) < 1e-6
    assert chi_square_pvalue(run(proposer=UnverifiedFirstToken)[0], exact) < 1e-6


def test_errors(tiny_target, tiny_draft):
    target = ModelRunner(tiny_target)
    with pytest.raises(QuickdraftError, match="policy constant"):
        generate(target, PROMPTS, method="amusd", drafter=_amusd(tiny_draft), policy=Confidence(max_k=4))
    with pytest.raises(QuickdraftError, match="greedy or lossless rule"):
        generate(target, PROMPTS, method="amusd", drafter=_amusd(tiny_draft), rule=Fuzzy())
    with pytest.raises(QuickdraftError, match="cannot draft with a ModelDrafter"):
        generate(target, PROMPTS, method="amusd", drafter=ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB))
    with pytest.raises(QuickdraftError, match="cannot draft with a AsyncDrafter"):
        generate(target, PROMPTS, method="sd", drafter=_amusd(tiny_draft))
    with pytest.raises(QuickdraftError, match="policy constant"):
        build_method("amusd", policy="heuristic")
    with pytest.raises(QuickdraftError, match="openvino backend"):
        Pipeline.from_specs("target", "draft", backend="torch", threads=(1, 1))
    assert split_threads(2) == (1, 1) and split_threads(3) == (2, 1) and split_threads(1) == (1, 1)


def test_pipeline_and_cli_run_amusd(tiny_pipeline):  # noqa: F811
    pipe = tiny_pipeline
    plain = pipe.generate("w1 w2 w3", method="ar", max_new_tokens=20, chat=False)
    out = pipe.generate("w1 w2 w3", method="amusd", k=3, max_new_tokens=20, chat=False)
    assert out.completions[0].token_ids == plain.completions[0].token_ids
    assert isinstance(pipe.drafter_for("amusd"), AsyncDrafter)
    spec = build_method("amusd", k=3)
    assert spec.engine_method == "amusd" and spec.needs_draft and isinstance(spec.policy, Constant)
    common = ["generate", "w1 w2 w3", "--no-chat", "--max-new-tokens", "16", "--json"]
    result = _run(*common, "--method", "amusd", "--k", "3")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output[result.output.index("{"):])
    ar = json.loads((r := _run(*common, "--method", "ar")).output[r.output.index("{"):])
    assert payload["method"] == "amusd" and payload["text"] == ar["text"]
    assert payload["metrics"]["draft_forwards"] > 0


# -- the openvino backend ------------------------------------------------------------------------


def _need_openvino() -> None:
    from quickdraft.backends.openvino import is_available

    if not is_available():  # pragma: no cover - depends on the environment
        pytest.skip("openvino and nncf are not installed")


@pytest.fixture(scope="module")
def ov_models(tmp_path_factory, tiny_target, close_draft):
    """Float32 exports of the tiny target and the close draft (as tests/test_openvino.py makes them)."""
    _need_openvino()
    from quickdraft.backends.openvino.export import export

    root = tmp_path_factory.mktemp("ov_amusd")
    dirs = []
    for name, model in (("target", tiny_target), ("draft", close_draft)):
        model.config._attn_implementation = "sdpa"
        model.save_pretrained(root / f"{name}_hf")
        dirs.append(export(root / f"{name}_hf", root / f"{name}_ov", "none", progress=False))
    return dirs


def _ov_runner(path, name):
    from quickdraft.backends.openvino import OpenVINORunner

    return OpenVINORunner(path, name, n_threads=1, kv_cache_precision="f32", inference_precision="f32")


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_amusd_equals_plain_greedy_on_openvino(ov_models, k):
    """Both models on OpenVINO, one inference thread each, the draft's forwards on the draft
    thread beside the target's: greedy output equals the backend's plain greedy output."""
    target, draft = _ov_runner(ov_models[0], "target"), _ov_runner(ov_models[1], "draft")
    assert draft.compiled.get_property("INFERENCE_NUM_THREADS") == 1
    prompts = [[1, 5, 9, 2, 7], [3, 3, 3, 8], [11, 4, 6, 1, 2, 9, 30, 31]]
    plain = generate(target, prompts, method="ar", max_new_tokens=40).sequences
    for batch in (prompts[:1], prompts):
        drafter = AsyncDrafter(draft, TINY_VOCAB)
        out = generate(target, batch, method="amusd", drafter=drafter, policy=Constant(k), max_new_tokens=40)
        assert out.sequences == plain[: len(batch)]
        assert drafter.ready_steps > 0 and out.batch_metrics.target_forwards < len(batch) * 40


def test_pipeline_splits_the_threads_on_openvino(tmp_path):
    """``Pipeline.from_specs(..., threads=(t, d))`` compiles each model with its own thread count;
    ``amusd`` through the pipeline equals plain greedy decoding."""
    _need_openvino()
    before = torch.get_num_threads()
    target = tiny_lm(seed=4, vocab=72)  # room for the ids the saved word tokenizer adds
    dirs = []
    for name, model in (("t", target), ("d", perturbed_copy(target, 0.05, seed=5))):
        model.config._attn_implementation = "sdpa"
        model.save_pretrained(tmp_path / name)
        word_tokenizer().save_pretrained(tmp_path / name)
        dirs.append(str(tmp_path / name))
    try:
        pipe = Pipeline.from_specs(*dirs, backend="openvino", quantize="none", threads=(2, 1))
        assert pipe.target.compiled.get_property("INFERENCE_NUM_THREADS") == 2
        assert pipe.draft.compiled.get_property("INFERENCE_NUM_THREADS") == 1
        kw = dict(prompt_ids=[[1, 5, 9, 2, 7]], max_new_tokens=16, k=3)
        plain = pipe.generate([""], method="ar", **kw).completions[0].token_ids
        assert pipe.generate([""], method="amusd", **kw).completions[0].token_ids == plain
    finally:
        torch.set_num_threads(before)
