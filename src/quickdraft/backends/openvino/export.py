"""Export a Hugging Face causal LM to an OpenVINO IR that quickdraft's engine can drive.

The exported graph is the model's decoder stack traced once through ``openvino.convert_model``
with an explicit 4D attention mask, so that one IR serves plain decoding, verification of a
chain, batches whose rows hold holes, and token trees::

    inputs                                               outputs
    input_ids       [B, m]        int64                  logits   [B, n, V]  float32
    attention_mask  [B, 1, m, L+m] float32 (0 / -inf)    hidden   [B, n, H]  float32
    position_ids    [B, m]        int64
    logits_index    [n]           int64 (columns of the block whose logits are wanted)
    KV cache: stateful variables, one key and one value per layer, [B, h_kv, L, d]

``L`` is the number of cache *slots* before the call (see :mod:`quickdraft.backends.openvino.runner`),
``m`` the new tokens, ``n`` the columns asked for: the language-model head runs only on those, so a
prefill over a long prompt does not compute ``m × V`` logits it throws away.

The KV cache is kept inside the compiled model (``apply_make_stateful_transformation``): the
runtime appends to it in place, and nothing crosses the Python boundary but the new tokens and
the logits. Weights are compressed with NNCF (``int8`` asymmetric per-channel by default, ``int4``
as an option, ``none`` keeps float32): OpenVINO's CPU plugin then reads a quarter (int8) or an
eighth (int4) of the float32 bytes per token.

:func:`export_genai` writes the other layout, the one OpenVINO GenAI's ``LLMPipeline`` loads
(2D attention mask, ``beam_idx``, tokenizer IRs): the benchmark's OpenVINO GenAI anchors run the
same weights with the same compression.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from pathlib import Path
from typing import Literal

from quickdraft.errors import QuickdraftError

WeightFormat = Literal["int8", "int4", "none"]
WEIGHT_FORMATS: tuple[str, ...] = ("int8", "int4", "none")

#: file names inside an exported directory
MODEL_XML = "openvino_model.xml"
EXPORT_MANIFEST = "openvino_export.json"

#: bumped when the graph's interface changes, so that stale exports are rebuilt
GRAPH_VERSION = 1


def _check_format(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise QuickdraftError(f"unknown OpenVINO weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")


def _decoder_wrapper(model):
    """A ``torch.nn.Module`` whose forward takes the cache as flat tensors and returns the present
    cache flat, so that ``openvino.convert_model`` can trace it (``DynamicCache`` is filled by hand,
    not through ``update``, whose lazy first concatenation does not trace)."""
    import torch
    from transformers import DynamicCache

    num_layers = int(model.config.num_hidden_layers)

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, logits_index, *past):
            cache = DynamicCache(config=self.model.config)
            for i in range(num_layers):
                layer = cache.layers[i]
                layer.device = past[0].device
                layer.keys, layer.values = past[2 * i], past[2 * i + 1]
                layer.is_initialized = True
            out = self.model.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=cache, use_cache=True,
            )
            hidden = out.last_hidden_state.index_select(1, logits_index)  # [B, n, H]
            logits = self.model.lm_head(hidden).float()  # [B, n, V]
            present = []
            for layer in out.past_key_values.layers:
                present += [layer.keys, layer.values]
            return (logits, hidden.float(), *present)

    return Decoder()


def _kv_shape(config) -> tuple[int, int]:
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return kv_heads, head_dim


def trace_decoder(model):
    """``openvino.Model`` of ``model`` (a ``transformers`` causal LM in float32, eval mode) with the
    stateless interface: inputs ``input_ids, attention_mask, position_ids, logits_index,
    past.{i}.key, past.{i}.value``; outputs ``logits, hidden, present.{i}.key, present.{i}.value``."""
    import openvino as ov
    import torch

    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        config._attn_implementation = "sdpa"
    num_layers = int(config.num_hidden_layers)
    kv_heads, head_dim = _kv_shape(config)
    b, past_len, m = 1, 3, 2
    past = [torch.zeros(b, kv_heads, past_len, head_dim) for _ in range(2 * num_layers)]
    mask = torch.zeros(b, 1, m, past_len + m)
    mask[:, :, :, past_len:] = torch.triu(torch.full((m, m), float("-inf")), 1)
    example = (
        torch.zeros(b, m, dtype=torch.long), mask,
        torch.arange(past_len, past_len + m).unsqueeze(0), torch.arange(m, dtype=torch.long), *past,
    )
    wrapper = _decoder_wrapper(model).eval()
    with torch.inference_mode(False), torch.no_grad():
        ov_model = ov.convert_model(wrapper, example_input=example)
    names = ["input_ids", "attention_mask", "position_ids", "logits_index"]
    names += [f"past.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    for port, name in zip(ov_model.inputs, names):
        port.get_tensor().set_names({name})
    outs = ["logits", "hidden"] + [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    for port, name in zip(ov_model.outputs, outs):
        port.get_tensor().set_names({name})
    # batch and sequence axes dynamic; heads and head_dim static (the plugin's SDPA fusions want them)
    shapes = {
        "input_ids": ov.PartialShape([-1, -1]),
        "attention_mask": ov.PartialShape([-1, 1, -1, -1]),
        "position_ids": ov.PartialShape([-1, -1]),
        "logits_index": ov.PartialShape([-1]),
    }
    for i in range(num_layers):
        for kind in ("key", "value"):
            shapes[f"past.{i}.{kind}"] = ov.PartialShape([-1, kv_heads, -1, head_dim])
    ov_model.reshape(shapes)
    return ov_model


def make_stateful(ov_model) -> None:
    """Turn the ``past.*`` inputs and ``present.*`` outputs into state variables (in place)."""
    from openvino._offline_transformations import apply_make_stateful_transformation

    pairs = {}
    for port in ov_model.inputs:
        name = port.get_any_name()
        if name.startswith("past."):
            pairs[name] = "present." + name.removeprefix("past.")
    apply_make_stateful_transformation(ov_model, pairs)


def compress(ov_model, weight_format: str):
    """NNCF weight compression of ``ov_model``: ``int8`` (asymmetric, per output channel), ``int4``
    (asymmetric, groups of 128, the embedding and head kept int8), or ``none``."""
    _check_format(weight_format)
    if weight_format == "none":
        return ov_model
    import nncf

    if weight_format == "int8":
        return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT8_ASYM)
    return nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=128, ratio=1.0)


def export_dir_name(weight_format: str) -> str:
    """Sub-directory of a cache entry that holds its OpenVINO export in ``weight_format``."""
    _check_format(weight_format)
    return f"openvino-{weight_format}"


def is_exported(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a complete export of the current graph version."""
    out_dir = Path(out_dir)
    manifest = out_dir / EXPORT_MANIFEST
    if not (out_dir / MODEL_XML).is_file() or not (out_dir / "openvino_model.bin").is_file() or not manifest.is_file():
        return False
    try:
        info = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    if info.get("graph_version") != GRAPH_VERSION:
        return False
    return (out_dir / "openvino_model.bin").stat().st_size == info.get("bin_size")


