"""The acceptance-prediction head of SpecDec++ (Huang, Guo & Wang 2024).

A small residual MLP on the draft model's last hidden state ``h_i`` at draft token ``i``:

.. math::

    z_0 = (h_i - \\mu) / \\sigma, \\qquad z_{l+1} = z_l + \\mathrm{SiLU}(W_l z_l + b_l), \\qquad
    \\hat P_i = \\sigma(w^\\top z_L + c)

``P̂_i`` estimates the probability that draft token ``i`` is accepted given that every draft token
before it was, ``E[min(1, p(y_i)/q(y_i))]``. ``μ, σ`` are the training features' per-dimension
mean and standard deviation (stored with the weights), ``L`` the depth; unlike the paper's code,
whose ``[ResBlock(H)] * L`` repeats one block, every layer has its own weights.

A head file (``torch.save`` of plain tensors and strings, loaded with ``weights_only=True``) holds
the weights in float16 and :class:`HeadMetadata`: which draft (and target) it was trained for, a
fingerprint of the draft's weights, and the hash of its training data. :func:`load_head` checks
the file and, when asked, that it belongs to the draft model in use.

References
----------
.. [1] K. Huang, X. Guo, M. Wang, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
   Lengths", arXiv:2405.19715, 2024, Sec. 3.2 (the acceptance prediction head).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quickdraft.errors import QuickdraftError

FORMAT = "quickdraft-acceptance-head"
FORMAT_VERSION = 1


@dataclass
class HeadMetadata:
    """What a head was trained for and on.

    Attributes
    ----------
    draft: name of the draft model (registry name or path) whose hidden states it reads.
    target: name of the target model whose acceptances it predicts.
    draft_fingerprint: :func:`model_fingerprint` of the draft model ("" = unknown).
    data_hash: SHA-256 of the training data (prompts, responses, labels).
    temperature: sampling temperature of the draft tokens and of the labels.
    extra: anything else (training figures, number of examples, ...), JSON-like values only.
    """

    draft: str = ""
    target: str = ""
    draft_fingerprint: str = ""
    data_hash: str = ""
    temperature: float = 1.0
    extra: dict = field(default_factory=dict)


class ResidualBlock(nn.Module):
    """``z + SiLU(W z + b)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.SiLU()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.act(self.linear(z))


