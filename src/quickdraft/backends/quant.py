"""Weight-only int8 / int4 linear layers for torch on the CPU.

Decoding a model one token at a time is bound by memory bandwidth: every forward reads every
weight once (Williams, Waterman & Patterson 2009, "Roofline"). Storing the weights in 8 or 4 bits
and dequantising them inside the matrix kernel divides the bytes read per forward by 2 or ~3.6
against bf16, while activations stay in the model's dtype.

Two schemes, both applied per output row ``n`` of a weight ``W [N, K]``:

int8, symmetric per channel (float32 activations on an AVX2 CPU: :mod:`quickdraft.backends.int8kernel`, which
stays bandwidth-bound for the few rows of a verification; otherwise ``_weight_int8pack_mm``)
    .. math:: s_n = \\max_k |W_{nk}| / 127, \\quad q_{nk} = \\mathrm{round}(W_{nk} / s_n) \\in [-127, 127],
              \\quad \\hat W_{nk} = s_n q_{nk}

int4, asymmetric per group of ``g`` input columns (``_weight_int4pack_mm_for_cpu``, the scheme of
gpt-fast / torchao's ``int4_weight_only``); for the group ``G`` holding column ``k``:

    .. math:: s = (\\max_G W - \\min_G W) / 15, \\quad q_{nk} = \\mathrm{round}((W_{nk} - \\min_G W) / s) \\in [0, 15],
              \\quad \\hat W_{nk} = (q_{nk} - 8) s + z, \\quad z = \\min_G W + 8 s

Quantisation changes the model, so a quantised target is a *different* target: speculative
decoding stays lossless with respect to the quantised model (greedy speculative output equals the
quantised model's own plain greedy output), not with respect to the bf16 one.

>>> import torch
>>> layer = torch.nn.Linear(256, 64)
>>> q = Int8Linear.from_linear(layer)
>>> x = torch.randn(3, 256)
>>> bool((q(x) - layer(x)).abs().max() < 0.05)
True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from quickdraft.backends import int8kernel
from quickdraft.errors import QuickdraftError

Bits = Literal[8, 4]
QuantizeName = Literal["none", "int8", "int4"]
QUANTIZE_NAMES: tuple[str, ...] = ("none", "int8", "int4")

#: group sizes the CPU int4 kernel accepts
INT4_GROUP_SIZES: tuple[int, ...] = (32, 64, 128, 256)
#: ``innerKTiles`` of the int4 packing (ignored by the CPU kernel's layout but checked: 2, 4 or 8)
_INNER_K_TILES = 8


def _check_activation_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise QuickdraftError(f"quantised linear layers need bf16, fp16 or fp32 activations, got {dtype}")


class Int8Linear(nn.Module):
    """``y = x Ŵᵀ + b`` with ``Ŵ = diag(scales) · weight``, weight int8 ``[N, K]``.

    With float32 scales on a CPU where :mod:`quickdraft.backends.int8kernel` runs, the weight is kept only in
    that kernel's panel layout (``packed``, ``[ceil(N/64), K, 64]``) and every forward (decoding,
    verification, prefill) runs the kernel; otherwise it is kept as ``[N, K]`` for torch's
    ``_weight_int8pack_mm``.

    Parameters
    ----------
    weight:
        ``[N, K]`` int8 quantised weight.
    scales:
        ``[N]`` per-output-channel scales, in the activation dtype.
    bias:
        ``[N]`` or None, in the activation dtype.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.kernel = scales.dtype == torch.float32 and weight.device.type == "cpu" and int8kernel.available()
        if self.kernel:
            packed = int8kernel.pack_weight(weight)
            rows = packed.shape[0] * packed.shape[2]
            self.register_buffer("weight", packed)
            self.register_buffer("scales", int8kernel.pad_rows(scales, rows))
            self.register_buffer("bias", None if bias is None else int8kernel.pad_rows(bias, rows))
        else:
            self.register_buffer("weight", weight.contiguous())
            self.register_buffer("scales", scales.contiguous())
            self.register_buffer("bias", None if bias is None else bias.contiguous())

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        """Quantise ``linear`` (symmetric, per output channel); keeps its dtype for activations."""
        w = linear.weight.detach().float()  # [N, K]
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [N]
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        dtype = linear.weight.dtype
        _check_activation_dtype(dtype)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(q, scales.to(dtype), bias)

    def int8_weight(self) -> torch.Tensor:
        """``[N, K]`` int8 codes, whatever the layout held."""
        return int8kernel.unpack_weight(self.weight, self.out_features) if self.kernel else self.weight

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32 ``Ŵ`` (for tests)."""
        return self.int8_weight().float() * self.scales[: self.out_features].float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.kernel:
            y = int8kernel.int8_linear(x2.float().contiguous(), self.weight, self.scales, self.bias, self.out_features)
            return y.to(x.dtype).reshape(*lead, self.out_features)
        scales = self.scales if self.scales.dtype == x.dtype else self.scales.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), self.weight, scales)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        kernel = "quickdraft AVX2 kernel" if self.kernel else "torch _weight_int8pack_mm"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel ({kernel})"


class Int4Linear(nn.Module):
    """``y = x Ŵᵀ + b`` with ``Ŵ`` stored as 4-bit codes with a scale and zero per group.

    Parameters
    ----------
    packed:
        The CPU int4 packing of the ``[N, K]`` codes (``[N, K/2]`` uint8).
    scales_and_zeros:
        ``[K/g, N, 2]`` per-group ``(s, z)`` in the activation dtype.
    group_size:
        ``g``, the number of input columns sharing one scale and zero.
    bias:
        ``[N]`` or None.
    """

    def __init__(
        self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int, in_features: int,
        out_features: int, bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous())
        self.register_buffer("bias", None if bias is None else bias.contiguous())

    @staticmethod
    def supports(linear: nn.Linear, group_size: int) -> bool:
        """Whether the CPU int4 kernel can hold ``linear`` with this group size."""
        n, k = linear.weight.shape
        return group_size in INT4_GROUP_SIZES and k % group_size == 0 and k % (_INNER_K_TILES * 16) == 0 and n % 8 == 0

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, group_size: int = 128) -> "Int4Linear":
        """Quantise ``linear`` (asymmetric, groups of ``group_size`` input columns)."""
        if not cls.supports(linear, group_size):
            raise QuickdraftError(
                f"int4 needs in_features divisible by group_size ({group_size}, one of {INT4_GROUP_SIZES}) "
                f"and by {_INNER_K_TILES * 16}; got a {tuple(linear.weight.shape)} weight"
            )
        dtype = linear.weight.dtype
        _check_activation_dtype(dtype)
        n, k = linear.weight.shape
        w = linear.weight.detach().float().reshape(n, k // group_size, group_size)  # [N, K/g, g]
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, K/g]
        scales = ((hi - lo) / 15.0).clamp_min(1e-12)
        codes = torch.round((w - lo[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        zeros = lo + 8.0 * scales
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).to(dtype)  # [K/g, N, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), _INNER_K_TILES)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(packed, scales_and_zeros, group_size, k, n, bias)

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32 ``Ŵ`` (for tests): the kernel applied to the identity."""
        eye = torch.eye(self.in_features, dtype=torch.float32)
        sz = self.scales_and_zeros.float()
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, sz).T.contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        sz = self.scales_and_zeros if self.scales_and_zeros.dtype == x.dtype else self.scales_and_zeros.to(x.dtype)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, sz)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group_size={self.group_size}"


