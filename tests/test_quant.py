"""Weight-only int8 / int4 layers: the kernels compute x·Ŵᵀ, quantize_model swaps every linear layer,
and on a quantised model speculative decoding stays exact (greedy) and lossless (sampling) with
respect to the *quantised* model's own distributions."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Constant
from quickdraft.backends.quant import Int4Linear, Int8Linear, quantize_by_name, quantize_model
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams

VOCAB = 256


pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[3, 17, 42, 99], [5, 8], [200, 1, 2, 3, 4, 5]]


def small_lm(seed: int, dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """A random Qwen2 whose widths (128, 256) the int4 kernel accepts."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # sharper next-token distributions: drafts get accepted
    return model.to(dtype)


def draft_of(target: Qwen2ForCausalLM, seed: int, scale: float = 0.3) -> Qwen2ForCausalLM:
    draft = small_lm(seed, next(target.parameters()).dtype)
    draft.load_state_dict(target.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_((torch.randn(p.shape, generator=gen) * scale * p.float().std()).to(p.dtype))
    return draft


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_layer_computes_x_times_dequantized_weight(cls, dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96).to(dtype)
    q = cls.from_linear(linear)
    w_hat = q.dequantized()  # [N, K]
    # the quantisation error is what the scheme allows: |W - Ŵ| <= s/2 per entry
    err = (linear.weight.float() - w_hat).abs()
    step = linear.weight.float().abs().amax(1, keepdim=True) / 127 if cls is Int8Linear else None
    if step is not None:  # rounding to the grid, plus the scale's own rounding when stored in bf16
        scale_rounding = 1e-6 if dtype == torch.float32 else 127 * 2.0**-8
        assert bool((err <= step * (0.5 + scale_rounding) + 1e-7).all())
    else:
        assert float(err.max()) < float(linear.weight.float().abs().max()) / 15 + 1e-3
    for m in (1, 3, 8):
        x = torch.randn(2, m, 256).to(dtype)  # [B, m, K]
        expected = x.float() @ w_hat.T + linear.bias.float()
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        got = q(x)
        assert got.shape == (2, m, 96) and got.dtype == dtype
        assert float((got.float() - expected).abs().max()) < tol * float(expected.abs().max())


def test_quantize_model_swaps_every_linear_and_shrinks_the_weights():
    model = small_lm(0)
    reference = small_lm(0)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        ref_logits = reference(ids).logits
    report8 = quantize_model(model, 8)
    assert not [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(report8.quantized) == 2 * 7 + 1 and "lm_head" in report8.quantized
    assert 0.24 < report8.bytes_after / report8.bytes_before < 0.27  # fp32 -> int8 + scales
    with torch.no_grad():
        logits8 = model(ids).logits
    cos = torch.nn.functional.cosine_similarity(logits8.flatten(), ref_logits.flatten(), dim=0)
    assert float(cos) > 0.999

    model4 = small_lm(0)
    report4 = quantize_model(model4, 4, group_size=32)
    assert len(report4.quantized) == 15 and not report4.skipped
    assert 0.18 < report4.bytes_after / report4.bytes_before < 0.2  # (0.5 B + 2 fp32 / 32) per 4-B weight
    with torch.no_grad():
        logits4 = model4(ids).logits
    cos4 = torch.nn.functional.cosine_similarity(logits4.flatten(), ref_logits.flatten(), dim=0)
    assert 0.95 < float(cos4) < float(cos)  # int4 is coarser than int8, yet close


def test_bad_arguments_raise_quickdraft_errors():
    with pytest.raises(QuickdraftError, match="bits"):
        quantize_model(small_lm(0), 3)
    with pytest.raises(QuickdraftError, match="group_size"):
        quantize_model(small_lm(0), 4, group_size=48)
    with pytest.raises(QuickdraftError, match="unknown quantization"):
        quantize_by_name(small_lm(0), "int2")
    with pytest.raises(QuickdraftError, match="in_features"):
        Int4Linear.from_linear(torch.nn.Linear(96, 32), 32)
    assert quantize_by_name(small_lm(0), "none") is None


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("k", [2, 5])
def test_greedy_speculative_equals_plain_greedy_on_the_quantized_model(scheme, k):
    target, draft = small_lm(0), None
    draft = draft_of(target, seed=1)
    quantize_by_name(target, scheme, group_size=64)
    quantize_by_name(draft, scheme, group_size=64)
    runner = ModelRunner(target, "target")
    drafter = ModelDrafter(ModelRunner(draft, "draft"), VOCAB)
    plain = generate(runner, PROMPTS, method="ar", max_new_tokens=24)
    spec = generate(runner, PROMPTS, method="sd", drafter=drafter, policy=Constant(k), max_new_tokens=24)
    assert spec.sequences == plain.sequences
    assert spec.batch_metrics.accepted_tokens > 0
    assert spec.batch_metrics.target_forwards < plain.batch_metrics.target_forwards


def _chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of ``samples`` against ``probs`` (cells with expected count < 5 pooled)."""
    counts = np.bincount(samples, minlength=probs.shape[0]).astype(float)
    expected = probs * len(samples)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    exp *= obs.sum() / exp.sum()
    return float(scipy.stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_speculative_sampling_on_the_quantized_model_matches_its_distribution(scheme):
    """The first two tokens of 1200 seeded runs (one batch; the prefill's, then a speculative step's
    with one draft token, three tokens to generate) follow the quantised target's exact
    distributions; against the draft's (a negative control) the same test must fail."""
    target = small_lm(0)
    draft = draft_of(target, seed=1, scale=0.6)
    quantize_by_name(target, scheme, group_size=64)
    quantize_by_name(draft, scheme, group_size=64)
    prompt, rows = [3, 17, 42], 1200
    out = generate(
        ModelRunner(target, "target"), [prompt] * rows, method="sd", drafter=ModelDrafter(ModelRunner(draft), VOCAB),
        policy=Constant(3), sampling=SamplingParams(temperature=1.0), max_new_tokens=3, seed=7,
    )
    tokens = np.array([s[:2] for s in out.sequences])  # [rows, 2]
    with torch.no_grad():
        first_t = target(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)  # [V]
        first_d = draft(torch.tensor([prompt])).logits[0, -1].float().softmax(-1)
        # marginal of the second token: sum over x1 of p(x1) p(x2 | x1), one batched forward over all x1
        both = torch.cat([torch.tensor([prompt]).expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
        second_t = first_t @ target(both).logits[:, -1].float().softmax(-1)  # [V]
        second_d = first_d @ draft(both).logits[:, -1].float().softmax(-1)
    assert _chi2_pvalue(tokens[:, 0], first_t.double().numpy()) > 1e-3
    assert _chi2_pvalue(tokens[:, 1], second_t.double().numpy()) > 1e-3
    # negative control: the draft's distributions are rejected by the same test and sample
    assert _chi2_pvalue(tokens[:, 0], first_d.double().numpy()) < 1e-3
    assert _chi2_pvalue(tokens[:, 1], second_d.double().numpy()) < 1e-3
    assert out.batch_metrics.accepted_tokens > 0


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantizing_only_the_draft_keeps_greedy_output_equal_to_the_full_precision_target(scheme):
    """The fast configuration (bf16/fp32 target, quantised draft): the target is untouched, so greedy
    speculative output equals the unquantised target's plain greedy output token for token."""
    target = small_lm(0)
    draft = draft_of(target, seed=1, scale=0.05)
    report = quantize_by_name(draft, scheme, group_size=64)
    assert report is not None and not any(isinstance(m, (Int4Linear, Int8Linear)) for m in target.modules())
    runner = ModelRunner(target, "target")
    plain = generate(runner, PROMPTS, method="ar", max_new_tokens=24)
    spec = generate(runner, PROMPTS, method="sd", drafter=ModelDrafter(ModelRunner(draft, "draft"), VOCAB),
                    policy=Constant(4), max_new_tokens=24)
    assert spec.sequences == plain.sequences
    assert spec.batch_metrics.accepted_tokens > 0


def test_pipeline_rejects_an_unknown_draft_quantization():
    from quickdraft.pipeline import Pipeline

    with pytest.raises(QuickdraftError, match="quantize_draft"):
        Pipeline.from_specs("target", "draft", quantize_draft="int3")
