"""The AVX2 weight-only int8 kernel: it computes (x Wᵀ)·s + b, every output element is the same
whatever the number of rows in the call, Int8Linear uses it for float32, and bad input is named."""

import pytest
import torch

from quickdraft import int8kernel
from quickdraft.errors import QuickdraftError
from quickdraft.quant import Int8Linear

pytestmark = pytest.mark.skipif(not int8kernel.available(), reason="needs an AVX2 CPU and a C++ compiler")


def _operands(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.02 + 1e-3
    b = torch.randn(n, generator=g)
    return x, w, s, b


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 12, 13, 25])
@pytest.mark.parametrize("n", [1, 13, 64])
def test_matches_a_float64_reference(m, n):
    x, w, s, b = _operands(m, n, 200)
    ref = (x.double() @ w.double().T) * s.double() + b.double()
    for bias in (b, None):
        y = int8kernel.int8_linear(x, w, s, bias)
        expect = ref if bias is not None else ref - b.double()
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), expect, rtol=1e-5, atol=1e-4)


def test_each_row_is_bitwise_independent_of_the_rows_beside_it():
    """A verification over M tokens must give exactly the logits of M one-token forwards: the
    kernel's arithmetic for one (row, output) pair may not depend on M (1..25, across passes)."""
    x, w, s, b = _operands(25, 37, 1536, seed=3)
    alone = torch.cat([int8kernel.int8_linear(x[i : i + 1], w, s, b) for i in range(25)])
    for m in range(1, 26):
        assert torch.equal(int8kernel.int8_linear(x[:m], w, s, b), alone[:m]), m
    # not trivially so: summing in another order (float64 then rounded) differs in some element
    other = ((x.double() @ w.double().T) * s.double() + b.double()).float()
    assert not torch.equal(other, alone)


def test_int8_linear_layer_runs_the_kernel_for_float32():
    layer = torch.nn.Linear(96, 40)
    q = Int8Linear.from_linear(layer)
    x = torch.randn(2, 3, 96)
    assert q.uses_kernel(x) and not q.uses_kernel(x.bfloat16())
    y = q(x)
    ref = x @ q.dequantized().T + layer.bias.detach()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    assert y.shape == (2, 3, 40)
    # a shape the kernel does not take falls back to torch's op with the same result
    odd = Int8Linear.from_linear(torch.nn.Linear(12, 5))
    xo = torch.randn(4, 12)
    assert not odd.uses_kernel(xo)
    torch.testing.assert_close(odd(xo), xo @ odd.dequantized().T + odd.bias, rtol=1e-5, atol=1e-5)


def test_bad_input_is_named():
    x, w, s, b = _operands(2, 8, 64)
    with pytest.raises(QuickdraftError, match="float32 x"):
        int8kernel.int8_linear(x.double(), w, s, b)
    with pytest.raises(QuickdraftError, match=r"x \[M, K\]"):
        int8kernel.int8_linear(x[:, :32], w, s, b)
    with pytest.raises(QuickdraftError, match="divisible by 8"):
        int8kernel.int8_linear(x[:, :60].contiguous(), w[:, :60].contiguous(), s, b)
    with pytest.raises(QuickdraftError, match="shape"):
        int8kernel.int8_linear(x, w, s[:4], b)
