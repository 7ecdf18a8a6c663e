"""An EAGLE-style feature drafter: one decoder layer that predicts the target's next hidden state.

EAGLE (Li et al., 2024) drafts at the level of the target's features. Write ``f_i`` for the target's
last hidden state at position ``i`` (after its final norm: the vector its LM head turns into the
distribution of token ``x_{i+1}``). The drafter reads *pairs*: pair ``i`` is ``f_i`` and the embedding
of ``x_{i+1}``, concatenated and projected back to the hidden width (``fc``). One decoder layer of
the target's own architecture, with its own KV cache over the pairs, maps pair ``i`` to ``g_{i+1}``,
its estimate of ``f_{i+1}``; the target's LM head turns ``g_{i+1}`` into the draft distribution of
``x_{i+2}``. To draft further, the drafter feeds the pair (``g_{i+1}``, embedding of the token it
drafted). After verification the pairs fed with estimates are dropped and the target's true features
of the accepted tokens take their place (:mod:`quickdraft.decoding.feature_drafter`).

The embedding and the LM head are the target's own modules (shared, never trained); ``fc``, the
layer and its norms are the drafter's weights (:mod:`quickdraft.training.feature_drafter` trains
them). A drafter may keep only part of the head (``head_vocab``: the lowest ids and the EOS ids,
as the OpenVINO drafts' ``--draft-vocab``); the other tokens get probability zero, which every
lossless rule handles, and each draft token costs fewer multiply-adds.

The module follows the calling convention of a ``transformers`` causal LM, so
:class:`quickdraft.backends.runner.ModelRunner` owns its KV cache, rolls it back and feeds it token
trees; the only addition is the ``features`` argument, ``[B, m, H]``, one per fed token.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from quickdraft.errors import QuickdraftError

#: the weights file and the metadata file of a saved drafter, inside its directory
WEIGHTS_FILE = "feature_drafter.safetensors"
META_FILE = "feature_drafter.json"
#: a target's trained feature drafter lives in this directory of its cache entry
FEATURE_DRAFTER_DIR = "feature-drafter"


def default_drafter_dir(target: str = "target") -> Path:
    """Where ``quickdraft train-drafter`` saves the feature drafter of ``target`` (registry name,
    alias or directory): its cache entry's :data:`FEATURE_DRAFTER_DIR`."""
    from quickdraft.models import resolve

    path = resolve(target)
    entry = path if path.is_dir() else path.parent
    return entry / FEATURE_DRAFTER_DIR


@dataclass
class FeatureDrafterMeta:
    """What a saved feature drafter is: its target, shape and training (written beside the weights).

    Attributes
    ----------
    target_fingerprint: :func:`quickdraft.models.model_fingerprint` of the target it reads.
    hidden_size, intermediate_size: the layer's widths (the target's hidden size).
    head_vocab: ids of the target's head the drafter keeps (0: all of them).
    training: how it was trained (data, tokens, epochs, losses; free-form).
    """

    target_fingerprint: str
    hidden_size: int
    intermediate_size: int
    head_vocab: int = 0
    training: dict = field(default_factory=dict)


def _layer_config(target_config, intermediate_size: int | None):
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = 1
    cfg.use_cache = True
    if intermediate_size:
        cfg.intermediate_size = int(intermediate_size)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:
        cfg.layer_types = list(layer_types[:1])
    return cfg


