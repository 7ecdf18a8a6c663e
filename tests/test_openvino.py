"""The OpenVINO backend on tiny models: the exported graph against the torch model, the runner's
cache bookkeeping (holes, compaction, trees, rows), and every chain method's greedy output equal to
the same backend's plain greedy output; the goodness-of-fit test of the lossless rule through it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from quickdraft.backends.openvino import is_available

if not is_available():  # pragma: no cover - depends on the environment
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the OpenVINO backend's tests: openvino/nncf are not importable")
    pytest.skip("openvino and nncf are not installed (pip install 'quickdraft[openvino]')", allow_module_level=True)

from quickdraft.backends.openvino import OpenVINORunner  # noqa: E402
from quickdraft.backends.openvino.export import export, is_exported  # noqa: E402
from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter, NGramModelDrafter  # noqa: E402
from quickdraft.decoding.engine import generate  # noqa: E402
from quickdraft.errors import QuickdraftError  # noqa: E402
from quickdraft.decoding.policies import Confidence, Constant  # noqa: E402
from quickdraft.verification.rules import Fuzzy, Lossless, Typical  # noqa: E402
from quickdraft.backends.runner import ModelRunner  # noqa: E402
from quickdraft.verification.sampling import SamplingParams  # noqa: E402

from conftest import runner_law_after_first, tiny_lm  # noqa: E402


def _save(model, path):
    model.config._attn_implementation = "sdpa"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ov_models(tmp_path_factory, tiny_target, tiny_draft):
    """Float32 exports (no weight compression: exact comparisons) of the tiny target and draft."""
    root = tmp_path_factory.mktemp("ov")
    target_dir = export(_save(tiny_target, root / "target_hf"), root / "target_ov", "none", progress=False)
    draft_dir = export(_save(tiny_draft, root / "draft_hf"), root / "draft_ov", "none", progress=False)
    return target_dir, draft_dir


def _runner(path, name="target"):
    return OpenVINORunner(path, name, n_threads=1, kv_cache_precision="f32", inference_precision="f32")


def test_export_is_complete_and_stateful(ov_models):
    target_dir, _ = ov_models
    assert is_exported(target_dir)
    runner = _runner(target_dir)
    assert len(runner._states) == 2 * runner.model.config.num_hidden_layers


def test_the_cost_identity_names_the_export_and_the_plugin_settings(ov_models):
    """What the cost policy's cache keys on (:func:`quickdraft.backends.costs.cost_key`)."""
    target_dir, draft_dir = ov_models
    identity = _runner(target_dir).cost_identity()
    assert identity["weights"]["path"] == str(Path(target_dir).resolve()) and identity["runtime"].startswith("openvino")
    assert any(name.endswith(".bin") for name, _, _ in identity["weights"]["files"]) and identity["head"] is None
    assert identity["plugin"]["INFERENCE_NUM_THREADS"] == "1"
    assert _runner(draft_dir, "draft").cost_identity()["weights"] != identity["weights"]


def test_logits_match_torch_with_padding_rollback_and_holes(ov_models, tiny_target):
    """The same calls on both runners give the same logits: a left-padded batch prefill, a verify
    block, a per-row roll-back (holes in row 1), then another block."""
    ov_runner, torch_runner = _runner(ov_models[0]), ModelRunner(tiny_target, "target")
    g = torch.Generator().manual_seed(0)
    for runner in (ov_runner, torch_runner):
        runner.reset(2)
    tokens = torch.randint(0, 64, (2, 6), generator=g)
    valid = torch.tensor([[True] * 6, [False, False, True, True, True, True]])
    block = torch.randint(0, 64, (2, 4), generator=g)
    nxt = torch.randint(0, 64, (2, 3), generator=g)
    outs = []
    for runner in (ov_runner, torch_runner):
        a = runner.forward(tokens, valid).logits
        b = runner.forward(block, logits_to_keep=4).logits
        runner.truncate(torch.tensor([10, 6]))  # row 0 keeps its block, row 1 drops all 4 tokens
        c = runner.forward(nxt, logits_to_keep=2).logits
        outs.append((a, b, c, runner.lengths.clone()))
    # padding columns carry no meaning on either backend; compare the real tokens' logits
    assert torch.allclose(outs[0][0][valid], outs[1][0][valid], atol=1e-4)
    for x, y in zip(outs[0][1:3], outs[1][1:3]):
        assert torch.allclose(x, y, atol=1e-4), (x - y).abs().max()
    assert torch.equal(outs[0][3], outs[1][3])
    assert ov_runner.num_holes == 2  # row 1's four rolled-back slots, the batch shares L


def test_one_token_steps_equal_one_block(ov_models):
    """Decoding token by token gives the logits of one block forward (float32 KV cache): the
    backend's verification agrees with its own plain decoding."""
    runner = _runner(ov_models[0])
    ids = torch.tensor([[3, 9, 27, 4, 11, 50, 7, 2]])
    runner.reset(1)
    block = runner.forward(ids).logits  # [1, 8, V]
    runner.reset(1)
    steps = torch.cat([runner.forward(ids[:, i:i + 1]).logits for i in range(ids.shape[1])], dim=1)
    assert torch.allclose(block, steps, atol=1e-5)
    assert torch.equal(block.argmax(-1), steps.argmax(-1))


