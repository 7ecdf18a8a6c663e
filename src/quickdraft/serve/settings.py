"""Speculation settings of a served request: the body's ``"speculative"`` object, merged over the
server's defaults (the ``quickdraft serve`` options), and what a batch of requests must share.

Requests with equal :class:`StepKey` share one batch (one engine step drafts, verifies and commits
all their rows); requests with different settings run in separate batches that the scheduler
steps in turn (:mod:`quickdraft.serve.scheduler`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quickdraft.errors import QuickdraftError
from quickdraft.methods import POLICY_NAMES, MethodSpec, build_method
from quickdraft.decoding.policies import MAX_DRAFT_LENGTH
from quickdraft.verification.sampling import SamplingParams

#: methods the server runs. Not served: token trees (``tree``, ERSD with several candidates), whose
#: rows cannot join a running batch. ``rest`` and ``rest_sd`` need the server's ``--datastore``.
SERVED_METHODS: tuple[str, ...] = ("ar", "sd", "ngram", "ngram_sd", "rest", "rest_sd", "phrase_sd", "amusd", "fsd",
                                   "typical", "ersd", "lantern", "cd", "scd")
#: the largest LANTERN neighbourhood a request may ask for (each drafted token's row holds k ids)
MAX_LANTERN_K = 4096
POLICIES: tuple[str, ...] = POLICY_NAMES


class SpeculativeSettings(BaseModel):
    """The request body's ``"speculative"`` object; every field is optional (server default).

    Attributes
    ----------
    method: one of :data:`SERVED_METHODS`.
    k: draft length (the most tokens per step for ``confidence`` / ``specdecpp``).
    policy: draft-length policy, one of :data:`POLICIES` (``specdecpp`` uses the server's ``--head``).
    threshold: FSD divergence threshold (>= 0).
    divergence: FSD divergence (``js``, ``jsd``, ``kl``, ``kl_reverse``, ``tv``, ``topk_*``, ``topp_*``;
        :mod:`quickdraft.verification.divergences`); ``js`` is FSD's "JS", ``jsd`` the textbook Jensen–Shannon.
    hybrid: FSD with the lossless test above the threshold.
    drafts: ``auto``, ``greedy`` or ``sampled`` (fsd and typical).
    epsilon, delta: typical acceptance's posterior threshold and alpha.
    stop_threshold: ``specdecpp``'s threshold h, ``confidence``'s p_min (in [0, 1]).
    lantern_k, lantern_delta: ``lantern``'s neighbourhood size (at most :data:`MAX_LANTERN_K`) and
        total-variation budget in [0, 1].
    cd_alpha, cd_beta: ``cd`` and ``scd``'s plausibility cut in [0, 1] and amateur weight (>= 0).
    """

    model_config = ConfigDict(extra="forbid")

    method: str | None = None
    k: int | None = Field(default=None, ge=1, le=MAX_DRAFT_LENGTH)
    policy: Literal["constant", "heuristic", "confidence", "specdecpp", "cost", "auto"] | None = None
    threshold: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    divergence: str | None = None
    hybrid: bool | None = None
    drafts: Literal["auto", "greedy", "sampled"] | None = None
    epsilon: float | None = Field(default=None, gt=0.0, le=1.0)
    delta: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    stop_threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    lantern_k: int | None = Field(default=None, ge=1, le=MAX_LANTERN_K)
    lantern_delta: float | None = Field(default=None, ge=0.0, le=1.0)
    cd_alpha: float | None = Field(default=None, ge=0.0, le=1.0)
    cd_beta: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)

    @field_validator("method")
    @classmethod
    def _served_method(cls, value: str | None) -> str | None:
        if value is not None and value not in SERVED_METHODS:
            raise ValueError(
                f"unknown or unserved method {value!r}; the server runs {', '.join(SERVED_METHODS)} "
                "(token trees are not served)"
            )
        return value


@dataclass(frozen=True)
class ServeDefaults:
    """The server's speculation defaults (``quickdraft serve`` options); see :class:`SpeculativeSettings`.

    ``head`` is the acceptance head of ``policy="specdecpp"`` (a file on the server; a request can
    choose the policy but never a path). ``fsd_raw``, ``divergence_top_k``, ``divergence_top_p`` and
    ``phrase_sd``'s pool settings (``phrase_len``, ``phrase_pool``, ``phrase_max_draft``) are server-wide.
    ``policy`` defaults to ``constant`` here, as in :meth:`quickdraft.pipeline.Pipeline.generate`:
    ``quickdraft serve`` passes its ``--policy``, ``auto`` unless given.
    """

    method: str = "sd"
    k: int = 4
    policy: str = "constant"
    threshold: float = 0.4
    divergence: str = "js"
    hybrid: bool = False
    drafts: str = "auto"
    epsilon: float = 0.09
    delta: float = 0.3
    stop_threshold: float = 0.5
    head: str | None = None
    fsd_raw: bool = True
    divergence_top_k: int = 50
    divergence_top_p: float = 0.9
    lantern_k: int = 100
    lantern_delta: float = 0.1
    cd_alpha: float = 0.1
    cd_beta: float = 0.5
    phrase_len: int = 8
    phrase_pool: int = 4096
    phrase_max_draft: int = 16

    def merged(self, request: SpeculativeSettings | None) -> "ServeDefaults":
        """These defaults with the request's given fields in their place."""
        if request is None:
            return self
        return replace(self, **request.model_dump(exclude_none=True))

    def public(self) -> dict:
        """The settings a response reports (no server paths)."""
        d = asdict(self)
        d.pop("head")
        return d


def keyed_draws(settings: ServeDefaults) -> bool:
    """Whether the rule of ``settings`` keys its random draws by (seed, row id, position) alone
    (ERSD, :class:`quickdraft.verification.rules.ExponentialRace`): a row's text then depends on its own
    seed and prompt only, so a seeded request shares its batch with any other."""
    return settings.method == "ersd"


@dataclass(frozen=True)
class StepKey:
    """What the rows of one batch share: the speculation settings, the sampling parameters and,
    for a request that must be reproducible on its own (a ``seed`` at temperature > 0 under a rule
    whose draws are not keyed by row, :func:`keyed_draws`), the request."""

    settings: ServeDefaults
    sampling: SamplingParams
    seed: int
    owner: str | None = None


def build_spec(settings: ServeDefaults, sampling: SamplingParams, seed: int) -> MethodSpec:
    """The engine's rule and policy for ``settings`` (fresh policy state); raises
    :class:`QuickdraftError` on an invalid combination."""
    if settings.method not in SERVED_METHODS:
        raise QuickdraftError(f"method {settings.method!r} is not served; choose one of {', '.join(SERVED_METHODS)}")
    if settings.policy == "specdecpp" and settings.head is None:
        raise QuickdraftError("policy 'specdecpp' needs an acceptance head: start the server with --head PATH")
    spec = build_method(
        settings.method, k=settings.k, policy=settings.policy, sampling=sampling, divergence=settings.divergence,
        threshold=settings.threshold, hybrid=settings.hybrid, fsd_raw=settings.fsd_raw,
        divergence_top_k=settings.divergence_top_k, divergence_top_p=settings.divergence_top_p, drafts=settings.drafts, epsilon=settings.epsilon,
        delta=settings.delta, seed=seed, head=settings.head, stop_threshold=settings.stop_threshold,
        lantern_k=settings.lantern_k, lantern_delta=settings.lantern_delta, cd_alpha=settings.cd_alpha,
        cd_beta=settings.cd_beta, phrase_len=settings.phrase_len, phrase_pool=settings.phrase_pool,
        phrase_max_draft=settings.phrase_max_draft,
    )
    if spec.engine_method == "tree":  # pragma: no cover - excluded by SERVED_METHODS
        raise QuickdraftError("token-tree methods are not served")
    return spec
