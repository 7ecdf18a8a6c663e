"""fp32 linear layers on oneDNN with pre-packed weights: a verification forward that costs about
as much as a single-token one on CPUs where MKL's small-batch GEMM is slow.

Why. Speculative decoding pays off on a CPU only if a target forward over ``m = K + 1`` tokens
costs about the same as over one: both read every weight once, and decoding is bound by that read.
torch's fp32 ``nn.Linear`` calls MKL. On an AMD EPYC (AVX2, no AVX-512) MKL's single-row product
(GEMV) streams the weights at memory speed, but its ``m ≥ 2`` product (SGEMM) does not: for one
1536 × 8960 layer, two threads, it took 4.3 ms at ``m = 1`` and 9–28 / 14–44 / 15–56 ms at
``m = 2 / 5 / 16`` (``benchmarks/bench_linear.py``). So verifying 4 draft tokens cost 3–10 one-token
forwards, and every draft forward that catches up two tokens cost 2–6. oneDNN's inner-product
primitive on a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``)
streams the weights at every ``m`` (the same layer: ~3–4 ms from ``m = 1`` to ``m = 5``).

What. :func:`pack_linears` swaps every fp32 ``nn.Linear`` of a model for a :class:`PackedLinear`
holding the reordered weight (same values, same bytes; the dense original is released unless it is
tied to another module, as an LM head tied to the input embedding is). The product is computed in
fp32 by a different kernel, so results differ from ``nn.Linear``'s in the last bits (≈1e-6
relative); a model with packed layers is deterministic, and every lossless method stays exact with
respect to it (greedy speculative output equals its plain greedy output; tests in
``tests/test_packed.py``).

When. :func:`packing_available` — a CPU build of torch with oneDNN (``torch.backends.mkldnn``) and a
CPU without native bf16 compute: where bf16 runs natively, models load in bf16 and oneDNN's bf16
path is used by torch already. :func:`pack_linears` leaves bf16/fp16 layers, quantised layers and
non-CPU layers alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from quickdraft.errors import QuickdraftError

#: batch-size hint for the weight reorder: verification blocks are 2–16 tokens
PACK_BATCH_HINT = 8


def packing_available() -> bool:
    """Whether this torch can run :class:`PackedLinear` (oneDNN compiled in and usable)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` held in oneDNN's blocked layout (fp32, CPU).

    Parameters
    ----------
    packed_weight:
        The output of ``torch.ops.mkldnn._reorder_linear_weight(W, hint)`` for ``W [N, K]``.
    bias:
        ``[N]`` or None.
    in_features, out_features:
        ``K`` and ``N``.
    """

    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None, in_features: int,
                 out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("packed_weight", packed_weight)
        self.register_buffer("bias", bias)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, batch_hint: int = PACK_BATCH_HINT) -> "PackedLinear":
        w = linear.weight
        if w.dtype != torch.float32 or w.device.type != "cpu":
            raise QuickdraftError(f"PackedLinear needs an fp32 CPU weight, got {w.dtype} on {w.device}")
        packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), batch_hint)
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        return cls(packed, bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K]
        if x.dtype != torch.float32:
            raise QuickdraftError(f"PackedLinear computes in fp32; got {x.dtype} activations")
        lead = x.shape[:-1]
        y = torch.ops.mkldnn._linear_pointwise(
            x.reshape(-1, self.in_features).contiguous(), self.packed_weight, self.bias, "none", [], ""
        )
        return y.reshape(*lead, self.out_features)

    @torch.no_grad()
    def dense_weight(self, rows: int = 1024) -> torch.Tensor:
        """The dense ``W [N, K]`` this layer holds, read back through its own kernel: ``I @ Wᵀ``
        over blocks of ``rows`` rows of the identity (each output is one product by 1.0 plus
        zeros, so exact in fp32; oneDNN's blocked layout has no public inverse)."""
        blocks = []
        for start in range(0, self.in_features, rows):
            stop = min(start + rows, self.in_features)
            eye = torch.zeros(stop - start, self.in_features)
            eye[torch.arange(stop - start), torch.arange(start, stop)] = 1.0
            blocks.append(torch.ops.mkldnn._linear_pointwise(eye, self.packed_weight, None, "none", [], ""))
        return torch.cat(blocks).t().contiguous()  # [K, N] -> [N, K]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, onednn"


@torch.no_grad()
def dense_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` as if every :class:`PackedLinear` in it were the ``nn.Linear`` it was
    made from (``weight`` instead of ``packed_weight``), e.g. to copy a packed model's layer into
    another model."""
    state = {}
    for key, value in module.state_dict().items():
        owner_name, _, leaf = key.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if isinstance(owner, PackedLinear) and leaf == "packed_weight":
            state[f"{owner_name}.weight" if owner_name else "weight"] = owner.dense_weight()
        else:
            state[key] = value
    return state


@dataclass
class PackReport:
    """What :func:`pack_linears` did: the layers packed and those left alone (with why)."""

    packed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


@torch.no_grad()
def pack_linears(model: nn.Module, batch_hint: int = PACK_BATCH_HINT) -> PackReport:
    """Swap every fp32 CPU ``nn.Linear`` of ``model`` for a :class:`PackedLinear`, in place.

    Raises :class:`QuickdraftError` when oneDNN is not available (see :func:`packing_available`).
    """
    if not packing_available():
        raise QuickdraftError("packed linear layers need a torch build with oneDNN (torch.backends.mkldnn)")
    report = PackReport()
    targets = []
    for parent_name, parent in model.named_modules():
        for child_name, child in parent.named_children():
            if type(child) is nn.Linear:
                targets.append((parent, child_name, f"{parent_name}.{child_name}" if parent_name else child_name, child))
    for parent, child_name, full, linear in targets:
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
            report.skipped[full] = f"{linear.weight.dtype} on {linear.weight.device}"
            continue
        setattr(parent, child_name, PackedLinear.from_linear(linear, batch_hint))
        report.packed.append(full)
    if hasattr(model, "config"):
        model.config.quickdraft_packed_linears = len(report.packed)
    return report


def should_pack(model: nn.Module) -> bool:
    """The default: pack when oneDNN is available, the model computes in fp32 on the CPU and the
    CPU has no native bf16 (where it has, ``dtype="auto"`` loads bf16 and this does not apply)."""
    from quickdraft.models import _cpu_has_native_bf16

    param = next(model.parameters(), None)
    return (
        param is not None and param.dtype == torch.float32 and param.device.type == "cpu"
        and packing_available() and not _cpu_has_native_bf16()
    )


def maybe_pack(model: nn.Module, pack: bool | None = None) -> PackReport | None:
    """Pack ``model``'s linear layers if ``pack`` is True, or if it is None and :func:`should_pack`
    says so; returns the report, or None when nothing was packed."""
    if pack is False or (pack is None and not should_pack(model)):
        return None
    return pack_linears(model)
