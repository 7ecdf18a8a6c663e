"""A weight-only int8 matrix kernel for decoding on AVX2 CPUs, compiled on first use.

Torch's own weight-only int8 kernel (``aten._weight_int8pack_mm``) converts the weights again for
every row of activations; on this AVX2 CPU it costs 2.2× a packed float32 matmul for one row and
11× for five (``benchmarks/results/linear_kernels.json``). ``csrc/int8_linear.cpp`` stores the
weight in 64-row panels read as one stream, converts each block of eight weights once, in
registers, for a block of up to 6 rows, and prefetches the panel's next tile: one row streams the
int8 weight at about the machine's bandwidth, five rows cost about twice one row (the conversions
and multiply-adds then bound it, not the bytes). Rows go in passes of at most 24 over the weights,
so prefill runs the same kernel. Each output element is computed by the same operations whatever the
number of rows, so speculative verification is bit-for-bit consistent with one-token decoding, and
so is the prefill with the steps that follow it.

The extension is built with ``torch.utils.cpp_extension`` (needs a C++ compiler and ``ninja``) the
first time :func:`load` is called, and cached by torch under ``~/.cache/torch_extensions``.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from types import ModuleType

import torch

from quickdraft.errors import QuickdraftError

SOURCE = Path(__file__).parent / "csrc" / "int8_linear.cpp"
#: output rows per panel of the packed weight (``kPanel`` in the C++ source)
PANEL = 64
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
        module = cpp_extension.load(
            name="quickdraft_int8_linear",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:  # compiler or ninja missing, build error
        raise QuickdraftError(f"could not build the int8 kernel ({SOURCE.name}): {exc}") from exc
    if module.panel_rows() != PANEL:  # pack_weight's layout must be the one the C++ reads
        raise QuickdraftError(f"{SOURCE.name} has panels of {module.panel_rows()} rows, int8kernel.PANEL is {PANEL}")
    return module


@functools.cache
def available() -> bool:
    """Whether :func:`int8_linear` can run here (CPU capable and the extension builds)."""
    if not cpu_supported():
        return False
    try:
        load()
    except QuickdraftError as exc:
        warnings.warn(f"{exc}; int8 layers fall back to torch's slower _weight_int8pack_mm", stacklevel=2)
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` int8 -> the kernel's layout ``[P, K, 64]`` with ``wp[p, k, r] = weight[64 p + r, k]``,
    ``P = ceil(N / 64)``, rows past ``N`` zero."""
    if weight.dim() != 2 or weight.dtype != torch.int8:
        raise QuickdraftError(f"pack_weight needs an int8 [N, K] weight, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=torch.int8)
    padded[:n] = weight
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Inverse of :func:`pack_weight`: ``[P, K, 64]`` -> ``[out_features, K]``."""
    panels, k, _ = packed.shape
    return packed.transpose(1, 2).reshape(panels * PANEL, k)[:out_features].contiguous()


def pad_rows(v: torch.Tensor, rows: int) -> torch.Tensor:
    """``[N]`` -> ``[rows]`` with zeros after ``N`` (scales and bias to the panels' row count)."""
    return torch.cat([v, v.new_zeros(rows - v.shape[0])]) if rows > v.shape[0] else v.contiguous()


def int8_linear(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
    out_features: int | None = None,
) -> torch.Tensor:
    """``(x Wᵀ) · scales + bias`` for float32 ``x [M, K]`` and ``W`` in the layout of :func:`pack_weight`.

    ``scales`` and ``bias`` have one entry per packed row (``P · 64``, see :func:`pad_rows`); the
    result keeps the first ``out_features`` columns (default all). Any number of rows, in passes of
    at most 24 over the weights.
    """
    if x.dim() != 2 or packed.dim() != 3 or packed.shape[2] != PANEL or x.shape[1] != packed.shape[1]:
        raise QuickdraftError(
            f"int8_linear needs x [M, K] and a packed weight [P, K, {PANEL}]; got {tuple(x.shape)} and {tuple(packed.shape)}"
        )
    if x.dtype != torch.float32 or packed.dtype != torch.int8 or scales.dtype != torch.float32:
        raise QuickdraftError(
            f"int8_linear needs float32 x, int8 weight and float32 scales; got {x.dtype}, {packed.dtype}, {scales.dtype}"
        )
    rows = packed.shape[0] * PANEL
    if scales.shape != (rows,) or (bias is not None and bias.shape != (rows,)):
        raise QuickdraftError(f"int8_linear needs scales (and bias) of shape [{rows}] (see pad_rows)")
    y = load().int8_linear(x, packed, scales, bias)
    if out_features is not None and out_features < rows:
        y = y[:, :out_features].contiguous()
    return y
