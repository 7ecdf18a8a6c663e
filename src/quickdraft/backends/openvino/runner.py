"""An OpenVINO backend: :class:`OpenVINORunner` runs an exported IR behind the ``ModelRunner`` interface.

The IR (:mod:`quickdraft.backends.openvino.export`) keeps its KV cache inside the compiled model as
state variables and takes an explicit 4D attention mask. The runner uses the same bookkeeping as the
torch runner (:mod:`quickdraft.backends.runner`): the cache holds ``L`` *slots* per row, each either valid
(a token of the row, at its rotary position) or a *hole*. Because every call passes the full mask,

* a roll-back after a rejection costs nothing: the rejected slots become holes, masked out of every
  later call, and the runtime never copies the cache;
* rows of a batch accept different numbers of draft tokens in the same step;
* a token tree is a block of slots whose mask lets each node see its ancestors; committing a path
  turns the other nodes into holes.

Holes cost attention reads (not weight reads, which dominate a step on a CPU), so the runner
compacts the cache — reads every state, keeps the valid slots, writes it back — only when holes
make up more than half of the slots (and at least :attr:`OpenVINORunner.compact_min_holes`).

Sampling, verification and every acceptance rule stay in torch, on the logits this backend
returns: a lossless method is lossless with respect to *this* backend's distributions.
"""

from __future__ import annotations

import copy
import functools
import os
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.backends.runner import ForwardOutput, row_index
from quickdraft.verification.sampling import check_finite

from .export import MODEL_XML, read_manifest
from .pages import WeightPages

#: additive mask value of a slot a token must not see
_BLOCKED = np.float32(-np.inf)


def import_openvino():
    """The ``openvino`` module, or a :class:`QuickdraftError` saying how to install it."""
    try:
        import openvino  # noqa: PLC0415
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise QuickdraftError(f"the openvino backend needs OpenVINO: pip install 'quickdraft[openvino]' ({err})") from None
    return openvino


def is_available() -> bool:
    """Whether ``openvino`` (and ``nncf``, for exports) can be imported."""
    try:
        import nncf  # noqa: F401, PLC0415
        import openvino  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


_CORE = None


def core():
    """One ``openvino.Core`` per process (compiled models share its CPU executor)."""
    global _CORE
    if _CORE is None:
        _CORE = import_openvino().Core()
    return _CORE


#: CPU plugin settings under which a forward's arithmetic does not depend on how many tokens it
#: holds: float32 activations and KV cache, activations not quantised on the fly
EXACT_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}


#: ``DYNAMIC_QUANTIZATION_GROUP_SIZE`` for int8 weights (one scale per output row): activations
#: quantised in groups of 256 make a one-token and a 5-token forward of the int8 target ~17%
#: cheaper than the plugin's default of 32 (docs/openvino.md, "Plugin settings")
INT8_ACTIVATION_GROUP = 256


def tuned_config(export_info: dict, drafting: bool = False) -> dict:
    """The CPU plugin settings the engine compiles an export with unless told otherwise, from its
    manifest (``openvino_export.json``): for int8/int4 weights a float16 KV cache instead of u8, on
    CPUs without AMX float32 activations instead of bf16, and activations quantised on the fly in
    groups as wide as the weights' (``DYNAMIC_QUANTIZATION_GROUP_SIZE``: int4's group size, or
    :data:`INT8_ACTIVATION_GROUP` for int8's per-row scales) instead of the plugin's 32 — except
    for an int4 model that ``drafting`` (one-token forwards, where the plugin's groups of 32 are
    cheaper). Measured on the default pair: a 5-token verification of the int4 target ~20% cheaper,
    a one-token forward of the int8 target ~15% (``benchmarks/studies/openvino_plugin_settings.py``).
    Weights that are not compressed keep the plugin's defaults.

    >>> tuned_config({"weight_format": "int4", "compression": {"group_size": 128}})["DYNAMIC_QUANTIZATION_GROUP_SIZE"]
    128
    >>> "DYNAMIC_QUANTIZATION_GROUP_SIZE" in tuned_config({"weight_format": "int4"}, drafting=True)
    False
    >>> tuned_config({"weight_format": "none"})
    {}
    """
    from quickdraft.models import cpu_flags

    fmt = export_info.get("weight_format")
    if fmt not in ("int8", "int4", "int4all"):
        return {}
    config = {"KV_CACHE_PRECISION": "f16"}
    group = int((export_info.get("compression") or {}).get("group_size") or 128) if fmt != "int8" else -1
    if group <= 0:  # int8's per-row scales, or one int4 group per row
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = INT8_ACTIVATION_GROUP
    elif not drafting:
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = group
    if not any(flag.startswith("amx") for flag in cpu_flags()):
        config["INFERENCE_PRECISION_HINT"] = "f32"
    return config


