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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from quickdraft.errors import QuickdraftError
from quickdraft.sampling import check_finite


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
        self.reset(0)

    # -- state -----------------------------------------------------------------------------------
    def reset(self, batch_size: int) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.slot_pos = torch.empty(batch_size, 0, dtype=torch.long, device=self.device)  # [B, L], -1 = hole
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=self.device)  # [B] valid tokens per row

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
        """
        b, m = tokens.shape
        if b != self.batch_size:
            raise QuickdraftError(f"{self.name}: batch of {b} rows, cache has {self.batch_size}")
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
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            output_hidden_states=output_hidden,
        )
        self.cache = out.past_key_values
        self.lengths = self.lengths + valid.long().sum(dim=-1)
        self.num_forwards += 1
        logits = out.logits.float()
        live = valid[:, -1]  # rows whose newest column is a real token (others are padding)
        check_finite(logits[live], f"the {self.name} model")
        hidden = None
        if output_hidden:
            hidden = out.hidden_states[-1]
            if logits_to_keep:
                hidden = hidden[:, -logits_to_keep:]
        return ForwardOutput(logits=logits, hidden=hidden)

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
