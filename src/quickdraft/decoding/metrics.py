"""Exact generation metrics, per sequence and aggregated.

Terms follow :mod:`quickdraft.verification.verify`: a *step* is one verifying target forward; it emits the
accepted draft tokens plus one recovered-or-bonus token, so the *mean acceptance length*
(``emitted_tokens / steps``) counts the bonus token and equals new tokens per verifying target
forward (before truncation at EOS, a stop string or ``max_new_tokens``). The first new token comes
from the prefill's forward (``prefill_tokens``), not from a step, as in the runtimes' own loops.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationMetrics:
    """Counts and timings of one generated sequence (or a sum of several).

    Attributes
    ----------
    prompt_tokens: tokens in the prompt (after the chat template).
    new_tokens: tokens generated and kept.
    prefill_tokens: new tokens emitted by the prefill's forward (the first token; 0 where the first
        step emits it, as in contrastive decoding).
    steps: verification steps (target forwards after prefill) in which the sequence took part.
    target_forwards: target forwards including prefill.
    draft_forwards: draft-model forwards (0 for model-free drafters).
    drafted_tokens: draft tokens proposed to the verifier.
    accepted_tokens: draft tokens accepted.
    lossy_accepted_tokens: accepted tokens accepted by a lossy criterion (e.g. FSD's fuzzy acceptance).
    emitted_tokens: tokens emitted by all steps, before truncation (accepted + one per step, but for
        AMUSD's steps that defer their bonus token).
    position_reached: ``[i]`` steps that drafted a token at draft position i+1 with all earlier accepted.
    position_accepted: ``[i]`` steps that accepted the token at draft position i+1.
    prefill_seconds: time of the prompt forwards.
    decode_seconds: time of everything after prefill.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_tokens: int = 0
    steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    lossy_accepted_tokens: int = 0
    emitted_tokens: int = 0
    position_reached: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    def record_step(self, num_drafted: int, num_accepted: int, num_lossy: int = 0,
                    num_emitted: int | None = None) -> None:
        """Count one verification step that drafted ``num_drafted`` and accepted ``num_accepted``;
        it emitted ``num_emitted`` tokens (default ``num_accepted + 1``; AMUSD defers a fully
        accepted block's bonus token to the next step, :mod:`quickdraft.decoding.amusd`)."""
        self.steps += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted
        self.lossy_accepted_tokens += num_lossy
        self.emitted_tokens += num_accepted + 1 if num_emitted is None else num_emitted
        grow = num_drafted - len(self.position_reached)
        if grow > 0:
            self.position_reached.extend([0] * grow)
            self.position_accepted.extend([0] * grow)
        for i in range(min(num_drafted, num_accepted + 1)):
            self.position_reached[i] += 1
        for i in range(num_accepted):
            self.position_accepted[i] += 1

    # -- derived ---------------------------------------------------------------------------------
    @property
    def mean_acceptance_length(self) -> float:
        """Emitted tokens per verification step, counting the recovered/bonus token."""
        return self.emitted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens / drafted tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def acceptance_rate_by_position(self) -> list[float]:
        return [a / r if r else 0.0 for a, r in zip(self.position_accepted, self.position_reached)]

    @property
    def lossy_share(self) -> float:
        """Share of the new tokens that came from a lossy (e.g. fuzzy) acceptance."""
        return self.lossy_accepted_tokens / self.emitted_tokens if self.emitted_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens after the prefill's per second of decoding (model load, prefill and the
        prefill's token excluded)."""
        decoded = max(0, self.new_tokens - self.prefill_tokens)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            mean_acceptance_length=self.mean_acceptance_length,
            acceptance_rate=self.acceptance_rate,
            acceptance_rate_by_position=self.acceptance_rate_by_position,
            lossy_share=self.lossy_share,
            tokens_per_second=self.tokens_per_second,
        )
        return d

    @staticmethod
    def aggregate(items: list["GenerationMetrics"]) -> "GenerationMetrics":
        """Sum counts and times (for a batch, pass the batch's wall time yourself)."""
        total = GenerationMetrics()
        for m in items:
            for name in (
                "prompt_tokens", "new_tokens", "prefill_tokens", "steps", "target_forwards", "draft_forwards", "drafted_tokens",
                "accepted_tokens", "lossy_accepted_tokens", "emitted_tokens", "prefill_seconds", "decode_seconds",
            ):
                setattr(total, name, getattr(total, name) + getattr(m, name))
            n = max(len(total.position_reached), len(m.position_reached))
            total.position_reached = [
                (total.position_reached[i] if i < len(total.position_reached) else 0)
                + (m.position_reached[i] if i < len(m.position_reached) else 0)
                for i in range(n)
            ]
            total.position_accepted = [
                (total.position_accepted[i] if i < len(total.position_accepted) else 0)
                + (m.position_accepted[i] if i < len(m.position_accepted) else 0)
                for i in range(n)
            ]
        return total