def test_compaction_keeps_the_logits(ov_models):
    runner = _runner(ov_models[0])
    runner.compact_min_holes = 1
    ids = torch.tensor([[5, 6, 7, 8]])
    runner.reset(1)
    runner.forward(ids)
    runner.forward(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    runner.truncate(torch.tensor([5]))  # 5 holes out of 10 slots: not yet more than half
    assert runner.num_slots == 10
    runner.forward(torch.tensor([[9, 9]]))
    runner.truncate(torch.tensor([5]))  # 7 holes of 12: compacts
    assert runner.num_slots == 5 and runner.num_holes == 0
    after = runner.forward(torch.tensor([[17]])).logits
    reference = _runner(ov_models[0])
    reference.reset(1)
    expect = reference.forward(torch.tensor([[5, 6, 7, 8, 1, 17]])).logits[:, -1:]
    assert torch.allclose(after, expect, atol=1e-5)


def test_rows_can_join_and_leave(ov_models):
    runner, alone = _runner(ov_models[0]), _runner(ov_models[0])
    runner.reset(1)
    runner.forward(torch.tensor([[1, 2, 3]]))
    runner.add_rows(1)
    assert runner.batch_size == 2 and runner.lengths.tolist() == [3, 0]
    out = runner.forward(torch.tensor([[4, 7], [8, 9]]), logits_to_keep=1).logits
    alone.reset(1)
    expect = alone.forward(torch.tensor([[8, 9]]), logits_to_keep=1).logits
    assert torch.allclose(out[1], expect[0], atol=1e-5)
    runner.remove_rows([0])
    assert runner.batch_size == 1 and runner.lengths.tolist() == [2]
    again = runner.forward(torch.tensor([[10]])).logits
    expect = alone.forward(torch.tensor([[10]])).logits
    assert torch.allclose(again, expect, atol=1e-5)


def test_select_rows_forks_rows_that_continue_like_their_source(ov_models):
    runner = _runner(ov_models[0])
    runner.reset(2)
    runner.forward(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    runner.truncate(torch.tensor([3, 2]))  # a hole in row 1 travels with it
    runner.select_rows([1, 1, 0])
    assert runner.batch_size == 3 and runner.lengths.tolist() == [2, 2, 3]
    out = runner.forward(torch.tensor([[9], [9], [9]]), logits_to_keep=1).logits
    for row, ids in ((0, [4, 5, 9]), (1, [4, 5, 9]), (2, [1, 2, 3, 9])):
        alone = _runner(ov_models[0])
        alone.reset(1)
        expect = alone.forward(torch.tensor([ids]), logits_to_keep=1).logits
        assert torch.allclose(out[row], expect[0], atol=1e-5)
    with pytest.raises(QuickdraftError, match="out of range"):
        runner.select_rows([3])


def test_a_sibling_has_a_cache_of_its_own_over_the_same_compiled_model(ov_models):
    runner = _runner(ov_models[0])
    runner.reset(1)
    runner.forward(torch.tensor([[1, 2, 3]]))
    twin = runner.sibling()
    assert twin.compiled is runner.compiled and twin.request is not runner.request and twin.batch_size == 0
    twin.reset(2)
    out = twin.forward(torch.tensor([[7, 8], [9, 10]]), logits_to_keep=1).logits
    assert runner.lengths.tolist() == [3]  # the source keeps its context
    after = runner.forward(torch.tensor([[4]]), logits_to_keep=1).logits
    for got, ids in ((out[0], [7, 8]), (out[1], [9, 10]), (after[0], [1, 2, 3, 4])):
        alone = _runner(ov_models[0])
        alone.reset(1)
        assert torch.allclose(got, alone.forward(torch.tensor([ids]), logits_to_keep=1).logits[0], atol=1e-5)


def test_the_server_steps_batches_of_different_settings_in_turn(ov_models, tiny_target, tiny_draft):
    """Three requests whose settings differ (greedy `sd`, seeded sampling `sd`, plain `ar`) run at once,
    each in a batch of its own over the one compiled model, and each gets the text it gets alone."""
    from quickdraft.pipeline import Pipeline
    from quickdraft.serve.scheduler import Job, Scheduler
    from quickdraft.serve.settings import ServeDefaults, build_spec

    from conftest import word_tokenizer

    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft, target_runner=_runner(ov_models[0]),
                    draft_runner=_runner(ov_models[1], "draft"))
    pipe._eos_ids = frozenset()  # no request may end at its first token on any CPU's arithmetic
    prompt, tokens = [5, 6, 7, 8], 20
    jobs = [Job([prompt], tokens, ServeDefaults(method="sd", k=3), SamplingParams()),
            Job([prompt], tokens, ServeDefaults(method="sd", k=3), SamplingParams(temperature=0.9), seed=3),
            Job([prompt], tokens, ServeDefaults(method="ar"), SamplingParams())]
    scheduler = Scheduler(pipe, max_rows=4)
    for job in jobs:
        scheduler.submit(job)
    scheduler.start()
    assert all(job.done.wait(120) for job in jobs) and scheduler.drain(60)
    assert [job.error for job in jobs] == [None] * 3
    assert [len(job.choices[0].token_ids) for job in jobs] == [tokens] * 3
    assert max(job.first_token_at for job in jobs) < min(job.finished_at for job in jobs)  # side by side
    for job in jobs:
        spec = build_spec(job.settings, job.sampling, job.seed or 0)
        alone = pipe.generate([], prompt_ids=[prompt], method=spec.engine_method, policy=spec.policy, rule=spec.rule,
                              sampling=job.sampling, max_new_tokens=tokens, seed=job.seed or 0).completions[0]
        assert job.choices[0].token_ids == alone.token_ids


def test_tree_forward_matches_the_torch_runner(ov_models, tiny_target):
    """A tree block (root -> {a, b}, a -> {c}) and a commit of the path root, a, c."""
    tokens = torch.tensor([[10, 11, 12, 13]])
    depths = torch.tensor([[0, 1, 1, 2]])
    mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    results = []
    for runner in (_runner(ov_models[0]), ModelRunner(tiny_target, "target")):
        runner.reset(1)
        runner.forward(torch.tensor([[1, 2, 3]]))
        runner.begin_tree()
        tree = runner.forward_tree(tokens, depths, mask).logits
        runner.commit_tree(torch.tensor([[0, 1, 3]]), torch.tensor([3]))
        after = runner.forward(torch.tensor([[20]])).logits
        results.append((tree, after, runner.lengths.clone()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-4)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-4)
    assert results[0][2].tolist() == results[1][2].tolist() == [7]


def test_bad_calls_give_clear_errors(ov_models, tmp_path):
    runner = _runner(ov_models[0])
    runner.reset(1)
    with pytest.raises(QuickdraftError, match="batch of 2 rows"):
        runner.forward(torch.zeros(2, 1, dtype=torch.long))
    runner.forward(torch.tensor([[1, 2]]))
    with pytest.raises(QuickdraftError, match="beyond its length"):
        runner.truncate(torch.tensor([5]))
    with pytest.raises(QuickdraftError, match="no OpenVINO export"):
        OpenVINORunner(tmp_path, "target")


def _methods(target_dir, draft_dir):
    draft = _runner(draft_dir, "draft")
    return {
        "sd": ModelDrafter(draft, 64),
        "ngram": NGramDrafter(64),
        "ngram_sd": NGramModelDrafter(NGramDrafter(64, max_ngram=4, min_ngram=2), ModelDrafter(draft, 64)),
    }


@pytest.mark.parametrize("policy", [Constant(4), Constant(1), Confidence(max_k=6, p_min=0.4)], ids=["k4", "k1", "confidence"])
def test_greedy_speculative_equals_plain_greedy(ov_models, policy):
    """Every chain method's greedy output equals the same backend's plain greedy output, token for
    token (float32 weights and KV cache), on a batch of three prompts of different lengths."""
    target = _runner(ov_models[0])
    prompts = [[1, 5, 9, 2, 7], [3, 3, 3, 8], [11, 4, 6, 1, 2, 9, 30, 31]]
    plain = generate(target, prompts, method="ar", max_new_tokens=40, seed=0).sequences
    for method, drafter in _methods(*ov_models).items():
        out = generate(target, prompts, method=method, drafter=drafter, policy=policy, max_new_tokens=40, seed=0)
        assert out.sequences == plain, method
        assert out.batch_metrics.target_forwards < 3 * 40  # it did speculate


def test_lossless_sampling_matches_the_target_distribution(ov_models):
    """Goodness of fit through the OpenVINO runners: the two tokens after the prefill's first one,
    sampled by `sd` with the lossless rule at T = 0.8, against the target's exact law of new tokens
    2 and 3 (computed from the same backend's logits); a draft-distributed sampler (the negative
    control) must fail the same test."""
    from scipy import stats

    target, draft = _runner(ov_models[0]), _runner(ov_models[1], "draft")
    sampling = SamplingParams(temperature=0.8)
    prompt = [4, 17, 9]

    def two_token_probs(runner):  # P(t2, t3) at T = 0.8, the prefill's t1 marginalised out, [V * V]
        return runner_law_after_first(runner, prompt, temperature=0.8)

    exact = two_token_probs(target)
    n = 2000
    prompts = [prompt] * 200
    counts = torch.zeros(64 * 64)
    for seed in range(n // len(prompts)):
        out = generate(target, prompts, method="sd", drafter=ModelDrafter(draft, 64), rule=Lossless(),
                       policy=Constant(3), sampling=sampling, max_new_tokens=3, seed=seed)
        for seq in out.sequences:
            counts[seq[1] * 64 + seq[2]] += 1

    def pvalue(observed, probs):
        # merge the cells whose expected count is below 5 into one
        expected = probs * n
        big = expected >= 5
        obs = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)]).numpy()
        exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)]).numpy()
        exp = exp * obs.sum() / exp.sum()
        return stats.chisquare(obs, exp).pvalue

    assert pvalue(counts, exact) > 1e-3
    wrong = two_token_probs(draft)  # the draft's distribution: what a sampler that skips verification gives
    rng = np.random.default_rng(0)
    control = torch.from_numpy(np.bincount(rng.choice(64 * 64, size=n, p=(wrong / wrong.sum()).numpy()), minlength=64 * 64)).float()
    assert pvalue(control, exact) < 1e-3