class FeatureDraftModel(nn.Module):
    """The feature drafter (see the module docstring) over a target ``transformers`` causal LM.

    Parameters
    ----------
    target:
        The target model; its input embedding and LM head are used as they are (not copied, not
        trained).
    intermediate_size:
        Width of the layer's MLP (default: the target's).
    head_vocab:
        Keep only the head rows of the ``head_vocab`` lowest ids and the EOS ids (0: the whole head).
    eos_ids:
        The target's end-of-sequence ids (kept in a cut head).
    """

    def __init__(self, target: nn.Module, intermediate_size: int | None = None, head_vocab: int = 0,
                 eos_ids: tuple[int, ...] = ()) -> None:
        super().__init__()
        from transformers import AutoModel

        tcfg = target.config
        self.config = _layer_config(tcfg, intermediate_size)
        hidden = int(tcfg.hidden_size)
        inner_cfg = copy.deepcopy(self.config)
        inner_cfg.vocab_size = 1  # the layer stack gets embeddings (inputs_embeds); the target's table is used
        inner_cfg.pad_token_id = None
        self.layers = AutoModel.from_config(inner_cfg)
        self.layers.embed_tokens = None
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        # the target's modules, held outside this module's parameters (never saved, never trained)
        self._target = [target]
        self.vocab_size = int(tcfg.vocab_size)
        self.head_vocab = int(head_vocab or 0)
        self.head_ids: torch.Tensor | None = None
        self._head_weight: torch.Tensor | None = None
        if self.head_vocab:
            from quickdraft.backends.openvino.export import draft_vocab_ids

            self.head_ids = torch.tensor(draft_vocab_ids(self.head_vocab, self.vocab_size, eos_ids), dtype=torch.long)
        from quickdraft.backends.runner import cache_argument

        self._cache_arg = cache_argument(self.layers)

    # -- the target's shared modules -------------------------------------------------------------
    @property
    def target(self) -> nn.Module:
        return self._target[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target.get_input_embeddings()(ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., V]`` of ``hidden`` through the target's head (``-inf`` outside a cut head)."""
        lm_head = self.target.get_output_embeddings()
        if self.head_ids is None:
            return lm_head(hidden)
        if self._head_weight is None:
            weight = getattr(lm_head, "weight", None)
            if weight is None:
                raise QuickdraftError("a feature drafter with a cut head needs the target's head as a plain linear layer")
            self._head_weight = weight.detach()[self.head_ids.to(weight.device)].contiguous()
        part = torch.nn.functional.linear(hidden, self._head_weight.to(hidden.dtype))
        full = torch.full((*part.shape[:-1], self.vocab_size), float("-inf"), dtype=part.dtype, device=part.device)
        full[..., self.head_ids.to(part.device)] = part
        return full

    # -- the forward a ModelRunner calls -----------------------------------------------------------
    def step(self, input_ids: torch.Tensor, features: torch.Tensor, **layer_kwargs):
        """``g`` ``[B, m, H]`` for the pairs (``features``, embedding of ``input_ids``), and the layer
        stack's output (its cache)."""
        dtype = self.fc.weight.dtype
        emb = self.embed(input_ids).to(dtype)
        x = self.fc(torch.cat([emb, features.to(dtype)], dim=-1))
        out = self.layers(inputs_embeds=x, **layer_kwargs)
        return out.last_hidden_state, out

    def forward(self, input_ids: torch.Tensor, attention_mask=None, position_ids=None, use_cache: bool = True,
                cache=None, features: torch.Tensor | None = None, logits_to_keep: int = 0,
                output_hidden_states: bool = False) -> CausalLMOutputWithPast:
        if features is None:
            raise QuickdraftError(
                "the feature drafter reads the target's hidden state of every token it is fed; it was called "
                "without them (a feature drafter cannot take rows that join a running batch)")
        if features.shape[:2] != input_ids.shape:
            raise QuickdraftError(f"features {tuple(features.shape)} do not match the tokens {tuple(input_ids.shape)}")
        hidden, out = self.step(input_ids, features, attention_mask=attention_mask, position_ids=position_ids,
                                use_cache=use_cache, **{self._cache_arg: cache})
        kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        logits = self.head(kept)
        result = CausalLMOutputWithPast(logits=logits, hidden_states=(hidden,))
        result["cache"] = dict(out.items()).get(self._cache_arg)  # the key ModelRunner reads (cache_argument of this forward)
        return result

    # -- files -------------------------------------------------------------------------------------
    def save(self, directory: str | Path, meta: FeatureDrafterMeta) -> Path:
        """Write the drafter's own weights (bfloat16 safetensors) and ``meta`` to ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / META_FILE).write_text(json.dumps(asdict(meta), indent=2) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path, target: nn.Module, head_vocab: int | None = None,
             eos_ids: tuple[int, ...] = ()) -> tuple["FeatureDraftModel", FeatureDrafterMeta]:
        """The drafter saved in ``directory`` over ``target`` (whose fingerprint must match), in the
        target's dtype; ``head_vocab`` overrides the saved head cut (0: the whole head)."""
        from safetensors.torch import load_file

        from quickdraft.models import model_fingerprint

        directory = Path(directory)
        if not (directory / WEIGHTS_FILE).is_file() or not (directory / META_FILE).is_file():
            raise QuickdraftError(f"{directory} holds no feature drafter ({WEIGHTS_FILE} and {META_FILE}); "
                                  "train one with `quickdraft train-drafter`")
        meta = FeatureDrafterMeta(**json.loads((directory / META_FILE).read_text()))
        if int(target.config.hidden_size) != meta.hidden_size:
            raise QuickdraftError(f"the feature drafter in {directory} reads hidden states of width {meta.hidden_size}, "
                                  f"the target's are {int(target.config.hidden_size)}")
        found = model_fingerprint(target)
        if found != meta.target_fingerprint:
            raise QuickdraftError(f"the feature drafter in {directory} was trained on another target "
                                  f"({meta.target_fingerprint}, this one is {found})")
        vocab = meta.head_vocab if head_vocab is None else int(head_vocab)
        model = cls(target, intermediate_size=meta.intermediate_size, head_vocab=vocab, eos_ids=eos_ids)
        missing, unexpected = model.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=False)
        if missing or unexpected:
            raise QuickdraftError(f"the feature drafter in {directory} does not fit: missing {missing}, unexpected {unexpected}")
        dtype = next(target.parameters()).dtype
        return model.to(dtype).eval(), meta
