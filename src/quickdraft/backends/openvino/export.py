"""Export a Hugging Face causal LM to an OpenVINO IR that quickdraft's engine can drive.

The exported graph is the model's decoder stack traced once through ``openvino.convert_model``
with an explicit 4D attention mask, so that one IR serves plain decoding, verification of a
chain, batches whose rows hold holes, and token trees::

    inputs                                               outputs
    input_ids       [B, m]        int64                  logits   [B, n, V]  float32
    attention_mask  [B, 1, m, L+m] float32 (0 / -inf)    hidden   [B, n, H]  float32
    position_ids    [B, m]        int64
    logits_index    [n]           int64 (columns of the block whose logits are wanted)
    beam_idx        [B]           int32 (row order of the cache: arange(B) keeps it)
    KV cache: stateful variables, one key and one value per layer, [B, h_kv, L, d]

``L`` is the number of cache *slots* before the call (see :mod:`quickdraft.backends.openvino.runner`),
``m`` the new tokens, ``n`` the columns asked for: the language-model head runs only on those, so a
prefill over a long prompt does not compute ``m × V`` logits it throws away.

A draft model may be exported with a *draft vocabulary* (``draft_vocab=N``): its head keeps only the
rows of the token ids :func:`draft_vocab_ids` names (the ``N`` lowest ids and the end-of-sequence
ids), so ``V' < V`` and the runner scatters the logits back into the full vocabulary with ``-inf``
elsewhere. The drafter then proposes from that subset only — any draft distribution keeps
speculative sampling lossless — and reads fewer bytes per token: the 0.5B draft's tied 151,936-row
head is about a third of its int4 weights.

The KV cache is kept inside the compiled model (``apply_make_stateful_transformation``): the
runtime appends to it in place, and nothing crosses the Python boundary but the new tokens and
the logits. Weights are compressed with NNCF (``int8`` asymmetric per-channel by default, ``int4``
symmetric in groups of 128 as an option, ``none`` keeps float32): OpenVINO's CPU plugin then reads a quarter (int8) or an
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

WeightFormat = Literal["int8", "int4", "int4all", "none"]
WEIGHT_FORMATS: tuple[str, ...] = ("int8", "int4", "int4all", "none")

#: file names inside an exported directory
MODEL_XML = "openvino_model.xml"
EXPORT_MANIFEST = "openvino_export.json"

#: per layout, bumped when the graph's interface changes, so that stale exports are rebuilt
GRAPH_VERSIONS = {"engine": 3, "genai": 2}


def _check_format(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise QuickdraftError(f"unknown OpenVINO weight format {weight_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")


def _fill_cache(config, past):
    """A ``DynamicCache`` holding ``past`` (flat key, value per layer), filled by hand: ``update``'s
    lazy first concatenation with an empty tensor does not trace."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for i in range(int(config.num_hidden_layers)):
        layer = cache.layers[i]
        layer.device = past[0].device
        layer.keys, layer.values = past[2 * i], past[2 * i + 1]
        layer.is_initialized = True
    return cache


def _flat_present(out) -> list:
    present = []
    for layer in out.past_key_values.layers:
        present += [layer.keys, layer.values]
    return present


def draft_vocab_ids(size: int, vocab_size: int, eos_ids: list[int] | tuple[int, ...] = ()) -> list[int]:
    """Token ids of a draft vocabulary of ``size`` ids: ``0 .. size-1`` and the end-of-sequence ids.

    Byte-level BPE vocabularies number their tokens in merge order, and the merges were learnt most
    frequent first, so the lowest ids are the most frequent tokens (for Qwen2.5's tokenizer, the
    49,152 lowest ids cover 98% of the tokens of the HumanEval solutions and 96% of the MT-Bench
    questions; see docs/openvino.md). Sorted, without duplicates.
    """
    if not 0 < int(size) <= int(vocab_size):
        raise QuickdraftError(f"draft vocabulary size {size} must lie in 1..{vocab_size} (the model's vocabulary)")
    extra = sorted({int(i) for i in eos_ids if int(size) <= int(i) < int(vocab_size)})
    return list(range(int(size))) + extra


def _check_draft_vocab_layout(layout: str, draft_vocab: int | None) -> None:
    if draft_vocab and layout != "engine":
        raise QuickdraftError("a draft vocabulary exists for the engine layout only")