def compile_config(n_threads: int, kv_cache_precision: str | None = None,
                   inference_precision: str | None = None, exact: bool = False, tuned: dict | None = None) -> dict:
    """CPU plugin settings: one stream, ``n_threads`` inference threads, latency hint, then
    ``tuned`` (:func:`tuned_config`; default none: the plugin's own choices), then the KV cache
    precision (``f32``, ``f16``, ``u8``) and the activations' precision (``f32``, ``bf16``,
    ``f16``) where given, then :data:`EXACT_CONFIG` with ``exact``."""
    config = {"INFERENCE_NUM_THREADS": int(n_threads), "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
    config.update(tuned or {})
    if kv_cache_precision:
        config["KV_CACHE_PRECISION"] = kv_cache_precision
    if inference_precision:
        config["INFERENCE_PRECISION_HINT"] = inference_precision
    if exact:
        config.update(EXACT_CONFIG)
    return config


class OpenVINORunner:
    """The ``ModelRunner`` interface over an OpenVINO export.

    Parameters
    ----------
    path:
        The export directory (``openvino_model.xml`` with its ``config.json``).
    name:
        Used in error messages ("target", "draft").
    n_threads:
        Inference threads of the CPU plugin (default: torch's thread count).
    kv_cache_precision:
        ``f32``, ``f16`` or ``u8`` (default: :func:`tuned_config`'s, else the plugin's choice,
        ``u8`` on x86 CPUs in OpenVINO 2026).
    inference_precision:
        Precision of the activations: ``f32``, ``bf16`` or ``f16`` (default: :func:`tuned_config`'s,
        else the plugin's choice, ``bf16`` where the CPU has native bf16 instructions).
    tuned:
        Compile with :func:`tuned_config` (default); ``False`` leaves the plugin's defaults.
    drafting:
        The model drafts (mostly one-token forwards): :func:`tuned_config`'s ``drafting``.
    exact:
        Batch-invariant arithmetic (:data:`EXACT_CONFIG`, over ``tuned``). Otherwise the plugin
        quantises the activations of int8/int4 layers to int8 on the fly and keeps a reduced
        precision KV cache: a token's logits can depend on how it was fed (block, cache holes),
        and greedy speculative output can leave plain greedy output where two tokens are close.
        With ``exact`` the two agree token for token, and verifying a block costs more (about
        2.5x a one-token forward for 5 tokens instead of about 1.1-1.3x).
    vocab_size:
        Width of the returned logits (default: the config's ``vocab_size``).
    release_weights:
        Make the first inference while loading (the plugin packs its own copy of every weight
        then) and give the weight file's pages back to the system meanwhile and after
        (:class:`quickdraft.backends.openvino.pages.WeightPages`): resident memory stays near
        one copy of the weights instead of two. Off: the file stays resident beside the copy.

    Attributes
    ----------
    lengths:
        ``[B]`` int64 valid tokens per row.
    slot_pos:
        ``[B, L]`` int64 position of the token in each cache slot, ``-1`` for a hole.
    num_forwards:
        Inference calls made through :meth:`forward` / :meth:`forward_tree`.
    infer_seconds:
        Wall time spent inside those calls (the runtime's share of a generation; the rest of a
        step is the engine's).
    model:
        A stand-in with ``config`` (the Hugging Face config), ``generation_config`` and
        ``fingerprint`` (:func:`quickdraft.decoding.head.model_fingerprint` of the exported weights).
    """

    #: compaction waits until at least this many slots are holes
    compact_min_holes = 256

    def __init__(self, path: str | os.PathLike[str], name: str = "model", *, n_threads: int | None = None,
                 kv_cache_precision: str | None = None, inference_precision: str | None = None, exact: bool = False,
                 vocab_size: int | None = None, release_weights: bool = True, tuned: bool = True,
                 drafting: bool = False) -> None:
        from transformers import AutoConfig, GenerationConfig

        path = Path(path)
        if not (path / MODEL_XML).is_file():
            raise QuickdraftError(f"{name}: no OpenVINO export in {path} ({MODEL_XML} missing); "
                                  "run `quickdraft models install` or `quickdraft models export`")
        self.path = path
        self.name = name
        self.device = torch.device("cpu")
        config = AutoConfig.from_pretrained(path)
        generation_config = None
        if (path / "generation_config.json").is_file():
            generation_config = GenerationConfig.from_pretrained(path)
        self.vocab_size = int(vocab_size or config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.export_info = read_manifest(path)
        # a draft vocabulary: the head's rows are these token ids (None: the whole vocabulary)
        self.head_ids = _head_ids(self.export_info)
        self.head_layout = None if self.head_ids is None else HeadLayout.of(self.head_ids, self.vocab_size)
        # the fingerprint of the exported weights (quickdraft.decoding.head.model_fingerprint), for head checks
        self.model = SimpleNamespace(config=config, generation_config=generation_config, name_or_path=str(path),
                                     fingerprint=self.export_info.get("fingerprint"))
        threads = n_threads or max(1, torch.get_num_threads())
        #: the export's weight file as mapped here; with ``release_weights`` its pages are given back
        #: once the plugin has packed its own copy (:mod:`quickdraft.backends.openvino.pages`)
        self.weight_pages = WeightPages(path)
        self.num_forwards = 0
        self.infer_seconds = 0.0
        self._feed: dict | None = None  # the last call's inputs, which the request points at
        #: what the CPU plugin was compiled with
        self.plugin_config = compile_config(threads, kv_cache_precision, inference_precision, exact,
                                            tuned_config(self.export_info, drafting) if tuned else None)
        with self.weight_pages.shedding() if release_weights else nullcontext():
            self.compiled = core().compile_model(str(path / MODEL_XML), "CPU",
                                                 self.plugin_config)
            self.request = self.compiled.create_infer_request()
            self._states = list(self.request.query_state())
            if not self._states:
                raise QuickdraftError(f"{name}: the OpenVINO model in {path} is not stateful; export it again")
            heads = int(config.num_attention_heads)
            kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
            head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
            self._kv = (kv_heads, head_dim)
            if release_weights:  # the first inference, where the plugin packs every weight
                self.reset(1)
                self.forward(torch.zeros((1, 1), dtype=torch.long), logits_to_keep=1)
        self.num_forwards = 0
        self.infer_seconds = 0.0
        self.reset(0)

    def sibling(self) -> "OpenVINORunner":
        """A runner over the same compiled model with an empty cache of its own: an infer request of
        its own holds the state (a server's batch), the weights are the compiled model's, shared."""
        twin = copy.copy(self)
        twin.request = self.compiled.create_infer_request()
        twin._states = list(twin.request.query_state())
        twin._feed = None
        twin.num_forwards, twin.infer_seconds = 0, 0.0
        twin.reset(0)
        return twin

    def cost_identity(self) -> dict | None:
        """What decides this runner's forward times (:func:`quickdraft.backends.costs.cost_key`)."""
        from quickdraft.backends.costs import path_identity

        weights = path_identity(self.path)
        return None if weights is None else {
            "runtime": f"openvino {import_openvino().get_version()}", "weights": weights,
            "plugin": {k: str(v) for k, v in self.plugin_config.items()},
            "head": None if self.head_ids is None else int(len(self.head_ids))}

    # -- state -----------------------------------------------------------------------------------
    def reset(self, batch_size: int) -> None:
        """Empty the cache for ``batch_size`` rows."""
        self._set_states([np.zeros((batch_size, *self._kv[:1], 0, self._kv[1]), np.float32)] * len(self._states))
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.long)  # [B, L], -1 = hole
        self.lengths = torch.zeros(batch_size, dtype=torch.long)  # [B]
        self.tree_start: int | None = None

    def _set_states(self, arrays: list[np.ndarray]) -> None:
        ov = import_openvino()
        for state, array in zip(self._states, arrays):
            state.state = ov.Tensor(np.ascontiguousarray(array))

    def _get_states(self) -> list[np.ndarray]:
        return [np.array(state.state.data, copy=True) for state in self._states]

    @property
    def batch_size(self) -> int:
        return int(self.slot_pos.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.slot_pos.shape[1])

    @property
    def num_holes(self) -> int:
        return int((self.slot_pos < 0).sum()) // max(1, self.batch_size)

    # -- forward ---------------------------------------------------------------------------------
    def _infer(self, tokens: torch.Tensor, positions: np.ndarray, mask: np.ndarray, keep: int,
               output_hidden: bool) -> ForwardOutput:
        b, m = tokens.shape
        ov = import_openvino()
        feed = {
            "input_ids": np.ascontiguousarray(tokens.to(torch.long).numpy()),
            "attention_mask": mask,
            "position_ids": np.ascontiguousarray(positions, dtype=np.int64),
            "logits_index": np.arange(m - keep, m, dtype=np.int64),
            "beam_idx": np.arange(b, dtype=np.int32),  # rows stay in place
        }
        start = time.perf_counter()
        # the runtime reads the arrays in place, without the input dispatcher's copies (the request
        # points at them until the next call: ``_feed`` keeps them alive), and the outputs stay in
        # the request until the copy below
        for name, array in feed.items():
            self.request.set_tensor(name, ov.Tensor(array, shared_memory=True))
        self._feed = feed
        self.request.infer(share_outputs=True)
        self.infer_seconds += time.perf_counter() - start
        self.num_forwards += 1
        logits = torch.from_numpy(np.array(self.request.get_tensor("logits").data, copy=True))  # [B, keep, V']
        if self.head_layout is not None:
            logits = _scatter_vocab(logits, self.head_layout, self.vocab_size)
        elif logits.shape[-1] != self.vocab_size:
            logits = _fit_vocab(logits, self.vocab_size)
        hidden = None
        if output_hidden:
            hidden = torch.from_numpy(np.array(self.request.get_tensor("hidden").data, copy=True))  # [B, keep, H]
        return ForwardOutput(logits=logits, hidden=hidden)

    def _check_overflow(self, positions: np.ndarray) -> None:
        if positions.size and int(positions.max()) >= self.max_positions:
            raise QuickdraftError(
                f"{self.name}: context overflow: position {int(positions.max())} exceeds the model's "
                f"maximum of {self.max_positions} tokens; shorten the prompt or max_new_tokens"
            )

    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        logits_to_keep: int = 0,
        output_hidden: bool = False,
    ) -> ForwardOutput:
        """Append a block of tokens to every row and return their logits.

        Parameters
        ----------
        tokens:
            ``[B, m]`` int64 token ids.
        valid:
            ``[B, m]`` bool; ``False`` marks left padding inside the block.
        logits_to_keep:
            Return logits for the last ``logits_to_keep`` columns only (0 = all ``m``); the head runs
            on those columns alone.
        output_hidden:
            Also return the final hidden states of the same columns.
        """
        if tokens.dim() != 2:
            raise QuickdraftError(f"{self.name}: tokens must be [B, m], got shape {tuple(tokens.shape)}")
        b, m = tokens.shape
        if b != self.batch_size:
            raise QuickdraftError(f"{self.name}: batch of {b} rows, cache has {self.batch_size}")
        if self.tree_start is not None:
            raise QuickdraftError(f"{self.name}: forward() while a tree session is open; commit_tree() first")
        # NumPy throughout: a handful of small array operations per call (the engine makes several
        # calls a step, and torch's per-operation overhead would be most of its own time)
        slots = self.slot_pos.numpy()  # [B, L]
        lengths = self.lengths.numpy()  # [B]
        width = slots.shape[1]
        # [B, 1, m, L + m]: every valid committed slot, then the block's valid tokens causally;
        # a token always sees itself, so no row of the softmax is empty (padding rows included)
        mask = np.empty((b, 1, m, width + m), np.float32)
        mask[:, 0, :, :width] = np.where(slots >= 0, np.float32(0.0), _BLOCKED)[:, None, :]
        if valid is None:
            positions = lengths[:, None] + np.arange(m, dtype=np.int64)  # [B, m]
            mask[:, 0, :, width:] = _causal_additive(m) if m <= _CACHED_BLOCK else _causal_block(m)
            new_slots, grown, live = positions, lengths + m, None
        else:
            v = valid.to(torch.bool).cpu().numpy()  # [B, m]
            positions = lengths[:, None] + np.maximum(np.cumsum(v, axis=-1) - 1, 0)
            allowed = (np.tri(m, dtype=bool)[None] & v[:, None, :]) | np.eye(m, dtype=bool)[None]
            mask[:, 0, :, width:] = np.where(allowed, np.float32(0.0), _BLOCKED)
            new_slots, grown, live = np.where(v, positions, -1), lengths + v.sum(axis=-1), torch.from_numpy(v[:, -1])
        self._check_overflow(positions)
        keep = m if logits_to_keep <= 0 else min(int(logits_to_keep), m)
        out = self._infer(tokens, positions, mask, keep, output_hidden)
        self.slot_pos = torch.from_numpy(np.concatenate([slots, new_slots], axis=1))
        self.lengths = torch.from_numpy(grown)
        check_finite(out.logits, f"the {self.name} model", rows=live)
        return out

    # -- token trees -----------------------------------------------------------------------------
    def begin_tree(self) -> None:
        """Open a tree session: later :meth:`forward_tree` calls append to one tree block."""
        if self.tree_start is not None:
            raise QuickdraftError(f"{self.name}: a tree session is already open")
        self.tree_start = self.num_slots

    @property
    def tree_size(self) -> int:
        """Slots in the open tree block (0 without a session)."""
        return 0 if self.tree_start is None else self.num_slots - self.tree_start

    def forward_tree(
        self,
        tokens: torch.Tensor,
        depths: torch.Tensor,
        tree_mask: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        output_hidden: bool = False,
    ) -> ForwardOutput:
        """Append ``m`` tree nodes per row to the open tree block and return all their logits.

        Same contract as :meth:`quickdraft.backends.runner.ModelRunner.forward_tree`: ``depths [B, m]``
        (a node's position is ``lengths + depth``), ``tree_mask [B, m, T + m]`` over the tree block
        (``T`` = :attr:`tree_size` before the call), ``valid [B, m]``.
        """
        if self.tree_start is None:
            raise QuickdraftError(f"{self.name}: forward_tree needs begin_tree() first")
        b, m = tokens.shape
        t = self.tree_size
        if b != self.batch_size:
            raise QuickdraftError(f"{self.name}: batch of {b} rows, cache has {self.batch_size}")
        if depths.shape != (b, m) or tree_mask.shape != (b, m, t + m):
            raise QuickdraftError(
                f"{self.name}: forward_tree needs depths [B={b}, m={m}] and tree_mask [B, m, {t + m}], got "
                f"{tuple(depths.shape)} and {tuple(tree_mask.shape)}"
            )
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.to(torch.bool).cpu()
        positions = self.lengths.unsqueeze(1) + depths.cpu().long()  # [B, m]
        self._check_overflow(positions.numpy())
        prefix_visible = (self.slot_pos[:, : self.tree_start] >= 0).unsqueeze(1).expand(b, m, -1)  # [B, m, P]
        block = tree_mask.cpu().to(torch.bool).clone()  # [B, m, T + m]
        block[:, :, :t] &= (self.slot_pos[:, self.tree_start:] >= 0).unsqueeze(1)
        block[:, :, t:] &= valid.unsqueeze(1)
        block[:, :, t:] |= torch.eye(m, dtype=torch.bool)
        mask = _additive(torch.cat([prefix_visible, block], dim=2))
        out = self._infer(tokens, positions.numpy(), mask, m, output_hidden)
        self.slot_pos = torch.cat([self.slot_pos, torch.where(valid, positions, -1)], dim=1)
        check_finite(out.logits, f"the {self.name} model", rows=valid)
        return out

    def commit_tree(self, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Close the tree session, keeping one root-to-node path of tree-block slots per row.

        ``keep [B, P]``: tree-block slot indices in path order; row ``b`` keeps its first
        ``counts[b]``. The other slots of the block become holes (no copy); ``lengths += counts``.
        """
        if self.tree_start is None:
            raise QuickdraftError(f"{self.name}: commit_tree without an open tree session")
        start, b = self.tree_start, self.batch_size
        keep = keep.cpu().long().reshape(b, -1)
        counts = counts.cpu().long()
        width = int(counts.max()) if b else 0
        keep = keep[:, :width]
        cols = torch.arange(width).unsqueeze(0)
        live = cols < counts.unsqueeze(1)  # [B, P]
        if width and (keep[live].min() < 0 or keep[live].max() >= self.tree_size):
            raise QuickdraftError(f"{self.name}: commit_tree slot index outside the tree block")
        index = torch.where(live, keep, 0)
        block_pos = self.slot_pos[:, start:]
        kept_pos = block_pos.gather(1, index)
        if bool((live & (kept_pos != self.lengths.unsqueeze(1) + cols)).any()):
            raise QuickdraftError(f"{self.name}: commit_tree must keep a root-to-node path (consecutive positions)")
        kept = torch.zeros_like(block_pos, dtype=torch.bool)
        kept.scatter_(1, index, live)
        self.slot_pos = torch.cat([self.slot_pos[:, :start], torch.where(kept, block_pos, -1)], dim=1)
        self.lengths = self.lengths + counts
        self.tree_start = None
        self._maybe_compact()

    # -- roll-back -------------------------------------------------------------------------------
    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll every row back to its first ``new_lengths[row]`` tokens (``[B]`` int64): the slots
        after them become holes."""
        new_lengths = new_lengths.cpu().long()
        if (new_lengths > self.lengths).any():
            raise QuickdraftError(f"{self.name}: cannot truncate a row beyond its length")
        self.slot_pos = torch.where(self.slot_pos < new_lengths.unsqueeze(1), self.slot_pos, -1)
        self.lengths = new_lengths.clone()
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        holes = self.num_holes
        if holes >= self.compact_min_holes and 2 * holes > self.num_slots:
            self.compact()

    def compact(self) -> None:
        """Drop the holes: keep each row's valid slots (in slot order), left-padded with holes to
        the longest row. One read and one write of every state variable."""
        b = self.batch_size
        valid = self.slot_pos >= 0  # [B, L]
        width = int(valid.sum(dim=1).max()) if b else 0
        if width == self.num_slots:
            return
        # stable order: holes first, then the valid slots in their order; keep the last `width`
        order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, self.num_slots - width:]  # [B, W]
        index = order.numpy()
        states = self._get_states()
        compacted = [np.take_along_axis(s, index[:, None, :, None], axis=2) for s in states]
        self._set_states(compacted)
        self.slot_pos = self.slot_pos.gather(1, order)

    # -- rows ------------------------------------------------------------------------------------
    def add_rows(self, n: int) -> None:
        """Append ``n`` empty rows (their slots are holes) to the batch."""
        if n <= 0:
            return
        states = self._get_states()
        self._set_states([np.concatenate([s, np.zeros((n, *s.shape[1:]), s.dtype)], axis=0) for s in states])
        self.slot_pos = torch.cat([self.slot_pos, torch.full((n, self.num_slots), -1, dtype=torch.long)], dim=0)
        self.lengths = torch.cat([self.lengths, torch.zeros(n, dtype=torch.long)])

    def remove_rows(self, rows: list[int] | torch.Tensor) -> None:
        """Drop the given rows from the batch (the others keep their order)."""
        drop = set(int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows))
        self.select_rows([r for r in range(self.batch_size) if r not in drop])
        used = (self.slot_pos >= 0).any(dim=0)
        if self.batch_size == 0 or not bool(used.any()):
            self.reset(self.batch_size)

    def select_rows(self, rows: list[int] | torch.Tensor) -> None:
        """Make the batch the given rows, in that order: row ``i`` becomes a copy of row ``rows[i]``
        (a row may be repeated: forks of one context, as
        :meth:`quickdraft.backends.runner.ModelRunner.select_rows`)."""
        index = row_index(self, rows)
        picked = index.numpy()
        self._set_states([s[picked] for s in self._get_states()])
        self.slot_pos = self.slot_pos.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)

    def close(self) -> None:
        self.request = None
        self.compiled = None
        self._feed = None


