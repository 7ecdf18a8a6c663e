"""Contrastive decoding with the draft model as the amateur: ``cd`` (plain) and ``scd`` (speculative).

Contrastive decoding (Li et al., ACL 2023, arXiv:2210.15097) decodes from scores that contrast an
*expert* with an *amateur*, :func:`quickdraft.verification.rules.contrastive_scores`; here the expert is the
target and the amateur the draft model. Speculative contrastive decoding (Yuan et al., ACL 2024,
arXiv:2311.08981) lets the amateur draft as well, and verifies its drafts against the contrastive
distribution instead of the target's, so that one draft model gives both the speed-up and the
contrast.

One step, as in :mod:`quickdraft.decoding.engine`, with the amateur's distribution at every verified
position::

    1. propose   scd: the amateur drafts x_1 … x_K (K forwards, its logits kept); both: one more
                 amateur forward, over x_K (cd: over the tokens it has not seen)   -> amateur [B, K+1, V]
    2. score     one target forward over [pending tokens, x_1 … x_K]              -> target  [B, K+1, V]
    3. verify    contrastive scores at the K+1 positions, processed (temperature, top-k, top-p) into
                 p_cd, verified by the rule (:class:`quickdraft.verification.rules.Contrastive`) as the target's
                 would be: accepted tokens, then the recovered or bonus token, all from p_cd
    4. commit    as a chain; the amateur keeps x_K in its cache when the whole draft is accepted

``cd`` is the same step with K = 0: the amateur runs on every token, one target forward and one
amateur forward per token. The extra forward of step 1 is what puts the bonus token under p_cd
too: with it every emitted token follows p_cd, so greedy ``scd`` is greedy ``cd`` token for token
and sampled ``scd`` samples ``cd``'s distribution.
"""

from __future__ import annotations

import torch

from quickdraft.decoding.drafters import Draft, ModelDrafter, pending_block
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Policy
from quickdraft.decoding.proposals import ChainProposal, ChainProposer, Walk
from quickdraft.verification.rules import Contrastive, Rule, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams


class ContrastiveDrafter:
    """The draft model as contrastive decoding's amateur; ``drafts``: it drafts as well (``scd``),
    else it only scores (``cd``). It makes its own proposer (:meth:`proposer`), which needs the
    :class:`~quickdraft.verification.rules.Contrastive` rule."""

    def __init__(self, runner: ModelRunner, vocab_size: int, drafts: bool = True) -> None:
        self.model = ModelDrafter(runner, vocab_size, keep_logits=True)
        self.runner = runner
        self.vocab_size = vocab_size
        self.drafts = drafts
        self.name = "scd" if drafts else "cd"

    def proposer(self, policy: Policy, rule: Rule, sampling: SamplingParams) -> "ContrastiveProposer":
        return ContrastiveProposer(self, policy, rule, sampling)


class ContrastiveProposer(ChainProposer):
    """Chains of the amateur (none for ``cd``) with the amateur's logits at every verified position."""

    def __init__(self, drafter: ContrastiveDrafter, policy: Policy, rule: Rule, sampling: SamplingParams) -> None:
        if not isinstance(rule, Contrastive):
            raise QuickdraftError(f"{drafter.name} verifies against contrastive decoding's distribution: it needs the "
                                  f"contrastive rule (quickdraft.verification.rules.Contrastive), got {type(rule).__name__}")
        super().__init__(drafter.model, policy, rule, sampling, drafter.vocab_size)
        self.drafts = drafter.drafts
        if not self.drafts:
            self.room = 1  # cd: the amateur is one token ahead, no drafts

    def propose(self, sequences, active, cap, ctx) -> "ContrastiveProposal":
        chain = super().propose(sequences, active, cap if self.drafts else 0, ctx)
        draft = chain.draft
        # the amateur's distribution after the last draft token (cd: after the sequence)
        drafted = [seq + ids for seq, ids in zip(sequences, draft.ids.tolist())]
        ids, valid = pending_block(drafted, self.runner.lengths)
        last = self.runner.forward(ids, valid, logits_to_keep=1).logits[:, -1:, : self.vocab_size]  # [B, 1, V]
        kept = draft.logits if draft.logits is not None else last.new_zeros((last.shape[0], 0, last.shape[-1]))
        amateur_logits = torch.cat([kept.to(last.device), last], dim=1)  # [B, K+1, V]
        return ContrastiveProposal(draft, self, chain.drafted, amateur_logits)


class ContrastiveProposal(ChainProposal):
    """A chain (possibly empty) with the amateur's logits ``[B, K+1, V]`` at its K + 1 positions; it
    is verified against the contrastive scores instead of the target's logits."""

    def __init__(self, draft: Draft, proposer: ContrastiveProposer, drafted: bool,
                 amateur_logits: torch.Tensor) -> None:
        super().__init__(draft, proposer, drafted)
        k = draft.ids.shape[1]
        if amateur_logits.shape[:2] != (draft.ids.shape[0], k + 1):
            raise QuickdraftError(f"amateur logits must be [B, K+1={k + 1}, V], got {tuple(amateur_logits.shape)}")
        self.amateur_logits = amateur_logits  # [B, K+1, V]
        self.forwards = draft.forwards + 1  # and the amateur's step past the draft

    def verify(self, target_logits: torch.Tensor, ctx: VerifyContext, active: torch.Tensor) -> Walk:
        target_logits = target_logits[:, :, : self.proposer.vocab_size]  # [B, K+1, V]
        amateur_logits = self.amateur_logits.to(target_logits.device)
        return super().verify(self.proposer.rule.scores(target_logits, amateur_logits), ctx, active)