def _ids(value) -> list[int]:
    """A config's ``eos_token_id`` (an id, a list of ids or None) as a list."""
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _subset_head(model, ids: list[int]) -> None:
    """Replace ``model.lm_head`` by a head over the rows ``ids`` only (untied from the embedding)."""
    import torch

    weight = model.lm_head.weight.detach()[torch.tensor(ids)].clone()  # [V', H]
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    head.weight = torch.nn.Parameter(weight, requires_grad=False)
    model.lm_head = head


def _engine_wrapper(model):
    """quickdraft's interface: 4D additive mask, logits and hidden states of chosen columns only."""
    import torch

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, logits_index, *past):
            out = self.model.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=_fill_cache(self.model.config, past), use_cache=True,
            )
            hidden = out.last_hidden_state.index_select(1, logits_index)  # [B, n, H]
            logits = self.model.lm_head(hidden).float()  # [B, n, V]
            return (logits, hidden.float(), *_flat_present(out))

    return Decoder()


def _genai_wrapper(model):
    """OpenVINO GenAI's interface: 2D padding mask, logits of every column."""
    import torch

    class Decoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                cache=_fill_cache(self.model.config, past), use_cache=True,
            )
            return (out.logits.float(), *_flat_present(out))

    return Decoder()


def _kv_shape(config) -> tuple[int, int]:
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return kv_heads, head_dim