class AcceptanceHead(nn.Module):
    """Residual MLP from a hidden state ``[..., H]`` to the logit of acceptance ``[...]``.

    Parameters
    ----------
    hidden_size:
        ``H``, the draft model's hidden size.
    num_layers:
        Number of residual blocks (0 = logistic regression on the normalised state).
    metadata:
        :class:`HeadMetadata`.
    """

    def __init__(self, hidden_size: int, num_layers: int = 1, metadata: HeadMetadata | None = None) -> None:
        super().__init__()
        if hidden_size < 1 or num_layers < 0:
            raise QuickdraftError(f"need hidden_size >= 1 and num_layers >= 0, got {hidden_size}, {num_layers}")
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.metadata = metadata or HeadMetadata()
        self.register_buffer("feature_mean", torch.zeros(hidden_size))
        self.register_buffer("feature_std", torch.ones(hidden_size))
        self.blocks = nn.Sequential(*[ResidualBlock(hidden_size) for _ in range(num_layers)])
        self.out = nn.Linear(hidden_size, 1)

    def set_normalisation(self, features: torch.Tensor) -> None:
        """Set ``μ, σ`` from training features ``[N, H]``."""
        self.feature_mean.copy_(features.float().mean(dim=0))
        self.feature_std.copy_(features.float().std(dim=0).clamp_min(1e-4))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Acceptance logits ``[...]`` of hidden states ``[..., H]``."""
        z = (hidden.float() - self.feature_mean) / self.feature_std
        return self.out(self.blocks(z)).squeeze(-1)

    @torch.inference_mode()
    def accept_prob(self, hidden: torch.Tensor) -> torch.Tensor:
        """``P̂`` for hidden states ``[B, H]`` -> ``[B]`` in ``(0, 1)``."""
        if hidden.shape[-1] != self.hidden_size:
            raise QuickdraftError(
                f"acceptance head mismatch: the head was trained for draft {self.metadata.draft or '?'!r} "
                f"with hidden size {self.hidden_size}, but this draft model's hidden size is {hidden.shape[-1]}; "
                "train a head for this draft with `quickdraft train-head`"
            )
        return torch.sigmoid(self(hidden))

    def check_draft(self, model: nn.Module, name: str | None = None) -> None:
        """Raise :class:`QuickdraftError` unless ``model`` is the draft this head was trained on."""
        hidden = int(getattr(model.config, "hidden_size", -1))
        if hidden != self.hidden_size:
            raise QuickdraftError(
                f"acceptance head mismatch: trained for draft {self.metadata.draft!r} (hidden size "
                f"{self.hidden_size}), given {name or 'a model'} with hidden size {hidden}"
            )
        if self.metadata.draft_fingerprint and model_fingerprint(model) != self.metadata.draft_fingerprint:
            raise QuickdraftError(
                f"acceptance head mismatch: trained for draft {self.metadata.draft!r}, but the weights of "
                f"{name or 'the given draft model'} differ (fingerprint {model_fingerprint(model)[:12]} != "
                f"{self.metadata.draft_fingerprint[:12]}); train a head for this draft with `quickdraft train-head`"
            )


def model_fingerprint(model: nn.Module) -> str:
    """SHA-256 over a model's architecture and (bf16-rounded) input embeddings' first 8192 values.

    Equal for the same weights loaded in bf16 or fp32; different for a different model."""
    cfg = model.config
    digest = hashlib.sha256()
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "intermediate_size"):
        digest.update(f"{key}={getattr(cfg, key, None)};".encode())
    emb = model.get_input_embeddings().weight.detach().reshape(-1)[:8192]
    digest.update(emb.to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def save_head(head: AcceptanceHead, path: str | Path) -> Path:
    """Write ``head`` (float16 weights + metadata) to ``path``; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: (v.half() if v.is_floating_point() and not k.startswith("feature_") else v.float())
             for k, v in head.state_dict().items()}
    payload = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "hidden_size": head.hidden_size,
        "num_layers": head.num_layers,
        "metadata": asdict(head.metadata),
        "state_dict": state,
    }
    torch.save(payload, path)
    return path


def load_head(path: str | Path, draft_name: str | None = None) -> AcceptanceHead:
    """Load a head saved by :func:`save_head`.

    Parameters
    ----------
    path:
        The head file.
    draft_name:
        When given, the name of the draft model in use: a head trained for another draft is an
        error (names are compared after resolving the ``draft`` / ``target`` aliases).
    """
    path = Path(path)
    if not path.is_file():
        raise QuickdraftError(f"acceptance head file not found: {path} (train one with `quickdraft train-head`)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unpickling problem means "not a head file"
        raise QuickdraftError(f"{path} is not a quickdraft acceptance head file ({type(err).__name__}: {err})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise QuickdraftError(f"{path} is not a quickdraft acceptance head file")
    if payload.get("version") != FORMAT_VERSION:
        raise QuickdraftError(f"{path}: head format version {payload.get('version')}, this quickdraft reads {FORMAT_VERSION}")
    meta = HeadMetadata(**payload["metadata"])
    if draft_name is not None and meta.draft and _canonical(draft_name) != _canonical(meta.draft):
        raise QuickdraftError(
            f"acceptance head mismatch: {path} was trained for draft {meta.draft!r}, not {draft_name!r}; "
            "train a head for this draft with `quickdraft train-head`"
        )
    head = AcceptanceHead(int(payload["hidden_size"]), int(payload["num_layers"]), meta)
    head.load_state_dict({k: v.float() for k, v in payload["state_dict"].items()})
    return head.eval()


def _canonical(name: str) -> str:
    try:
        from quickdraft.models import ALIASES
    except Exception:  # pragma: no cover
        return name
    return ALIASES.get(name, name)