def test_fuzzy_rules_run_on_openvino(ov_models):
    """FSD and typical acceptance run through the backend; a higher FSD threshold accepts more."""
    target = _runner(ov_models[0])
    prompts = [[1, 5, 9, 2, 7], [3, 3, 3, 8]]
    lengths = []
    for threshold in (0.0, 0.5):
        out = generate(target, prompts, method="sd", drafter=ModelDrafter(_runner(ov_models[1], "draft"), 64),
                       rule=Fuzzy(divergence="tv", threshold=threshold), sampling=SamplingParams(temperature=0.7),
                       max_new_tokens=40, seed=0)
        lengths.append(out.batch_metrics.mean_acceptance_length)
    assert lengths[1] > lengths[0]
    out = generate(target, prompts, method="sd", drafter=ModelDrafter(_runner(ov_models[1], "draft"), 64),
                   rule=Typical(), sampling=SamplingParams(temperature=0.7), max_new_tokens=20, seed=0)
    assert all(len(s) == 20 for s in out.sequences)


def test_int8_export_runs_close_to_float(tmp_path, tiny_target):
    """The default int8 compression: same greedy continuation as float32 on a tiny model for the
    first tokens, logits close."""
    model = tiny_lm(seed=3, layers=2)
    hf = _save(model, tmp_path / "hf")
    f32 = _runner(export(hf, tmp_path / "f32", "none", progress=False))
    i8 = _runner(export(hf, tmp_path / "i8", "int8", progress=False))
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    f32.reset(1)
    i8.reset(1)
    a, b = f32.forward(ids).logits, i8.forward(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_int4_export_is_symmetric_and_a_stale_manifest_is_rebuilt(tmp_path):
    """``int4`` compresses symmetrically in groups of 128 and records its settings; an int4 export
    whose manifest lacks them (asymmetric int4) is not taken as exported, while an int8 one without
    the record still is."""
    import json

    import openvino as ov
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from quickdraft.backends.openvino.export import COMPRESSION, EXPORT_MANIFEST, MODEL_XML

    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).eval()  # layers 128 wide: whole groups of 128
    hf = _save(model, tmp_path / "hf")
    out = export(hf, tmp_path / "i4", "int4", progress=False)
    info = json.loads((out / EXPORT_MANIFEST).read_text())
    assert info["compression"] == COMPRESSION["int4"]
    assert (COMPRESSION["int4"]["mode"], COMPRESSION["int4"]["group_size"]) == ("int4_sym", 128)
    weight_types = {op.get_output_element_type(0).get_type_name() for op in ov.Core().read_model(out / MODEL_XML).get_ops()
                    if op.get_type_name() == "Constant"}
    assert "i4" in weight_types and "u4" not in weight_types  # symmetric: signed, no zero points
    f32 = _runner(export(hf, tmp_path / "f32", "none", progress=False))
    i4 = _runner(out)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    f32.reset(1)
    i4.reset(1)
    a, b = f32.forward(ids).logits, i4.forward(ids).logits
    assert (a - b).abs().max() < 0.25 * a.abs().max()
    assert is_exported(out)
    del info["compression"]
    (out / EXPORT_MANIFEST).write_text(json.dumps(info))
    assert not is_exported(out)
    i8 = export(hf, tmp_path / "i8", "int8", progress=False)
    info8 = json.loads((i8 / EXPORT_MANIFEST).read_text())
    del info8["compression"]
    (i8 / EXPORT_MANIFEST).write_text(json.dumps(info8))
    assert is_exported(i8)


