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


def prefers_llamacpp(flags: frozenset[str] | set[str]) -> bool:
    """Whether llama.cpp is the engine's fastest runtime on a CPU with these feature flags
    (:func:`quickdraft.models.cpu_flags`): an x86 CPU with AVX2 but without AVX-512. On such a CPU
    (an AMD EPYC) OpenVINO GenAI's own plain decoding ran at 0.66× llama.cpp's, our engine at 0.54–0.61×
    on OpenVINO and 0.99× on llama.cpp; with AVX-512 OpenVINO is the faster (``docs/openvino.md``,
    runs 5 and 6).

    >>> prefers_llamacpp({"avx2", "fma"}), prefers_llamacpp({"avx2", "avx512f"}), prefers_llamacpp(set())
    (True, False, False)
    """
    return "avx2" in flags and "avx512f" not in flags


def resolve_backend(name: str, *, llamacpp_runs: bool = False) -> str:
    """``auto`` is the fastest backend installed on this CPU for the request: ``llamacpp`` where
    :func:`prefers_llamacpp`, llama-cpp-python imports and the caller says the request runs on it
    (``llamacpp_runs``: both models have GGUF files, one sequence, a chain method that needs no
    hidden states; :func:`quickdraft.backends.llamacpp.runs_on_llamacpp`); else ``openvino`` where
    OpenVINO and NNCF import; else ``torch`` (``benchmarks/bench_perf.py`` measures them against
    each other). Any other name is returned as it is."""
    if name != "auto":
        return name
    if llamacpp_runs:
        from quickdraft.backends.llamacpp import is_available as llamacpp_installed
        from quickdraft.models import cpu_flags

        if prefers_llamacpp(cpu_flags()) and llamacpp_installed():
            return "llamacpp"
    from quickdraft.backends.openvino.runner import is_available

    return "openvino" if is_available() else "torch"


__all__ = ["BACKEND_NAMES", "BackendName", "prefers_llamacpp", "resolve_backend"]
