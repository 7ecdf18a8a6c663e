"""oneDNN packed fp32 linear layers: the same products as nn.Linear to rounding, every linear of a
model swapped (tied heads included), and on a packed model speculative decoding stays exact
(greedy) with respect to the packed model."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from conftest import perturbed_copy, tiny_lm
from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.models import _logits_dim
from quickdraft.backends.packed import PackedLinear, maybe_pack, pack_linears, packing_available
from quickdraft.decoding.policies import Constant
from quickdraft.backends.runner import ModelRunner

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN"),
]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 64), (5, 64), (2, 9, 64), (1, 1, 64)])
def test_packed_layer_computes_the_same_product(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias)
    packed = PackedLinear.from_linear(linear)
    x = torch.randn(*shape)
    got, want = packed(x), linear(x)
    assert got.shape == want.shape == (*shape[:-1], 96)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # a perturbed weight gives a different product: the packed layer really holds this weight
    other = torch.nn.Linear(64, 96, bias=bias)
    assert not torch.allclose(PackedLinear.from_linear(other)(x), want, atol=1e-3)


def test_pack_linears_swaps_every_linear_and_keeps_the_logits():
    model = tiny_lm(seed=3)
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        before = model(x).logits
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    report = pack_linears(model)
    assert len(report.packed) == n_linear > 0 and not report.skipped
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert _logits_dim(model) == model.config.vocab_size
    with torch.no_grad():
        after = model(x).logits
    assert torch.allclose(after, before, atol=1e-4, rtol=1e-4)


def test_a_tied_head_is_packed_and_the_embedding_still_looks_up_rows():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        before = model(x).logits
    pack_linears(model)
    assert isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.shape == (64, 32)
    with torch.no_grad():
        assert torch.allclose(model(x).logits, before, atol=1e-5, rtol=1e-5)


def test_bf16_layers_are_left_alone_and_bad_inputs_raise():
    model = tiny_lm(seed=4).to(torch.bfloat16)
    report = pack_linears(model)
    assert not report.packed and report.skipped
    assert maybe_pack(tiny_lm(seed=4).to(torch.bfloat16)) is None  # auto: not fp32, nothing to do
    assert maybe_pack(tiny_lm(seed=4), pack=False) is None
    with pytest.raises(QuickdraftError, match="fp32"):
        PackedLinear.from_linear(torch.nn.Linear(8, 8).to(torch.bfloat16))
    layer = PackedLinear.from_linear(torch.nn.Linear(8, 8))
    with pytest.raises(QuickdraftError, match="fp32"):
        layer(torch.randn(2, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("k", [1, 4, 7])
def test_greedy_speculative_equals_plain_greedy_on_the_packed_model(tiny_target, k):
    target = tiny_lm(seed=0)
    target.load_state_dict(tiny_target.state_dict())
    draft = perturbed_copy(target, scale=0.3, seed=1)
    pack_linears(target), pack_linears(draft)
    runner = ModelRunner(target, "target")
    drafter = ModelDrafter(ModelRunner(draft, "draft"), target.config.vocab_size)
    plain = generate(runner, PROMPTS, method="ar", max_new_tokens=24)
    spec = generate(runner, PROMPTS, method="sd", drafter=drafter, policy=Constant(k), max_new_tokens=24)
    assert spec.sequences == plain.sequences
    assert spec.batch_metrics.accepted_tokens > 0
    assert spec.batch_metrics.target_forwards < plain.batch_metrics.target_forwards


def test_dense_weights_read_back_bit_for_bit_and_state_dicts_load_into_plain_layers():
    """A packed layer gives back the very weight it was made from (in blocks of rows, of any size),
    and a packed module's dense state dict loads into an unpacked copy with the same logits — how a
    feature drafter starts as a copy of a packed target's last layer."""
    from quickdraft.backends.packed import dense_state_dict

    torch.manual_seed(0)
    linear = torch.nn.Linear(300, 70)
    packed = PackedLinear.from_linear(linear)
    for rows in (1024, 128, 7):
        assert torch.equal(packed.dense_weight(rows=rows), linear.weight)
    model, fresh = tiny_lm(seed=3), tiny_lm(seed=4)
    x = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want = model(x).logits
    pack_linears(model)
    state = dense_state_dict(model)
    assert not any(k.endswith("packed_weight") for k in state)
    assert state.keys() == fresh.state_dict().keys()
    fresh.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, want)