def test_int4all_compresses_the_head_and_embedding_too(tmp_path):
    """``int4`` keeps the output head and the embedding in 8 bits (NNCF's backup), ``int4all`` puts
    them in int4 as well: no 8-bit weight is left, the settings are recorded, and the logits stay
    close to float32's. The torch backend refuses the format by name."""
    import json
    from collections import Counter

    import openvino as ov
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from quickdraft.backends.openvino.export import COMPRESSION, EXPORT_MANIFEST, MODEL_XML

    torch.manual_seed(3)
    config = Qwen2Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    hf = _save(Qwen2ForCausalLM(config).eval(), tmp_path / "hf")

    def weight_types(out):
        return Counter(op.get_output_element_type(0).get_type_name()
                       for op in ov.Core().read_model(out / MODEL_XML).get_ops() if op.get_type_name() == "Constant")

    int4, int4all = export(hf, tmp_path / "i4", "int4", progress=False), export(hf, tmp_path / "i4all", "int4all", progress=False)
    plain, every = weight_types(int4), weight_types(int4all)
    assert plain["u8"] == 4 and plain["i4"] == 14  # head and embedding: 8-bit weights and zero points
    assert every["u8"] == 0 and every["i4"] == 16
    assert json.loads((int4all / EXPORT_MANIFEST).read_text())["compression"] == COMPRESSION["int4all"]
    assert is_exported(int4all) and is_exported(int4)
    f32, i4all = _runner(export(hf, tmp_path / "f32", "none", progress=False)), _runner(int4all)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    f32.reset(1)
    i4all.reset(1)
    a, b = f32.forward(ids).logits, i4all.forward(ids).logits
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9  # the same function, coarser
    from quickdraft.pipeline import Pipeline

    with pytest.raises(QuickdraftError, match="'int4all' is a weight format of the openvino backend, not torch"):
        Pipeline.from_specs(str(hf), None, backend="torch", quantize="int4all")


