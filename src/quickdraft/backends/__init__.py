"""Model backends (runners, quantised and packed layers, kernels, the vLLM plugin) behind the :class:`quickdraft.backends.runner.ModelRunner` interface.

A backend runner owns one model's KV cache and implements ``reset(B)``,
``forward(tokens [B, m], valid [B, m], logits_to_keep, output_hidden) -> ForwardOutput``,
``truncate(new_lengths [B])`` and the attributes ``lengths [B]``, ``num_forwards``,
``max_positions``, ``device``, ``name`` and ``model.config.vocab_size``. The engine, every drafter
and every acceptance rule then run on it unchanged.

``torch``
    :class:`quickdraft.backends.runner.ModelRunner` over a ``transformers`` model (optionally with the
    weight-only int8/int4 layers of :mod:`quickdraft.backends.quant`).
``llamacpp``
    :class:`quickdraft.backends.llamacpp.LlamaCppRunner` over a GGUF file through
    ``llama-cpp-python``'s low-level API (``pip install 'quickdraft[llamacpp]'``).
``openvino``
    :class:`quickdraft.backends.openvino.OpenVINORunner` over an OpenVINO IR exported from the
    Hugging Face model (int8 weights by default), KV cache kept in the runtime
    (``pip install 'quickdraft[openvino]'``).
"""

from __future__ import annotations

from typing import Literal

BackendName = Literal["torch", "llamacpp", "openvino"]
BACKEND_NAMES: tuple[str, ...] = ("torch", "llamacpp", "openvino")


def resolve_backend(name: str) -> str:
    """``auto`` is the fastest backend installed on a CPU: ``openvino`` where OpenVINO and NNCF import
    (``benchmarks/bench_perf.py`` measures it against the others), else ``torch``; any other name
    is returned as it is."""
    if name != "auto":
        return name
    from quickdraft.backends.openvino.runner import is_available

    return "openvino" if is_available() else "torch"


__all__ = ["BACKEND_NAMES", "BackendName", "resolve_backend"]
