"""The acceptance-prediction head of SpecDec++ (Huang, Guo & Wang 2024).

A small residual MLP on the draft model's last hidden state ``h_i`` at draft token ``i``, plus,
optionally, a linear term in the draft's own confidence ``s_i`` at that token:

.. math::

    z_0 = (h_i - \\mu) / \\sigma, \\qquad z_{l+1} = z_l + \\mathrm{SiLU}(W_l z_l + b_l), \\qquad
    \\tilde s_i = (s_i - \\mu_s) / \\sigma_s, \\qquad
    \\hat P_i = \\sigma(w^\\top z_L + c + v^\\top \\tilde s_i)

``P̂_i`` estimates the probability that draft token ``i`` is accepted given that every draft token
before it was, ``E[min(1, p(y_i)/q(y_i))]``.

Which state ``h_i`` is (``reads``): ``"fed"`` (the paper's) is the draft's state *at* token ``i``,
computed when ``y_i`` is fed back to draft ``y_{i+1}``, so a token is scored one draft forward after
it is drawn and at least two tokens are drafted before a policy can stop. ``"drawing"`` is the state
whose logits drew ``y_i`` (the state at the token before it), available the moment ``y_i`` is drawn:
the head scores a token at once and a policy may stop after one token, which matters where a
verification of two tokens costs little more than one and the best fixed draft length is 1.

``μ, σ`` are the training features' per-dimension mean and standard deviation (stored with the
weights), ``L`` the depth. With ``shared_blocks`` (the
default of ``quickdraft train-head``, as the paper's code, whose ``[ResBlock(H)] * L`` repeats one
block) every layer is the same block, ``W_l = W``; otherwise each layer has its own weights.

``s_i = baseline_design(confidence_features(q_i, y_i))`` (``num_stats = 4``: top probability,
entropy, ``log`` top probability and ``log q_i(y_i)`` of the draft's temperature-1 distribution
``q_i`` that drew ``y_i``), standardised by the training set's ``μ_s, σ_s``. On held-out data these
four numbers predict acceptance better than the hidden state alone, so the head reads both. A head
with ``num_stats = 0`` (the default, and every head file without ``num_stats``) is the paper's
head, without the ``v`` term.

A head file (``torch.save`` of plain tensors and strings, loaded with ``weights_only=True``) holds
the weights in float16 (the normalisation buffers ``feature_*`` / ``stats_*`` and the ``v`` weights
in float32), ``num_stats`` and :class:`HeadMetadata`: which draft (and target) it was trained for, a
fingerprint of the draft's weights, and the hash of its training data. :func:`load_head` checks
the file and, when asked, that it belongs to the draft model in use; a file without ``num_stats``
is a head with ``num_stats = 0``, one without ``reads`` a head that reads the ``"fed"`` state.

References
----------
.. [1] K. Huang, X. Guo, M. Wang, "SpecDec++: Boosting Speculative Decoding via Adaptive Candidate
   Lengths", arXiv:2405.19715, 2024, Sec. 3.2 (the acceptance prediction head).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from quickdraft.errors import QuickdraftError
from quickdraft.models import model_fingerprint

FORMAT = "quickdraft-acceptance-head"
FORMAT_VERSION = 1
FLOAT32_PREFIXES = ("feature_", "stats_")  # state-dict keys saved in float32 (normalisation, the v term)
READS = ("fed", "drawing")  # which draft state a head scores a token from (module docstring)


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


# ---------------------------------------------------------------------------------------------
# the draft's confidence (pure functions)
# ---------------------------------------------------------------------------------------------


def confidence_features(raw_draft_probs: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """The draft's own confidence at each drafted token, the input of the logistic baseline.

    Parameters
    ----------
    raw_draft_probs:
        ``[n, V]`` the draft's temperature-1 (unwarped) next-token distributions.
    draft_ids:
        ``[n]`` the drafted tokens.

    Returns
    -------
    ``[n, 3]`` float32: top probability, entropy (nats), probability of the drafted token.

    >>> confidence_features(torch.tensor([[0.5, 0.5]]), torch.tensor([1])).tolist()[0][0]
    0.5
    """
    probs = raw_draft_probs.float()
    top = probs.max(dim=-1).values
    entropy = -(probs * probs.clamp_min(1e-30).log()).sum(dim=-1)
    chosen = probs.gather(-1, draft_ids.long().unsqueeze(-1)).squeeze(-1)
    return torch.stack([top, entropy, chosen], dim=-1)


def baseline_design(stats: torch.Tensor) -> torch.Tensor:
    """Inputs of the logistic baseline from :func:`confidence_features` ``[N, 3]``: top probability,
    entropy, ``log`` top probability and ``log`` probability of the drafted token -> ``[N, 4]``
    (the head's confidence inputs ``s``, :data:`NUM_CONFIDENCE_STATS` of them).

    >>> [round(v, 4) for v in baseline_design(torch.tensor([[0.5, 0.6931, 0.5]])).tolist()[0]]
    [0.5, 0.6931, -0.6931, -0.6931]
    """
    top, entropy, chosen = stats.float().unbind(dim=-1)
    return torch.stack([top, entropy, top.clamp_min(1e-6).log(), chosen.clamp_min(1e-6).log()], dim=-1)


NUM_CONFIDENCE_STATS = 4  # columns of :func:`baseline_design`


class ResidualBlock(nn.Module):
    """``z + SiLU(W z + b)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = nn.SiLU()

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z + self.act(self.linear(z))


class AcceptanceHead(nn.Module):
    """Residual MLP from a hidden state ``[..., H]`` (and, with ``num_stats > 0``, the draft's
    confidence inputs ``[..., num_stats]``) to the logit of acceptance ``[...]``.

    Parameters
    ----------
    hidden_size:
        ``H``, the draft model's hidden size.
    num_layers:
        Number of residual blocks (0 = logistic regression on the normalised state).
    metadata:
        :class:`HeadMetadata`.
    num_stats:
        Number of confidence inputs ``s`` (0 = none, the paper's head; 4 = :func:`baseline_design`
        of :func:`confidence_features`). With ``num_stats > 0`` the logit gains ``v^T (s - μ_s) / σ_s``
        (``stats_out``, no bias) and every call must pass ``stats``.
    shared_blocks:
        One residual block applied ``num_layers`` times (the paper's code) instead of ``num_layers``
        blocks of their own.
    reads:
        ``"fed"`` (the paper's: the state at the token) or ``"drawing"`` (the state that drew it);
        see the module docstring. :class:`quickdraft.decoding.policies.SpecDecPP` follows it.
    """

    def __init__(self, hidden_size: int, num_layers: int = 1, metadata: HeadMetadata | None = None,
                 num_stats: int = 0, shared_blocks: bool = False, reads: str = "fed") -> None:
        super().__init__()
        if hidden_size < 1 or num_layers < 0 or num_stats < 0:
            raise QuickdraftError(
                f"need hidden_size >= 1, num_layers >= 0 and num_stats >= 0, got {hidden_size}, {num_layers}, {num_stats}"
            )
        if reads not in READS:
            raise QuickdraftError(f"a head reads one of the states {', '.join(READS)}, got {reads!r}")
        self.reads = reads
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.num_stats = int(num_stats)
        self.shared_blocks = bool(shared_blocks) and self.num_layers > 0
        self.metadata = metadata or HeadMetadata()
        self.register_buffer("feature_mean", torch.zeros(hidden_size))
        self.register_buffer("feature_std", torch.ones(hidden_size))
        if self.shared_blocks:  # one block, applied num_layers times
            self.block = ResidualBlock(hidden_size)
        else:
            self.blocks = nn.Sequential(*[ResidualBlock(hidden_size) for _ in range(num_layers)])
        self.out = nn.Linear(hidden_size, 1)
        if self.num_stats:  # absent otherwise: a num_stats = 0 head's state dict is the paper's head's
            self.register_buffer("stats_mean", torch.zeros(self.num_stats))
            self.register_buffer("stats_std", torch.ones(self.num_stats))
            self.stats_out = nn.Linear(self.num_stats, 1, bias=False)

    def set_normalisation(self, features: torch.Tensor, stats: torch.Tensor | None = None) -> None:
        """Set ``μ, σ`` from training features ``[N, H]`` and, when given, ``μ_s, σ_s`` from training
        confidence inputs ``[N, num_stats]`` (``stats=None`` leaves ``μ_s, σ_s`` as they are)."""
        self.feature_mean.copy_(features.float().mean(dim=0))
        self.feature_std.copy_(features.float().std(dim=0).clamp_min(1e-4))
        if stats is not None:
            self._check_stats(stats)
            self.stats_mean.copy_(stats.float().mean(dim=0))
            self.stats_std.copy_(stats.float().std(dim=0).clamp_min(1e-4))

    def _check_stats(self, stats: torch.Tensor | None, hidden: torch.Tensor | None = None) -> None:
        if not self.num_stats:
            if stats is not None:
                raise QuickdraftError("this acceptance head has no confidence inputs (num_stats = 0); pass stats=None")
            return
        if stats is None:
            raise QuickdraftError(
                f"this acceptance head also reads the draft's confidence (num_stats = {self.num_stats}): pass "
                "stats = baseline_design(confidence_features(draft_probs, token)) with the hidden state"
            )
        if stats.shape[-1] != self.num_stats or (hidden is not None and stats.shape[:-1] != hidden.shape[:-1]):
            raise QuickdraftError(
                f"confidence inputs of shape {tuple(stats.shape)} do not fit this head: need [..., {self.num_stats}]"
                + ("" if hidden is None else f" with the hidden states' leading shape {tuple(hidden.shape[:-1])}")
            )

    def forward(self, hidden: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """Acceptance logits ``[...]`` of hidden states ``[..., H]`` and, for a head with
        ``num_stats > 0``, confidence inputs ``stats [..., num_stats]`` (required then)."""
        self._check_stats(stats, hidden)
        z = (hidden.float() - self.feature_mean) / self.feature_std
        if self.shared_blocks:
            for _ in range(self.num_layers):
                z = self.block(z)
        else:
            z = self.blocks(z)
        logit = self.out(z).squeeze(-1)
        if self.num_stats:
            zs = (stats.float() - self.stats_mean) / self.stats_std
            logit = logit + self.stats_out(zs).squeeze(-1)
        return logit

    @torch.inference_mode()
    def accept_prob(self, hidden: torch.Tensor, stats: torch.Tensor | None = None) -> torch.Tensor:
        """``P̂`` for hidden states ``[B, H]`` (and confidence inputs ``[B, num_stats]`` when the head
        has them) -> ``[B]`` in ``(0, 1)``."""
        if hidden.shape[-1] != self.hidden_size:
            raise QuickdraftError(
                f"acceptance head mismatch: the head was trained for draft {self.metadata.draft or '?'!r} "
                f"with hidden size {self.hidden_size}, but this draft model's hidden size is {hidden.shape[-1]}; "
                "train a head for this draft with `quickdraft train-head`"
            )
        return torch.sigmoid(self(hidden, stats))

    def check_draft(self, model: nn.Module, name: str | None = None) -> None:
        """Raise :class:`QuickdraftError` unless ``model`` is the draft this head was trained on."""
        hidden = int(getattr(model.config, "hidden_size", -1))
        if hidden != self.hidden_size:
            raise QuickdraftError(
                f"acceptance head mismatch: trained for draft {self.metadata.draft!r} (hidden size "
                f"{self.hidden_size}), given {name or 'a model'} with hidden size {hidden}"
            )
        # a torch model is fingerprinted here; another backend's stand-in carries its weights' print
        found = model_fingerprint(model) if isinstance(model, nn.Module) else getattr(model, "fingerprint", None)
        if self.metadata.draft_fingerprint and found != self.metadata.draft_fingerprint:
            raise QuickdraftError(
                f"acceptance head mismatch: trained for draft {self.metadata.draft!r}, but the weights of "
                f"{name or 'the given draft model'} differ (fingerprint {str(found)[:12]} != "
                f"{self.metadata.draft_fingerprint[:12]}); train a head for this draft with `quickdraft train-head`"
            )


def save_head(head: AcceptanceHead, path: str | Path) -> Path:
    """Write ``head`` to ``path``; returns the path.

    Weights in float16, except the keys starting with :data:`FLOAT32_PREFIXES` (the normalisation
    buffers ``feature_*``, ``stats_*`` and the confidence weights ``stats_out``), kept in float32."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: (v.half() if v.is_floating_point() and not k.startswith(FLOAT32_PREFIXES) else v.float())
             for k, v in head.state_dict().items()}
    payload = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "hidden_size": head.hidden_size,
        "num_layers": head.num_layers,
        "num_stats": head.num_stats,
        "shared_blocks": head.shared_blocks,
        "reads": head.reads,
        "metadata": asdict(head.metadata),
        "state_dict": state,
    }
    torch.save(payload, path)
    return path


def load_head(path: str | Path, draft_name: str | None = None) -> AcceptanceHead:
    """Load a head saved by :func:`save_head` (a file without ``num_stats`` is a head
    with ``num_stats = 0``, the paper's head without confidence inputs; one without
    ``shared_blocks`` has a block of its own per layer; one without ``reads`` reads the ``"fed"``
    state).

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
    head = AcceptanceHead(int(payload["hidden_size"]), int(payload["num_layers"]), meta,
                          num_stats=int(payload.get("num_stats", 0)),
                          shared_blocks=bool(payload.get("shared_blocks", False)),
                          reads=str(payload.get("reads", "fed")))
    head.load_state_dict({k: v.float() for k, v in payload["state_dict"].items()})
    return head.eval()


def _canonical(name: str) -> str:
    try:
        from quickdraft.models import ALIASES
    except Exception:  # pragma: no cover
        return name
    return ALIASES.get(name, name)
