"""A weight-only int8 matrix kernel for decoding on AVX2 CPUs, compiled on first use.

Torch's own weight-only int8 kernel (``aten._weight_int8pack_mm``) converts the weights again for
every row of activations, so on a CPU without AVX-512 it costs 2.6× a float32 matmul for one row
and 13× for five (``benchmarks/results/linear_kernels.json``): speculative verification becomes
compute-bound. ``csrc/int8_linear.cpp`` converts each block of eight weights once and multiplies
it into every row (up to 12 per pass), so a verification over a few tokens reads a quarter of the
float32 bytes and costs about what one token costs. Each output element is computed by the same
operations whatever the number of rows, so speculative verification is bit-for-bit consistent
with one-token decoding.

The extension is built with ``torch.utils.cpp_extension`` (needs a C++ compiler and ``ninja``) the
first time :func:`load` is called, and cached by torch under ``~/.cache/torch_extensions``.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from quickdraft.errors import QuickdraftError

SOURCE = Path(__file__).parent / "csrc" / "int8_linear.cpp"
#: capabilities (``torch.backends.cpu.get_cpu_capability()``) the kernel runs on
_CAPABLE = ("AVX2", "AVX512", "AVX512_BF16", "AMX")


def cpu_supported() -> bool:
    """Whether this CPU has the AVX2 + FMA instructions the kernel is compiled for."""
    return torch.backends.cpu.get_cpu_capability() in _CAPABLE


@functools.cache
def load() -> ModuleType:
    """Compile (once per machine) and import the extension.

    Raises
    ------
    QuickdraftError
        On a CPU without AVX2, or when the build fails (no compiler, no ``ninja``).
    """
    if not cpu_supported():
        raise QuickdraftError(
            f"the int8 kernel needs AVX2 + FMA; this CPU reports {torch.backends.cpu.get_cpu_capability()}"
        )
    from torch.utils import cpp_extension

    try:
        return cpp_extension.load(
            name="quickdraft_int8_linear",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # compiler or ninja missing, build error
        raise QuickdraftError(f"could not build the int8 kernel ({SOURCE.name}): {exc}") from exc


@functools.cache
def available() -> bool:
    """Whether :func:`int8_linear` can run here (CPU capable and the extension builds)."""
    try:
        load()
    except QuickdraftError:
        return False
    return True


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(x Wᵀ) · scales + bias`` for float32 ``x [M, K]``, int8 ``weight [N, K]``, float32 ``scales [N]``.

    Any ``M`` works; rows are served in passes of at most 12 over the weights, so the kernel is
    meant for decoding and verification (a few rows). ``K`` must be a multiple of 8.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise QuickdraftError(f"int8_linear needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != torch.float32 or weight.dtype != torch.int8 or scales.dtype != torch.float32:
        raise QuickdraftError(
            f"int8_linear needs float32 x, int8 weight and float32 scales; got {x.dtype}, {weight.dtype}, {scales.dtype}"
        )
    if weight.shape[1] % 8:
        raise QuickdraftError(f"int8_linear needs in_features divisible by 8, got {weight.shape[1]}")
    if scales.shape != (weight.shape[0],) or (bias is not None and bias.shape != (weight.shape[0],)):
        raise QuickdraftError(f"int8_linear needs scales (and bias) of shape [{weight.shape[0]}]")
    return load().int8_linear(x, weight, scales, bias)
