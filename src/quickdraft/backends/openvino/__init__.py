"""The OpenVINO backend: models exported to OpenVINO IR, driven by quickdraft's engine.

``export``  traces a Hugging Face causal LM into a stateful IR with an explicit 4D attention mask
            and compresses its weights with NNCF (:mod:`.export`).
``runner``  :class:`OpenVINORunner`, the ``ModelRunner`` interface over such an IR (:mod:`.runner`).

:func:`load_openvino` resolves a model spec (registry name, alias, Hugging Face directory or an
export directory), exporting it once into the cache entry when no export exists yet.
"""

from __future__ import annotations

import os
from pathlib import Path

from quickdraft.errors import QuickdraftError

from .export import MODEL_XML, WEIGHT_FORMATS, export, export_dir_name, is_exported
from .runner import OpenVINORunner, is_available

__all__ = ["OpenVINORunner", "WEIGHT_FORMATS", "export_for", "is_available", "load_openvino"]


def export_for(spec: str | os.PathLike[str], weight_format: str = "int8", *, layout: str = "engine",
               draft_vocab: int | None = None, progress: bool = True) -> Path:
    """The OpenVINO export of a model spec, made once (``<entry>/openvino-<format>``; the GenAI
    layout: ``<entry>/openvino-genai-<format>``; with a draft vocabulary of ``N`` ids:
    ``<entry>/openvino-<format>-vocabN``) if missing.

    ``spec`` may also be an export directory itself (it holds ``openvino_model.xml``).
    """
    path = Path(os.fspath(spec)).expanduser()
    if path.is_dir() and (path / MODEL_XML).is_file():
        return path
    from quickdraft.models import resolve

    entry = resolve(spec)
    if entry.is_file():
        raise QuickdraftError(
            f"the openvino backend exports Hugging Face model directories, got the GGUF file {entry}; "
            "install the model (`quickdraft models install`) or pass its directory"
        )
    out = entry / export_dir_name(weight_format, layout, draft_vocab)
    if not is_exported(out):
        export(entry, out, weight_format, layout=layout, draft_vocab=draft_vocab, progress=progress)
    return out


def load_openvino(spec: str | os.PathLike[str], name: str, *, weight_format: str = "int8",
                  n_threads: int | None = None, kv_cache_precision: str | None = None,
                  inference_precision: str | None = None, exact: bool = False, vocab_size: int | None = None,
                  draft_vocab: int | None = None, tuned: bool = True, drafting: bool = False):
    """``(OpenVINORunner, tokenizer)`` for a registry name, alias, Hugging Face directory or export
    (``draft_vocab``: a draft model whose head keeps that many token ids, see ``export.draft_vocab_ids``;
    ``tuned``, ``drafting``: :class:`OpenVINORunner`'s)."""
    from transformers import AutoTokenizer

    out = export_for(spec, weight_format, draft_vocab=draft_vocab)
    tokenizer = AutoTokenizer.from_pretrained(out)
    runner = OpenVINORunner(out, name, n_threads=n_threads, kv_cache_precision=kv_cache_precision,
                            inference_precision=inference_precision, exact=exact, vocab_size=vocab_size,
                            tuned=tuned, drafting=drafting)
    return runner, tokenizer