def _load_float32(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def export(model_dir: str | Path, out_dir: str | Path, weight_format: str = "int8", *, progress: bool = True) -> Path:
    """Export the Hugging Face model in ``model_dir`` to ``out_dir`` (stateful, weights compressed).

    The write is atomic: the files go to a temporary sibling directory that is renamed into place
    once complete, with a manifest recording the graph version, the weight format and the size of
    the weights file (checked by :func:`is_exported`). Returns ``out_dir``.
    """
    import openvino as ov

    _check_format(weight_format)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if not (model_dir / "config.json").is_file():
        raise QuickdraftError(f"no Hugging Face model in {model_dir} (config.json missing)")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    if progress:
        print(f"  OpenVINO export of {model_dir.name} ({weight_format}): tracing ...", flush=True)
    model = _load_float32(model_dir)
    ov_model = trace_decoder(model)
    config = model.config
    del model
    gc.collect()
    make_stateful(ov_model)
    if progress:
        print(f"  OpenVINO export of {model_dir.name} ({weight_format}): compressing weights ...", flush=True)
    ov_model = compress(ov_model, weight_format)
    ov.save_model(ov_model, tmp / MODEL_XML, compress_to_fp16=False)
    del ov_model
    gc.collect()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, tmp / name)
    info = {
        "graph_version": GRAPH_VERSION,
        "weight_format": weight_format,
        "source": str(model_dir),
        "num_layers": int(config.num_hidden_layers),
        "vocab_size": int(config.vocab_size),
        "bin_size": (tmp / "openvino_model.bin").stat().st_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (tmp / EXPORT_MANIFEST).write_text(json.dumps(info, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    if progress:
        print(f"  OpenVINO export of {model_dir.name} ({weight_format}): done in {info['seconds']} s", flush=True)
    return out_dir
