"""The AVX2 weight-only int8 kernel: it computes (x Wᵀ)·s + b, every output element is the same
whatever the number of rows in the call, Int8Linear uses it for float32, and bad input is named."""

import pytest
import torch

from quickdraft.backends import int8kernel
from quickdraft.errors import QuickdraftError
from quickdraft.backends.quant import Int8Linear

pytestmark = pytest.mark.skipif(not int8kernel.available(), reason="needs an AVX2 CPU and a C++ compiler")


def _operands(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.02 + 1e-3
    b = torch.randn(n, generator=g)
    return x, w, s, b


def _run(x, w, s, b):
    rows = -(-w.shape[0] // int8kernel.PANEL) * int8kernel.PANEL
    bias = None if b is None else int8kernel.pad_rows(b, rows)
    return int8kernel.int8_linear(x, int8kernel.pack_weight(w), int8kernel.pad_rows(s, rows), bias, w.shape[0])


def test_pack_and_unpack_are_inverse():
    _, w, _, _ = _operands(1, 70, 24)
    packed = int8kernel.pack_weight(w)
    assert packed.shape == (2, 24, 64)
    assert int(packed[1, 5, 3]) == int(w[67, 5]) and not packed[1, :, 6:].any()  # rows past 70 are zero
    assert torch.equal(int8kernel.unpack_weight(packed, 70), w)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 12, 13, 25, 48, 49, 130])
@pytest.mark.parametrize("n,k", [(1, 8), (13, 200), (64, 300), (130, 515)])
def test_matches_a_float64_reference(m, n, k):
    x, w, s, b = _operands(m, n, k)
    ref = (x.double() @ w.double().T) * s.double()
    for bias in (b, None):
        y = _run(x, w, s, bias)
        expect = ref + b.double() if bias is not None else ref
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-4)


def test_each_row_is_bitwise_independent_of_the_rows_beside_it():
    """A verification over M tokens must give exactly the outputs of M one-token forwards: the
    kernel's arithmetic for one (row, output) pair may not depend on M: 1..24 rows (one pass, every
    register blocking), more (several passes), and K not a multiple of the k tile."""
    x, w, s, b = _operands(100, 200, 1541, seed=3)
    alone = torch.cat([_run(x[i : i + 1], w, s, b) for i in range(100)])
    for m in list(range(1, 30)) + [47, 48, 49, 50, 73, 100]:
        assert torch.equal(_run(x[:m], w, s, b), alone[:m]), m
    # not trivially so: summing in another order (float64, then rounded) differs somewhere
    other = ((x.double() @ w.double().T) * s.double() + b.double()).float()
    assert not torch.equal(other, alone)


def test_int8_linear_layer_runs_the_kernel_for_float32():
    layer = torch.nn.Linear(96, 40)
    q = Int8Linear.from_linear(layer)
    assert q.kernel and q.weight.shape == (1, 96, 64)
    x = torch.randn(2, 3, 96)
    y = q(x)
    ref = x @ q.dequantized().T + layer.bias.detach()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert y.shape == (2, 3, 40)
    # the same codes on torch's kernel (bf16 layers keep the [N, K] layout) agree
    q16 = Int8Linear.from_linear(torch.nn.Linear(96, 40).to(torch.bfloat16))
    assert not q16.kernel and q16.weight.shape == (40, 96)


def test_bad_input_is_named():
    x, w, s, b = _operands(2, 64, 64)
    packed = int8kernel.pack_weight(w)
    with pytest.raises(QuickdraftError, match="float32 x"):
        int8kernel.int8_linear(x.double(), packed, s, b)
    with pytest.raises(QuickdraftError, match=r"x \[M, K\]"):
        int8kernel.int8_linear(x[:, :32], packed, s, b)
    with pytest.raises(QuickdraftError, match=r"shape \[64\]"):
        int8kernel.int8_linear(x, packed, s[:4], b)
    with pytest.raises(QuickdraftError, match="int8"):
        int8kernel.pack_weight(w.float())


def test_a_prefill_equals_its_rows_one_by_one_in_the_layer():
    """Prefill (many rows, several passes) and the one-token steps after it compute the same
    function: the layer's output for a row does not depend on how many rows came with it."""
    layer = torch.nn.Linear(200, 130)
    q = Int8Linear.from_linear(layer)
    x = torch.randn(60, 200)
    ref = x.double() @ q.dequantized().double().T + layer.bias.detach().double()
    y = q(x)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(y, torch.cat([q(x[i : i + 1]) for i in range(60)]))