def test_openvino_genai_anchor_agrees_with_our_engine(ov_models, tmp_path, tiny_target, tiny_draft):
    """OpenVINO GenAI (the benchmark's anchor) on GenAI-layout exports of the same float32 weights:
    its plain greedy output and its speculative greedy output equal our engine's plain greedy
    output on the engine-layout export."""
    pytest.importorskip("openvino_genai")
    from quickdraft.evaluation.anchors import openvino_genai_generate, openvino_genai_pipeline

    hf_t, hf_d = _save(tiny_target, tmp_path / "t"), _save(tiny_draft, tmp_path / "d")
    tok = _tokenizer_files(hf_t), _tokenizer_files(hf_d)
    assert all(tok)
    genai_t = export(hf_t, tmp_path / "gt", "none", layout="genai", progress=False)
    genai_d = export(hf_d, tmp_path / "gd", "none", layout="genai", progress=False)
    prompt = [1, 5, 9, 2, 7]
    ours = generate(_runner(ov_models[0]), [prompt], method="ar", max_new_tokens=24, seed=0).sequences[0]
    plain = openvino_genai_pipeline(genai_t, n_threads=1)
    res = openvino_genai_generate(plain, prompt, sampling=SamplingParams(), max_new_tokens=24, eos_token_ids={63})
    assert res.new_ids == ours[: len(res.new_ids)] and len(res.new_ids) >= 1
    spec = openvino_genai_pipeline(genai_t, genai_d, n_threads=1)
    res_sd = openvino_genai_generate(spec, prompt, sampling=SamplingParams(), max_new_tokens=24, eos_token_ids={63},
                                     num_assistant_tokens=4)
    assert res_sd.new_ids == res.new_ids
    # GenAI's own count of its speculative steps: K drafts a step, accepted ones among them
    assert res.speculative is None
    spec_metrics = res_sd.speculative
    assert 0 <= spec_metrics["accepted_tokens"] <= spec_metrics["drafted_tokens"]
    assert spec_metrics["drafted_tokens"] >= 4
    assert 0 < spec_metrics["target_infer_seconds"] + spec_metrics["draft_infer_seconds"] < res_sd.seconds


def test_openvino_genai_speculative_anchor_samples_call_after_call(tmp_path, tiny_target, tiny_draft):
    """GenAI's speculative decoding at T > 0, as the benchmark runs it (prompts one after another in
    one pipeline): every call returns its tokens and drafts. With GenAI's default prefix cache a
    call raises ``content_length <= prompt_ids.size() + m_generated_ids.size()`` and the pipeline
    drafts nothing afterwards; :func:`speculative_scheduler` turns the cache off."""
    pytest.importorskip("openvino_genai")
    from quickdraft.evaluation.anchors import openvino_genai_generate, openvino_genai_pipeline

    hf_t, hf_d = _save(tiny_target, tmp_path / "t"), _save(tiny_draft, tmp_path / "d")
    assert _tokenizer_files(hf_t) and _tokenizer_files(hf_d)
    genai_t = export(hf_t, tmp_path / "gt", "none", layout="genai", progress=False)
    genai_d = export(hf_d, tmp_path / "gd", "none", layout="genai", progress=False)
    spec = openvino_genai_pipeline(genai_t, genai_d, n_threads=1)
    for seed in range(12):
        prompt = [1 + seed % 5, 5, 9, 2 + seed % 3, 7]
        res = openvino_genai_generate(spec, prompt, sampling=SamplingParams(temperature=1.0), max_new_tokens=24,
                                      eos_token_ids={63}, seed=seed, num_assistant_tokens=4)
        assert len(res.new_ids) >= 1
        assert res.new_ids[-1] == 63 or res.speculative["drafted_tokens"] > 0