def _additive(allowed: torch.Tensor) -> np.ndarray:
    """``[B, m, L]`` bool -> ``[B, 1, m, L]`` float32 additive mask (0 where allowed, -inf elsewhere)."""
    mask = np.where(allowed.numpy(), np.float32(0.0), _BLOCKED).astype(np.float32)
    return mask[:, None]


#: blocks up to this many tokens (drafts and verifications) reuse one causal mask each; a prompt's
#: block is built when it comes
_CACHED_BLOCK = 64


def _causal_block(m: int) -> np.ndarray:
    """``[m, m]`` float32 additive mask of a block of ``m`` tokens: each sees itself and those before it."""
    return np.where(np.tri(m, dtype=bool), np.float32(0.0), _BLOCKED)


@functools.lru_cache(maxsize=_CACHED_BLOCK)
def _causal_additive(m: int) -> np.ndarray:
    """:func:`_causal_block` of a small block, built once (read-only)."""
    mask = _causal_block(m)
    mask.setflags(write=False)
    return mask


def _head_ids(export_info: dict) -> torch.Tensor | None:
    """The token ids of an export's head rows (see ``export.draft_vocab_ids``), or None for a full head."""
    size = export_info.get("draft_vocab")
    if not size:
        return None
    extra = [int(i) for i in export_info.get("head_extra_ids", [])]
    return torch.cat([torch.arange(int(size)), torch.tensor(extra, dtype=torch.long)])