@dataclass
class QuantizationReport:
    """What :func:`quantize_model` did.

    Attributes
    ----------
    bits: 8 or 4.
    group_size: the int4 group size (None for int8).
    quantized: names of the linear layers replaced.
    skipped: names of linear layers left as they were (unsupported shape).
    bytes_before: bytes of the replaced layers' weights before.
    bytes_after: bytes of their quantised weights, scales and zeros.
    """

    bits: int
    group_size: int | None
    quantized: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0


def _tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.no_grad()
def quantize_model(
    model: nn.Module, bits: int, group_size: int = 128, *, include_lm_head: bool = True
) -> QuantizationReport:
    """Swap every ``nn.Linear`` of ``model`` for a weight-only int8 or int4 layer, in place.

    Parameters
    ----------
    model:
        A module (typically a ``transformers`` causal LM on the CPU, bf16 or fp32).
    bits:
        8 (per-channel symmetric) or 4 (group-wise asymmetric).
    group_size:
        int4 only: input columns per scale/zero, one of :data:`INT4_GROUP_SIZES`.
    include_lm_head:
        Also quantise the output head. A head tied to the input embedding is never quantised in
        place (the embedding lookup still needs the dense matrix); it is replaced by a quantised
        copy, which costs its memory but removes its bytes from every forward's reads.

    Returns
    -------
    QuantizationReport
    """
    if bits not in (8, 4):
        raise QuickdraftError(f"bits must be 8 or 4, got {bits!r}")
    if bits == 4 and group_size not in INT4_GROUP_SIZES:
        raise QuickdraftError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size!r}")
    report = QuantizationReport(bits=bits, group_size=group_size if bits == 4 else None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets: list[tuple[nn.Module, str, str, nn.Linear]] = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is nn.Linear:
                full = f"{parent_name}.{child_name}" if parent_name else child_name
                targets.append((parent, child_name, full, child))
    for parent, child_name, full, linear in targets:
        if linear is head and not include_lm_head:
            report.skipped.append(full)
            continue
        if bits == 4 and not Int4Linear.supports(linear, group_size):
            report.skipped.append(full)
            continue
        new = Int8Linear.from_linear(linear) if bits == 8 else Int4Linear.from_linear(linear, group_size)
        report.bytes_before += _tensor_bytes(linear.weight, linear.bias)
        report.bytes_after += sum(_tensor_bytes(b) for b in new.buffers())
        setattr(parent, child_name, new)
        report.quantized.append(full)
    if hasattr(model, "config"):
        model.config.quickdraft_quantization = {"bits": bits, "group_size": report.group_size}
    return report


def quantize_by_name(model: nn.Module, name: str, group_size: int = 128) -> QuantizationReport | None:
    """Apply the scheme called ``name`` (``"none"``, ``"int8"``, ``"int4"``); ``"none"`` returns None."""
    if name not in QUANTIZE_NAMES:
        raise QuickdraftError(f"unknown quantization {name!r}; choose one of {', '.join(QUANTIZE_NAMES)}")
    if name == "none":
        return None
    return quantize_model(model, 8 if name == "int8" else 4, group_size)