def trace_decoder(model, layout: str = "engine"):
    """``openvino.Model`` of ``model`` (a ``transformers`` causal LM in float32, eval mode), stateless.

    ``layout="engine"``: inputs ``input_ids, attention_mask [B, 1, m, L+m], position_ids,
    logits_index, past.{i}.key, past.{i}.value``; outputs ``logits, hidden, present.{i}.*``.
    ``layout="genai"``: inputs ``input_ids, attention_mask [B, L+m], position_ids,
    past_key_values.{i}.key/value``; outputs ``logits, present.{i}.key/value`` (optimum-intel's names).
    """
    import openvino as ov
    import torch

    config = model.config
    config._attn_implementation = "sdpa"
    num_layers = int(config.num_hidden_layers)
    kv_heads, head_dim = _kv_shape(config)
    b, past_len, m = 1, 3, 2
    past = [torch.zeros(b, kv_heads, past_len, head_dim) for _ in range(2 * num_layers)]
    positions = torch.arange(past_len, past_len + m).unsqueeze(0)
    if layout == "engine":
        mask = torch.zeros(b, 1, m, past_len + m)
        mask[:, :, :, past_len:] = torch.triu(torch.full((m, m), float("-inf")), 1)
        example = (torch.zeros(b, m, dtype=torch.long), mask, positions, torch.arange(m, dtype=torch.long), *past)
        wrapper = _engine_wrapper(model)
        names = ["input_ids", "attention_mask", "position_ids", "logits_index"]
        past_names = [f"past.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
        outs = ["logits", "hidden"]
        mask_shape = ov.PartialShape([-1, 1, -1, -1])
    elif layout == "genai":
        example = (torch.zeros(b, m, dtype=torch.long), torch.ones(b, past_len + m, dtype=torch.long), positions, *past)
        wrapper = _genai_wrapper(model)
        names = ["input_ids", "attention_mask", "position_ids"]
        past_names = [f"past_key_values.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
        outs = ["logits"]
        mask_shape = ov.PartialShape([-1, -1])
    else:
        raise QuickdraftError(f"unknown OpenVINO graph layout {layout!r}")
    with torch.no_grad():
        ov_model = ov.convert_model(wrapper.eval(), example_input=example)
    for port, name in zip(ov_model.inputs, names + past_names):
        port.get_tensor().set_names({name})
    outs += [f"present.{i}.{kind}" for i in range(num_layers) for kind in ("key", "value")]
    for port, name in zip(ov_model.outputs, outs):
        port.get_tensor().set_names({name})
    # batch and sequence axes dynamic; heads and head_dim static (the plugin's SDPA fusions want them)
    shapes = {"input_ids": ov.PartialShape([-1, -1]), "attention_mask": mask_shape,
              "position_ids": ov.PartialShape([-1, -1])}
    if layout == "engine":
        shapes["logits_index"] = ov.PartialShape([-1])
    for name in past_names:
        shapes[name] = ov.PartialShape([-1, kv_heads, -1, head_dim])
    ov_model.reshape(shapes)
    return ov_model


def add_beam_idx(ov_model) -> None:
    """The cache reorder input ``beam_idx [B]`` (int32): every past tensor's rows are gathered by it
    before the new keys and values are appended (in place).

    Both layouts need it: OpenVINO GenAI feeds it, and the CPU plugin fuses
    ``ReadValue -> Gather(beam_idx) -> Concat -> ScaledDotProductAttention`` (its stateful SDPA
    fusion) into one attention node that appends to a KV cache kept in the plugin's own precision
    (``KV_CACHE_PRECISION``) — without the Gather the pattern does not match, the attention runs as
    separate MatMul / Softmax nodes and the whole cache is copied by a Concat on every call."""
    import openvino as ov

    beam_idx = ov.opset13.parameter(ov.PartialShape([-1]), ov.Type.i32, name="beam_idx")
    beam_idx.output(0).get_tensor().set_names({"beam_idx"})
    axis = ov.opset13.constant(0, ov.Type.i64)
    for param in ov_model.get_parameters():
        if not param.get_output_tensor(0).get_any_name().startswith(("past.", "past_key_values.")):
            continue
        consumers = list(param.output(0).get_target_inputs())
        gathered = ov.opset13.gather(param, beam_idx, axis)
        for consumer in consumers:
            consumer.replace_source_output(gathered.output(0))
    ov_model.add_parameters([beam_idx])
    ov_model.validate_nodes_and_infer_types()


def make_stateful(ov_model) -> None:
    """Turn the ``past.*`` inputs and ``present.*`` outputs into state variables (in place)."""
    from openvino._offline_transformations import apply_make_stateful_transformation

    pairs = {}
    for port in ov_model.inputs:
        name = port.get_any_name()
        for prefix in ("past.", "past_key_values."):
            if name.startswith(prefix):
                pairs[name] = "present." + name.removeprefix(prefix)
    apply_make_stateful_transformation(ov_model, pairs)
    _initialise_states(ov_model)


def _initialise_states(ov_model) -> None:
    """Give every state variable an initial value: an empty cache ``[B, h_kv, 0, d]`` with ``B``
    read off ``input_ids``. The CPU plugin's fused attention node (see :func:`add_beam_idx`) needs
    its ``ReadValue`` to have this initialising input."""
    import numpy as np
    import openvino as ov

    opset = ov.opset13
    batch = opset.gather(opset.shape_of(ov_model.input("input_ids"), output_type="i64"),
                         opset.constant(np.array([0], np.int64)), opset.constant(0))
    for node in ov_model.get_ops():
        if node.get_type_name() != "ReadValue":
            continue
        _, kv_heads, _, head_dim = node.get_output_partial_shape(0)
        shape = opset.concat([batch, opset.constant(np.array([kv_heads.get_length(), 0, head_dim.get_length()], np.int64))], 0)
        node.set_arguments([opset.broadcast(opset.constant(0.0, node.get_output_element_type(0)), shape)])
    ov_model.validate_nodes_and_infer_types()


#: NNCF settings of each weight format (recorded in the manifest: an export made with other settings
#: is made again). ``int4`` is symmetric: on the CPU plugin a symmetric int4 layer (no zero points)
#: runs a one-token forward about 10% faster than an asymmetric one (docs/openvino.md).
COMPRESSION = {
    "int8": {"mode": "int8_asym", "group_size": -1},
    # a layer narrower than a group (small test models) gets a smaller group instead of an error
    "int4": {"mode": "int4_sym", "group_size": 128, "group_size_fallback": "adjust"},
    # int4 for every layer: the output head (read at every forward: a seventh of the 1.5B target's
    # weights) and the embedding too, which ``int4`` keeps int8 (docs/openvino.md#weight-compression)
    "int4all": {"mode": "int4_sym", "group_size": 128, "group_size_fallback": "adjust", "all_layers": True},
    "none": None,
}


def compress(ov_model, weight_format: str):
    """NNCF weight compression of ``ov_model`` (:data:`COMPRESSION`): ``int8`` (asymmetric, per output
    channel), ``int4`` (symmetric, groups of 128, the embedding and head kept int8), ``int4all``
    (``int4`` with the embedding and head in int4 too), or ``none``."""
    _check_format(weight_format)
    settings = COMPRESSION[weight_format]
    if settings is None:
        return ov_model
    import nncf

    mode = getattr(nncf.CompressWeightsMode, settings["mode"].upper())
    if weight_format == "int8":
        return nncf.compress_weights(ov_model, mode=mode)
    from nncf.quantization.advanced_parameters import AdvancedCompressionParameters

    fallback = nncf.GroupSizeFallbackMode(settings["group_size_fallback"])
    return nncf.compress_weights(ov_model, mode=mode, group_size=settings["group_size"], ratio=1.0,
                                 all_layers=settings.get("all_layers", False),
                                 advanced_parameters=AdvancedCompressionParameters(group_size_fallback_mode=fallback))


Layout = Literal["engine", "genai"]


def export_dir_name(weight_format: str, layout: str = "engine", draft_vocab: int | None = None) -> str:
    """Sub-directory of a cache entry that holds its OpenVINO export in ``weight_format``
    (``openvino-int8``; with a draft vocabulary: ``openvino-int4-vocab49152``; the GenAI layout:
    ``openvino-genai-int8``)."""
    _check_format(weight_format)
    _check_draft_vocab_layout(layout, draft_vocab)
    if layout != "engine":
        return f"openvino-{layout}-{weight_format}"
    return f"openvino-{weight_format}" + (f"-vocab{int(draft_vocab)}" if draft_vocab else "")


def read_manifest(out_dir: str | Path) -> dict:
    """The export's manifest (:data:`EXPORT_MANIFEST`: weight format, compression, vocabulary …),
    or ``{}`` where there is none."""
    manifest = Path(out_dir) / EXPORT_MANIFEST
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


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
    if info.get("graph_version") != GRAPH_VERSIONS.get(info.get("layout", "engine")):
        return False
    # a manifest without a compression record: int8 and float32 exports match the settings above, an int4
    # one was compressed asymmetrically
    recorded = info["compression"] if "compression" in info else (
        None if info.get("weight_format") == "int4" else COMPRESSION.get(info.get("weight_format")))
    if recorded != COMPRESSION.get(info.get("weight_format")):
        return False
    return (out_dir / "openvino_model.bin").stat().st_size == info.get("bin_size")


def _load_float32(model_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def export(model_dir: str | Path, out_dir: str | Path, weight_format: str = "int8", *,
           layout: str = "engine", draft_vocab: int | None = None, progress: bool = True) -> Path:
    """Export the Hugging Face model in ``model_dir`` to ``out_dir`` (stateful, weights compressed).

    ``layout="engine"`` is the IR :class:`~quickdraft.backends.openvino.runner.OpenVINORunner` runs;
    ``layout="genai"`` the one OpenVINO GenAI's ``LLMPipeline`` runs (with ``beam_idx`` and the
    tokenizer and detokenizer IRs of ``openvino_tokenizers``), from the same float32 weights and
    the same compression. ``draft_vocab``: keep only the head rows of :func:`draft_vocab_ids` (engine
    layout; for a draft model). The write is atomic: the files go to a temporary sibling directory that is renamed into place
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
    config = model.config
    from quickdraft.models import model_fingerprint

    fingerprint = model_fingerprint(model)  # checked against an acceptance head's draft
    head_ids = None
    _check_draft_vocab_layout(layout, draft_vocab)
    if draft_vocab:
        eos = _ids(getattr(model.generation_config, "eos_token_id", None)) + _ids(config.eos_token_id)
        head_ids = draft_vocab_ids(draft_vocab, int(config.vocab_size), eos)
        _subset_head(model, head_ids)
    ov_model = trace_decoder(model, layout)
    del model
    gc.collect()
    add_beam_idx(ov_model)
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
    if layout == "genai":
        _save_tokenizer_irs(model_dir, tmp)
    info = {
        "graph_version": GRAPH_VERSIONS[layout],
        "layout": layout,
        "weight_format": weight_format,
        "compression": COMPRESSION[weight_format],
        "source": str(model_dir),
        "num_layers": int(config.num_hidden_layers),
        "fingerprint": fingerprint,
        "vocab_size": int(config.vocab_size),
        # the head's rows (a draft vocabulary): the ``draft_vocab`` lowest ids, then ``head_extra_ids``
        "draft_vocab": int(draft_vocab) if head_ids else None,
        "head_extra_ids": head_ids[int(draft_vocab):] if head_ids else [],
        "bin_size": (tmp / "openvino_model.bin").stat().st_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (tmp / EXPORT_MANIFEST).write_text(json.dumps(info, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    if progress:
        print(f"  OpenVINO export of {model_dir.name} ({weight_format}): done in {info['seconds']} s", flush=True)
    return out_dir


def _save_tokenizer_irs(model_dir: Path, out_dir: Path) -> None:
    """``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml``, which GenAI's pipelines load."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoTokenizer

    tokenizer, detokenizer = convert_tokenizer(AutoTokenizer.from_pretrained(model_dir), with_detokenizer=True)
    ov.save_model(tokenizer, out_dir / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out_dir / "openvino_detokenizer.xml")
