"""A Hugging Face causal LM with a batched KV cache that can append k tokens and roll back.

The cache holds ``L`` *slots* per row, the same ``L`` for every row of the batch. Each slot is
either valid (a token of that row's sequence, at some position) or a hole (padding, or a token that
was rolled back while another row still needed the slots after it). Holes are masked out of
attention and never read again; the model sees, for every valid slot, the rotary position of the
token in its own row. So rows can accept different numbers of draft tokens in the same step without
any copying:

    row 0:  [p p a b c]  +  [d e]   valid, lengths[0] = 5
    row 1:  [_ p p a b]  +  [d _]   row 1 rejected ``e``: its slot becomes a hole, lengths[1] = 5

``truncate(new_lengths)`` turns every slot at a position ``>= new_lengths[row]`` into a hole and then
crops the trailing slots that are holes in every row, so for ``B = 1`` a roll-back is a plain crop.

Token trees: ``begin_tree`` / ``forward_tree`` / ``commit_tree`` append tree nodes with per-node
positions and a 4D tree mask (boolean for SDPA, additive for eager attention), then keep one path
(see :mod:`quickdraft.decoding.tree_decoding`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from quickdraft.errors import QuickdraftError
from quickdraft.verification.sampling import check_finite


def cache_argument(model: torch.nn.Module) -> str:
    """The name under which ``model.forward`` takes (and its output returns) the KV cache.

    Current ``transformers`` names it ``cache`` and deprecates ``past_key_values`` with a
    ``FutureWarning`` on every call; earlier 5.x releases only know ``past_key_values``.
    """
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def row_index(runner, rows: list[int] | torch.Tensor) -> torch.Tensor:
    """``rows`` as a ``[n]`` int64 index into ``runner``'s batch, for ``select_rows``; refused while a
    tree session is open or where a row is out of range."""
    if runner.tree_start is not None:
        raise QuickdraftError(f"{runner.name}: select_rows while a tree session is open")
    index = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= runner.batch_size):
        raise QuickdraftError(f"{runner.name}: rows {index.tolist()} out of range for a batch of {runner.batch_size}")
    return index


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [B, m, V] float32 (only the positions asked for)
    hidden: torch.Tensor | None  # [B, m, H] last hidden states when requested


class ModelRunner:
    """Own one model's KV cache for a batch of sequences.

    Parameters
    ----------
    model:
        A ``transformers`` causal LM in eval mode.
    name:
        Used in error messages ("target", "draft").
    """

    def __init__(self, model: torch.nn.Module, name: str = "model") -> None:
        self.model = model
        self.name = name
        self.device = next(model.parameters()).device
        config = model.config
        self.max_positions = int(getattr(config, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.num_forwards = 0
        self.cache_arg = cache_argument(model)
        #: keep the final hidden states of every forward's tokens (:attr:`recent_hidden`), for a
        #: drafter that reads the target's features (:mod:`quickdraft.decoding.feature_drafter`)
        self.record_hidden = False
        self.reset(0)

    def sibling(self) -> "ModelRunner":
        """A runner over the same weights with an empty cache of its own (a server's batch)."""
        return ModelRunner(self.model, self.name)

    def cost_identity(self) -> dict | None:
        """What decides this runner's forward times (:func:`quickdraft.backends.costs.cost_key`):
        the weights' files, their dtypes and the layers' kinds (quantised or packed), torch's
        version and threads; ``None`` for a model without files."""
        from quickdraft.backends.costs import path_identity

        weights = path_identity(getattr(self.model, "name_or_path", "") or "")
        if weights is None:
            return None
        return {"runtime": f"torch {torch.__version__}", "weights": weights, "device": str(self.device),
                "dtypes": sorted({str(p.dtype) for p in self.model.parameters()}),
                "layers": sorted({type(m).__name__ for m in self.model.modules() if not list(m.children())}),
                "threads": torch.get_num_threads()}

    # -- state -----------------------------------------------------------------------------------
    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.long, device=self.device)  # [B, L], -1 = hole
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # [B] valid tokens per row
        self.tree_start: int | None = None  # first slot of the open tree block (see begin_tree)
        #: with ``record_hidden``: the last forward's final hidden states ``[B, m, H]`` and the position
        #: of each column (``-1``: padding, or a tree node that was not kept)
        self.recent_hidden: torch.Tensor | None = None
        self.recent_positions: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.slot_pos.shape[0]

    @property
    def num_slots(self) -> int:
        return self.slot_pos.shape[1]

    # -- forward ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        logits_to_keep: int = 0,
        output_hidden: bool = False,
        features: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Append a block of tokens to every row and return their logits.

        Parameters
        ----------
        tokens:
            ``[B, m]`` int64 token ids.
        valid:
            ``[B, m]`` bool; ``False`` marks padding inside the block. Padding must come *before* a
            row's valid tokens (left-padded), so that the last column is every row's newest token.
        logits_to_keep:
            Return logits for the last ``logits_to_keep`` columns only (0 = all ``m``).
        output_hidden:
            Also return the final hidden states of the same columns.
        features:
            ``[B, m, H]`` passed to the model with the tokens (a feature drafter's input,
            :mod:`quickdraft.decoding.feature_model`).
        """
        b, m = tokens.shape
        if b != self.batch_size:
            raise QuickdraftError(f"{self.name}: batch of {b} rows, cache has {self.batch_size}")
        if self.tree_start is not None:
            raise QuickdraftError(f"{self.name}: forward() while a tree session is open; commit_tree() first")
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        valid = valid.to(self.device)
        offsets = valid.long().cumsum(dim=-1) - 1  # [B, m]
        positions = self.lengths.unsqueeze(1) + offsets.clamp_min(0)  # [B, m]
        if int(positions.max()) >= self.max_positions:
            raise QuickdraftError(
                f"{self.name}: context overflow: position {int(positions.max())} exceeds the model's "
                f"maximum of {self.max_positions} tokens; shorten the prompt or max_new_tokens"
            )
        new_slot_pos = torch.where(valid, positions, torch.full_like(positions, -1))
        self.slot_pos = torch.cat([self.slot_pos, new_slot_pos], dim=1)
        attention_mask = (self.slot_pos >= 0).long()  # [B, L + m]
        out = self.model(
            input_ids=tokens.to(self.device),
            attention_mask=attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_arg: self.cache},
            logits_to_keep=logits_to_keep,
            output_hidden_states=output_hidden or self.record_hidden,
            **({} if features is None else {"features": features.to(self.device)}),
        )
        self.cache = out[self.cache_arg]
        if self.record_hidden:
            self.recent_hidden = out.hidden_states[-1]
            self.recent_positions = new_slot_pos
        self.lengths = self.lengths + valid.long().sum(dim=-1)
        self.num_forwards += 1
        logits = out.logits.float()
        live = valid[:, -1]  # rows whose newest column is a real token (others are padding)
        check_finite(logits, f"the {self.name} model", rows=live)
        hidden = None
        if output_hidden:
            hidden = out.hidden_states[-1]
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
        return ForwardOutput(logits=logits, hidden=hidden)

    # -- token trees -----------------------------------------------------------------------------
    # A tree session appends the nodes of a token tree after the committed cache (the *tree block*,
    # slots ``tree_start ..``). Node slots carry the position ``lengths + depth`` of their own path and
    # see the committed prefix (its valid slots) plus the tree-block slots their tree mask allows.
    # ``lengths`` does not move until :meth:`commit_tree` keeps one path; a plain :meth:`forward`
    # is refused while a session is open (its padding mask would let tokens see every node).

    def begin_tree(self) -> None:
        """Open a tree session: later :meth:`forward_tree` calls append to one tree block."""
        if self.tree_start is not None:
            raise QuickdraftError(f"{self.name}: a tree session is already open")
        self.tree_start = self.num_slots

    @property
    def tree_size(self) -> int:
        """Slots in the open tree block (0 without a session)."""
        return 0 if self.tree_start is None else self.num_slots - self.tree_start

    def _mask_value_format(self) -> str:
        impl = getattr(self.model.config, "_attn_implementation", "sdpa") or "sdpa"
        if impl not in ("sdpa", "eager"):
            raise QuickdraftError(f"{self.name}: tree attention supports the sdpa and eager attention, not {impl!r}")
        return impl

    @torch.inference_mode()
    def forward_tree(
        self,
        tokens: torch.Tensor,
        depths: torch.Tensor,
        tree_mask: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        output_hidden: bool = False,
        features: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """Append ``m`` tree nodes per row to the open tree block and return all their logits.

        Parameters
        ----------
        tokens:
            ``[B, m]`` int64 node tokens.
        depths:
            ``[B, m]`` int64 offsets: a node's rotary position is ``lengths + depths`` (the root of a
            target tree, which continues the committed sequence, has depth 0).
        tree_mask:
            ``[B, m, T + m]`` bool, ``T`` = :attr:`tree_size` before the call: which tree-block slots
            (earlier ones, then these ``m``) each new node attends to — its ancestors and itself.
            The diagonal is forced on. The committed prefix is visible wherever its slots are valid.
        valid:
            ``[B, m]`` bool; ``False`` marks padding nodes (their slots are holes from the start).
        features:
            As for :meth:`forward`.

        Worked example (one row, committed length 10): the tree ``root -> {a, b}, a -> {c}`` fed
        at once as ``[root, a, b, c]`` has depths ``[0, 1, 1, 2]`` (positions 10, 11, 11, 12) and the
        mask rows ``root: [1 0 0 0]``, ``a: [1 1 0 0]``, ``b: [1 0 1 0]``, ``c: [1 1 0 1]``.
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
        if valid is None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
        valid = valid.to(self.device)
        positions = self.lengths.unsqueeze(1) + depths.to(self.device)  # [B, m]
        if int(positions.max()) >= self.max_positions:
            raise QuickdraftError(
                f"{self.name}: context overflow: position {int(positions.max())} exceeds the model's "
                f"maximum of {self.max_positions} tokens; shorten the prompt or max_new_tokens"
            )
        prefix_visible = self.slot_pos[:, : self.tree_start] >= 0  # [B, P]
        self.slot_pos = torch.cat([self.slot_pos, torch.where(valid, positions, -1)], dim=1)
        block = tree_mask.to(self.device, torch.bool).clone()  # [B, m, T + m]
        block[:, :, :t] &= self.slot_pos[:, self.tree_start : self.tree_start + t].unsqueeze(1) >= 0
        block[:, :, t:] &= valid.unsqueeze(1)
        block[:, :, t:] |= torch.eye(m, dtype=torch.bool, device=self.device)
        allowed = torch.cat([prefix_visible.unsqueeze(1).expand(b, m, -1), block], dim=2)  # [B, m, L]
        allowed = allowed.unsqueeze(1)  # [B, 1, m, L]
        if self._mask_value_format() == "eager":
            dtype = next(self.model.parameters()).dtype
            mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
        else:  # SDPA: boolean, True = attend
            mask = allowed
        out = self.model(
            input_ids=tokens.to(self.device),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_arg: self.cache},
            output_hidden_states=output_hidden or self.record_hidden,
            **({} if features is None else {"features": features.to(self.device)}),
        )
        self.cache = out[self.cache_arg]
        if self.record_hidden:
            # one session may feed several blocks (a draft's layers): keep them all, in slot order
            fresh = out.hidden_states[-1]
            fresh_pos = torch.where(valid, positions, -1)
            if t and self.recent_hidden is not None and self.recent_hidden.shape[1] == t:
                fresh = torch.cat([self.recent_hidden, fresh], dim=1)
                fresh_pos = torch.cat([self.recent_positions, fresh_pos], dim=1)
            self.recent_hidden, self.recent_positions = fresh, fresh_pos
        self.num_forwards += 1
        logits = out.logits.float()
        check_finite(logits, f"the {self.name} model", rows=valid)
        hidden = out.hidden_states[-1] if output_hidden else None
        return ForwardOutput(logits=logits, hidden=hidden)

    def commit_tree(self, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Close the tree session, keeping one path of tree-block slots per row.

        Parameters
        ----------
        keep:
            ``[B, P]`` int64 tree-block slot indices (0 = the block's first slot), in path order;
            row ``b`` keeps its first ``counts[b]`` entries, which must hold the positions
            ``lengths[b], lengths[b] + 1, …`` (a root-to-node path of the tree).
        counts:
            ``[B]`` int64 slots kept per row (0 drops the whole block).

        The kept slots' keys and values are gathered to the front of the block (one small copy per
        layer) and everything after them is cropped, so the cache never accumulates dead nodes;
        a shorter row's tail inside the block becomes holes. ``lengths += counts``.
        """
        if self.tree_start is None:
            raise QuickdraftError(f"{self.name}: commit_tree without an open tree session")
        start = self.tree_start
        b = self.batch_size
        keep = keep.to(self.device).long().reshape(b, -1)
        counts = counts.to(self.device).long()
        width = int(counts.max()) if b else 0
        keep = keep[:, :width]
        cols = torch.arange(width, device=self.device).unsqueeze(0)
        live = cols < counts.unsqueeze(1)  # [B, P]
        if width and (keep[live].min() < 0 or keep[live].max() >= self.tree_size):
            raise QuickdraftError(f"{self.name}: commit_tree slot index outside the tree block")
        index = torch.where(live, keep, 0)  # [B, P]
        block_pos = self.slot_pos[:, start:]
        kept_pos = block_pos.gather(1, index)
        expected = self.lengths.unsqueeze(1) + cols
        if bool((live & (kept_pos != expected)).any()):
            raise QuickdraftError(f"{self.name}: commit_tree must keep a root-to-node path (consecutive positions)")
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", True) or not hasattr(layer, "keys"):
                continue
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [B, H, L, D]
                idx = (start + index).view(b, 1, width, 1).expand(-1, states.shape[1], -1, states.shape[-1])
                setattr(layer, name, torch.cat([states[:, :, :start], states.gather(2, idx)], dim=2))
        self.slot_pos = torch.cat([self.slot_pos[:, :start], torch.where(live, kept_pos, -1)], dim=1)
        if self.record_hidden and self.recent_hidden is not None and self.recent_hidden.shape[1] == block_pos.shape[1]:
            # the recorded tree block becomes the kept path
            hidden = self.recent_hidden
            self.recent_hidden = hidden.gather(1, index.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
            self.recent_positions = torch.where(live, kept_pos, -1)
        self.lengths = self.lengths + counts
        self.tree_start = None
        self.truncate(self.lengths)  # crops the slots that are holes in every row

    # -- rows ------------------------------------------------------------------------------------
    # Continuous batching: rows join (``add_rows``) and leave (``remove_rows``) between forwards. A new
    # row starts with every existing slot a hole; its tokens are appended by the next ``forward``.

    def _cache_layers(self):
        for layer in self.cache.layers:
            if getattr(layer, "is_initialized", True) and getattr(layer, "keys", None) is not None \
                    and layer.keys.dim() == 4:
                yield layer

    def add_rows(self, n: int) -> None:
        """Append ``n`` empty rows (all their slots are holes) to the batch."""
        if n <= 0:
            return
        if self.tree_start is not None:
            raise QuickdraftError(f"{self.name}: add_rows while a tree session is open")
        for layer in self._cache_layers():
            for name in ("keys", "values"):
                states = getattr(layer, name)
                setattr(layer, name, torch.cat([states, states.new_zeros((n, *states.shape[1:]))], dim=0))
        self.slot_pos = torch.cat(
            [self.slot_pos, torch.full((n, self.num_slots), -1, dtype=torch.long, device=self.device)], dim=0)
        self.lengths = torch.cat([self.lengths, torch.zeros(n, dtype=torch.long, device=self.device)])

    def remove_rows(self, rows: list[int] | torch.Tensor) -> None:
        """Drop the given rows from the batch (the others keep their order), then the slots that
        are holes in every remaining row."""
        if self.tree_start is not None:
            raise QuickdraftError(f"{self.name}: remove_rows while a tree session is open")
        drop = {int(r) for r in (rows.tolist() if isinstance(rows, torch.Tensor) else rows)}
        self.select_rows([r for r in range(self.batch_size) if r not in drop])
        self.compact(all_hole_only=True)

    def select_rows(self, rows: list[int] | torch.Tensor) -> None:
        """Make the batch the given rows, in that order: row ``i`` becomes a copy of row ``rows[i]``
        (a row may be repeated: forks of one context, as :func:`quickdraft.adaptive.replay.draft_chains`
        drafts from many starts of one text at once)."""
        index = row_index(self, rows).to(self.device)
        for layer in self._cache_layers():
            for name in ("keys", "values"):
                setattr(layer, name, getattr(layer, name).index_select(0, index))
        self.slot_pos = self.slot_pos.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)

    @property
    def num_holes(self) -> int:
        """Slots that are holes, summed over rows."""
        return int((self.slot_pos < 0).sum())

    def compact(self, all_hole_only: bool = False) -> None:
        """Drop holes from the cache: every row keeps its valid slots in order, right-aligned and
        left-padded with holes to the longest row (one gather per layer).

        Parameters
        ----------
        all_hole_only:
            Only drop the slots that are holes in every row (a slice when they lead or trail).
        """
        if self.tree_start is not None:
            raise QuickdraftError(f"{self.name}: compact while a tree session is open")
        valid = self.slot_pos >= 0  # [B, L]
        if all_hole_only:
            used = valid.any(dim=0)
            if bool(used.all()):
                return
            index = used.nonzero().squeeze(1)
            for layer in self._cache_layers():
                for name in ("keys", "values"):
                    setattr(layer, name, getattr(layer, name).index_select(2, index))
            self.slot_pos = self.slot_pos.index_select(1, index)
            return
        width = int(valid.sum(dim=1).max()) if self.batch_size else 0
        if width == self.num_slots:
            return
        # stable order: holes first, then the valid slots in their order; keep the last `width`
        order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)[:, self.num_slots - width:]  # [B, W]
        b = self.batch_size
        for layer in self._cache_layers():
            for name in ("keys", "values"):
                states = getattr(layer, name)  # [B, H, L, D]
                idx = order.view(b, 1, width, 1).expand(-1, states.shape[1], -1, states.shape[-1])
                setattr(layer, name, states.gather(2, idx))
        self.slot_pos = self.slot_pos.gather(1, order)

    def truncate(self, new_lengths: torch.Tensor) -> None:
        """Roll every row back to its first ``new_lengths[row]`` tokens (``[B]`` int64)."""
        new_lengths = new_lengths.to(self.device)
        if (new_lengths > self.lengths).any():
            raise QuickdraftError(f"{self.name}: cannot truncate a row beyond its length")
        self.slot_pos = torch.where(self.slot_pos < new_lengths.unsqueeze(1), self.slot_pos, -1)
        self.lengths = new_lengths.clone()
        used = (self.slot_pos >= 0).any(dim=0).nonzero()
        keep = int(used.max()) + 1 if used.numel() else 0
        remove = self.num_slots - keep
        if remove > 0:
            self.cache.crop(-remove)
            self.slot_pos = self.slot_pos[:, :keep]