class HeadLayout(NamedTuple):
    """Where the rows of a reduced head go in the vocabulary: rows ``0 .. prefix - 1`` hold token ids
    ``0 .. prefix - 1`` (how :func:`quickdraft.backends.openvino.export.draft_vocab_ids` orders them),
    rows ``extra_rows`` hold ids ``extra_ids``; a row naming an id outside the vocabulary is dropped."""

    rows: int
    prefix: int
    extra_rows: torch.Tensor
    extra_ids: torch.Tensor

    @classmethod
    def of(cls, head_ids: torch.Tensor, vocab_size: int) -> "HeadLayout":
        n = head_ids.numel()
        run = (head_ids == torch.arange(n)).long().cumprod(dim=0)
        prefix = min(int(run.sum()), vocab_size)
        rest = torch.arange(prefix, n)
        keep = head_ids[prefix:] < vocab_size
        return cls(n, prefix, rest[keep], head_ids[prefix:][keep])


def _scatter_vocab(logits: torch.Tensor, layout: HeadLayout, vocab_size: int) -> torch.Tensor:
    """Logits over a draft vocabulary ``[..., V']`` placed by ``layout`` in ``[..., V]``, ``-inf`` elsewhere
    (probability zero: the drafter never proposes those tokens). The leading run of ids is one copy,
    so a call costs about one write of ``V`` floats."""
    if logits.shape[-1] != layout.rows:
        raise QuickdraftError(f"the export's head has {logits.shape[-1]} rows, its manifest names {layout.rows} ids")
    full = torch.full((*logits.shape[:-1], vocab_size), float("-inf"), dtype=logits.dtype)
    full[..., : layout.prefix] = logits[..., : layout.prefix]
    if layout.extra_ids.numel():
        full[..., layout.extra_ids] = logits[..., layout.extra_rows]
    return full


def _fit_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    width = logits.shape[-1]
    if width > vocab_size:
        return logits[..., :vocab_size]
    pad = torch.full((*logits.shape[:-1], vocab_size - width), float("-inf"))
    return torch.cat([logits, pad], dim=-1)