def test_openvino_genai_anchor_can_compile_with_our_plugin_settings(tmp_path, monkeypatch):
    """``tuned=True`` hands each GenAI model the settings our runner would compile its export with."""
    openvino_genai = pytest.importorskip("openvino_genai")
    import json

    from quickdraft.backends.openvino.export import EXPORT_MANIFEST
    from quickdraft.backends.openvino.runner import tuned_config
    from quickdraft.evaluation.anchors import openvino_genai_pipeline

    calls = []
    monkeypatch.setattr(openvino_genai, "LLMPipeline", lambda path, device, **kw: calls.append(("target", kw)) or "pipe")
    monkeypatch.setattr(openvino_genai, "draft_model", lambda path, device, **kw: calls.append(("draft", kw)) or "draft")
    manifests = {"t": {"weight_format": "int8"}, "d": {"weight_format": "int4", "compression": {"group_size": 128}}}
    for name, manifest in manifests.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / EXPORT_MANIFEST).write_text(json.dumps(manifest))
    openvino_genai_pipeline(tmp_path / "t", tmp_path / "d", n_threads=2, tuned=True)
    scheduler = calls[1][1].pop("scheduler_config")
    assert calls == [("draft", {"INFERENCE_NUM_THREADS": 2, **tuned_config(manifests["d"], drafting=True)}),
                     ("target", {"INFERENCE_NUM_THREADS": 2, **tuned_config(manifests["t"]), "draft_model": "draft"})]
    # GenAI's latency-oriented scheduler, its prefix cache off (with it on, sampling raises:
    # test_openvino_genai_speculative_anchor_samples_call_after_call)
    assert not scheduler.enable_prefix_caching and scheduler.max_num_batched_tokens == 2**64 - 1
    assert calls[1][1]["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 256 and "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in calls[0][1]
    calls.clear()
    openvino_genai_pipeline(tmp_path / "t", n_threads=2)
    assert calls == [("target", {"INFERENCE_NUM_THREADS": 2})]


def _tokenizer_files(hf_dir):
    """Give a tiny model directory the word-level tokenizer of the tests (GenAI loads one)."""
    from conftest import word_tokenizer

    word_tokenizer().save_pretrained(hf_dir)
    return (hf_dir / "tokenizer.json").is_file()


def test_torch_yields_the_cores_to_openvino():
    """The openvino backend runs torch on one thread and gives OpenVINO torch's thread count; a
    llama.cpp model loaded afterwards in the same process gets that count too, not torch's one."""
    from quickdraft.backends import threads

    before, saved = torch.get_num_threads(), threads._TORCH_THREADS
    try:
        threads._TORCH_THREADS = None
        torch.set_num_threads(2)
        assert threads.runtime_threads() == 2
        assert threads.yield_torch_threads() == 2
        assert torch.get_num_threads() == 1
        assert threads.yield_torch_threads() == 2  # the first count, not the current one
        assert threads.runtime_threads() == 2
    finally:
        threads._TORCH_THREADS = saved
        torch.set_num_threads(before)


def test_pipeline_from_specs_on_openvino_equals_torch(tmp_path):
    """``Pipeline.from_specs(..., backend="openvino")`` exports Hugging Face directories once and
    decodes them: float32 exports give the torch pipeline's greedy tokens, for ar and sd."""
    from conftest import perturbed_copy
    from quickdraft.pipeline import Pipeline

    before = torch.get_num_threads()
    target = tiny_lm(seed=4, vocab=72)  # room for the ids the saved word tokenizer adds
    hf_t, hf_d = _save(target, tmp_path / "t"), _save(perturbed_copy(target, 0.3, seed=5), tmp_path / "d")
    for d in (hf_t, hf_d):
        _tokenizer_files(d)
    try:
        ov_pipe = Pipeline.from_specs(str(hf_t), str(hf_d), backend="openvino", quantize="none")
        assert is_exported(hf_t / "openvino-none") and is_exported(hf_d / "openvino-none")
        torch_pipe = Pipeline.from_specs(str(hf_t), str(hf_d), dtype="float32")
        for method in ("ar", "sd"):
            kw = dict(prompt_ids=[[1, 5, 9, 2, 7], [3, 4]], method=method, max_new_tokens=16, policy=Constant(3))
            a = ov_pipe.generate(["", ""], **kw).completions
            b = torch_pipe.generate(["", ""], **kw).completions
            assert [c.token_ids for c in a] == [c.token_ids for c in b]
    finally:
        torch.set_num_threads(before)


def test_openvino_draft_preset_is_int4_with_a_vocabulary_head(tmp_path, monkeypatch):
    """With nothing said of the weights, the openvino backend's draft is int4 with a head over
    OPENVINO_DRAFT_VOCAB ids (where the vocabulary is larger) beside an int8 target; greedy output
    is the target's all the same. An explicit --quantize applies to both models, --draft-vocab 0
    keeps the full head, and a small vocabulary keeps its full head under the preset."""
    from conftest import perturbed_copy
    from quickdraft import pipeline as pipeline_module
    from quickdraft.pipeline import Pipeline

    monkeypatch.setattr(pipeline_module, "OPENVINO_DRAFT_VOCAB", 48)  # the tiny vocabulary has 72 ids
    before = torch.get_num_threads()
    target = tiny_lm(seed=4, vocab=72)
    hf_t, hf_d = _save(target, tmp_path / "t"), _save(perturbed_copy(target, 0.3, seed=5), tmp_path / "d")
    for d in (hf_t, hf_d):
        _tokenizer_files(d)
    try:
        preset = Pipeline.from_specs(str(hf_t), str(hf_d), backend="openvino")
        assert preset.target.path.name == "openvino-int8"
        assert preset.draft.path.name == "openvino-int4-vocab48"
        assert preset.draft.head_ids is not None and preset.draft.head_ids.numel() >= 48
        kw = dict(prompt_ids=[[1, 5, 9, 2, 7]], max_new_tokens=12, policy=Constant(3))
        plain = preset.generate([""], method="ar", **kw).completions[0].token_ids
        assert preset.generate([""], method="sd", **kw).completions[0].token_ids == plain
        full = Pipeline.from_specs(str(hf_t), str(hf_d), backend="openvino", draft_vocab=0)
        assert full.draft.path.name == "openvino-int4" and full.draft.head_ids is None
        both = Pipeline.from_specs(str(hf_t), str(hf_d), backend="openvino", quantize="int8")
        assert both.draft.path.name == "openvino-int8"
        monkeypatch.setattr(pipeline_module, "OPENVINO_DRAFT_VOCAB", 1000)  # more ids than the vocabulary
        small = Pipeline.from_specs(str(hf_t), str(hf_d), backend="openvino")
        assert small.draft.path.name == "openvino-int4" and small.draft.head_ids is None
        with pytest.raises(QuickdraftError, match="draft_vocab"):
            Pipeline.from_specs(str(hf_t), str(hf_d), backend="openvino", draft_vocab=-1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_real_pair_greedy_speculative_equals_plain_on_openvino_exact():
    """The default pair's int8 exports with batch-invariant arithmetic (``exact``): every lossless
    chain method's greedy output equals the same backend's plain greedy output, token for token,
    over 128 tokens on HumanEval and MT-Bench prompts (prose, where close tokens are common)."""
    from quickdraft.evaluation.datasets import load_dataset
    from quickdraft.pipeline import Pipeline

    before = torch.get_num_threads()
    try:
        pipe = Pipeline.from_specs("target", "draft", backend="openvino", exact=True)
        problems = load_dataset("humaneval", 2) + load_dataset("mtbench", 3)
        prompts = [pipe.encode_messages(p.messages) for p in problems]
        kw = dict(max_new_tokens=128, policy=Constant(4))
        plain = [pipe.generate([""], prompt_ids=[ids], method="ar", **kw).completions[0] for ids in prompts]
        assert all(len(c.token_ids) >= 32 for c in plain)
        for method in ("sd", "ngram", "ngram_sd"):
            for row, ids in enumerate(prompts):
                out = pipe.generate([""], prompt_ids=[ids], method=method, **kw).completions[0]
                assert out.token_ids == plain[row].token_ids, (method, problems[row].id)
    finally:
        torch.set_num_threads(before)


def test_tuned_plugin_settings_follow_the_weight_format(monkeypatch):
    """int4 quantises activations in the weights' groups (a drafting model keeps the plugin's), int8
    in groups of 256; both get a float16
    KV cache and, without AMX, float32 activations; uncompressed weights keep the plugin's defaults;
    explicit precisions and ``exact`` override the tuned settings in that order."""
    from quickdraft.backends.openvino import runner as ov_runner
    import quickdraft.models

    monkeypatch.setattr(quickdraft.models, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    int4 = ov_runner.tuned_config({"weight_format": "int4", "compression": {"mode": "int4_sym", "group_size": 64}})
    assert int4 == {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 64, "KV_CACHE_PRECISION": "f16", "INFERENCE_PRECISION_HINT": "f32"}
    drafting = ov_runner.tuned_config({"weight_format": "int4", "compression": {"group_size": 64}}, drafting=True)
    assert drafting == {"KV_CACHE_PRECISION": "f16", "INFERENCE_PRECISION_HINT": "f32"}
    int8 = ov_runner.tuned_config({"weight_format": "int8", "compression": {"mode": "int8_asym", "group_size": -1}})
    assert int8["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == ov_runner.INT8_ACTIVATION_GROUP == 256
    row = ov_runner.tuned_config({"weight_format": "int4", "compression": {"group_size": -1}})
    assert row["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 256
    assert ov_runner.tuned_config({"weight_format": "none"}) == {} and ov_runner.tuned_config({}) == {}
    monkeypatch.setattr(quickdraft.models, "cpu_flags", lambda: frozenset({"avx512f", "amx_bf16", "amx_tile"}))
    assert "INFERENCE_PRECISION_HINT" not in ov_runner.tuned_config({"weight_format": "int8"})

    config = ov_runner.compile_config(2, kv_cache_precision="u8", tuned=int4)
    assert config["KV_CACHE_PRECISION"] == "u8" and config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 64
    exact = ov_runner.compile_config(2, tuned=int4, exact=True)
    assert exact["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 0 and exact["KV_CACHE_PRECISION"] == "f32"
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in ov_runner.compile_config(2)


def test_runner_compiles_an_int8_export_with_the_tuned_settings(tmp_path):
    """The plugin reports the settings the runner asked for, and ``tuned=False`` leaves its own."""
    hf = _save(tiny_lm(seed=3, layers=2), tmp_path / "hf")
    path = export(hf, tmp_path / "i8", "int8", progress=False)
    tuned = OpenVINORunner(path, "target", n_threads=1)
    assert tuned.plugin_config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == 256
    assert int(tuned.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == 256
    assert str(tuned.compiled.get_property("KV_CACHE_PRECISION")) in ("f16", "<Type: 'float16'>")
    plain = OpenVINORunner(path, "target", n_threads=1, tuned=False)
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in plain.plugin_config
    assert int(plain.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) != 256
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    tuned.reset(1)
    plain.reset(1)
    a, b = tuned.forward(ids).logits, plain.forward(ids).logits
    assert (a - b).abs().max() < 0.05 * a.abs().max()


def test_plugin_defaults_is_an_openvino_setting():
    from quickdraft.pipeline import Pipeline

    with pytest.raises(QuickdraftError, match="plugin defaults apply to the openvino backend"):
        Pipeline.from_specs("target", "draft", backend="torch", plugin_defaults=True)


def test_exact_is_an_openvino_setting():
    from quickdraft.pipeline import Pipeline

    with pytest.raises(QuickdraftError, match="exact applies to the openvino and llamacpp backends"):
        Pipeline.from_specs("target", "draft", backend="torch", exact=True)


def test_export_records_the_fingerprint_an_acceptance_head_checks(ov_models, tiny_draft):
    """The export's manifest carries the weights' fingerprint, so a SpecDec++ head trained on
    another draft is refused on the openvino backend as on torch."""
    from quickdraft.decoding.head import AcceptanceHead, HeadMetadata, model_fingerprint

    runner = _runner(ov_models[1], "draft")
    assert runner.model.fingerprint == model_fingerprint(tiny_draft)
    hidden = tiny_draft.config.hidden_size
    AcceptanceHead(hidden, 1, HeadMetadata(draft="d", draft_fingerprint=model_fingerprint(tiny_draft))).check_draft(runner.model)
    alien = AcceptanceHead(hidden, 1, HeadMetadata(draft="other", draft_fingerprint=model_fingerprint(tiny_lm(seed=9))))
    with pytest.raises(QuickdraftError, match="acceptance head mismatch"):
        alien.check_draft(runner.model)


def _resident_kb_of(files):
    """Resident kB of this process's mappings of ``files`` (``/proc/self/smaps``)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                current = head[5] if len(head) >= 6 else None
            elif head[0] == "Rss:" and current in files:
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_released_weight_pages_leave_the_process_and_the_logits_alone(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # big enough (4.2 M weights, int8) that the matrices dominate the file
    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    path = export(_save(Qwen2ForCausalLM(config).eval(), tmp_path / "hf"), tmp_path / "ov", "int8", progress=False)
    tokens = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    kept = OpenVINORunner(path, "target", n_threads=1, release_weights=False)
    kept.reset(1)
    ref = kept.forward(tokens).logits
    files = set(kept.weight_pages.files)
    kept_kb = _resident_kb_of(files)
    file_kb = sum(os.path.getsize(f) for f in files) // 1024
    assert files and kept_kb > file_kb // 2, (kept_kb, file_kb)  # control: the file stays resident
    del kept
    released = OpenVINORunner(path, "target", n_threads=1)  # release_weights is the default
    assert released.num_forwards == 0 and released.infer_seconds == 0.0  # the warm-up is not counted
    assert _resident_kb_of(files) == 0
    released.reset(1)
    torch.testing.assert_close(released.forward(tokens).logits, ref, rtol=0, atol=0)
    assert torch.isfinite(released.forward(torch.tensor([[7, 7, 7, 7, 7]])).logits).all()
    # with AVX-512 the matrices are read from the plugin's copy: only what it reads in place (such as
    # the embedding rows of the tokens seen) comes back from the file. Without it (AVX2) the plugin
    # reads this small model's matrices in place, so their pages come back on the first forward (the
    # default pair's come back for 0.2 GB of 2.1: docs/openvino.md, Memory)
    from quickdraft.models import cpu_flags

    if "avx512f" in cpu_flags():
        assert _resident_kb_of(files) < kept_kb // 4, (_resident_kb_of(files), kept_kb, file_kb)
