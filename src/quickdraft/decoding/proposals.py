"""What one decoding step hands from verb to verb: a proposal (a token tree) and its walk.

A step of :class:`quickdraft.decoding.engine.Decoder` is four verbs over one interface, whatever the shape
of the draft::

    proposal = proposer.propose(sequences, active, cap, ctx)       # 1. propose  a token tree
    target_logits = proposal.score(target, sequences)              # 2. score    one target forward
    walk = proposal.verify(target_logits, ctx, active)             # 3. verify   walk the tree
    proposal.commit(target, sequences, walk, seq_lens, active)     # 4. commit   roll the caches back

A *proposal* is a token tree whose root is each row's last emitted token; a chain of ``K`` draft
tokens is the tree of width one (:class:`ChainProposal`), a dynamic or static tree, a multi-draft
step (a tree of depth one) and an ERSD race tree are :class:`quickdraft.decoding.tree_decoding.TreeProposal`.
The proposal knows how its own tree is scored (a causal block, or a tree-masked block), walked
(:func:`quickdraft.verification.verify.verify_chain`, or :func:`quickdraft.decoding.tree_decoding.verify_tree`) and
committed (a roll-back to the accepted prefix, or keeping the accepted path), so the loop, its
per-row bookkeeping, continuous batching and metrics are written once.

A *proposer* owns the drafting side of a batch: the draft model's runner (whose KV cache follows
the batch's rows), the rule and the sampling settings. :class:`ChainProposer` drives the chain
drafters of :mod:`quickdraft.decoding.drafters` with a draft-length policy; a drafter with a
``proposer(policy, rule, sampling)`` method (:class:`quickdraft.decoding.tree_decoding.TreeDrafter`) makes
its own.

Terms are those of :mod:`quickdraft.verification.verify`: per row the walk *accepts* ``n`` draft tokens, then
emits one *recovered* token (it left the tree) or *bonus* token (it reached a leaf), ``n + 1``
tokens per target forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from quickdraft.decoding.drafters import Draft, NGramModelDrafter, pending_block
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import MAX_DRAFT_LENGTH, BudgetCap, Policy
from quickdraft.verification.rules import Rule, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, argmax, logits_to_probs, raw_probs
from quickdraft.verification.verify import verify_chain, verify_greedy_ids


@dataclass
class Walk:
    """The verifier's walk through one proposal per row.

    Attributes
    ----------
    output_ids: ``[B, D + 1]`` int64 accepted tokens, then the recovered-or-bonus token, then ``-1``.
    num_accepted: ``[B]`` int64 accepted draft tokens ``n`` (the row emits ``n + 1``).
    num_lossy: ``[B]`` int64 of them accepted by a lossy criterion (FSD's divergence test).
    drafted_depth: ``[B]`` int64 draft positions proposed (a chain's length, a tree's depth).
    drafted_nodes: ``[B]`` int64 draft tokens proposed (``drafted_depth`` for a chain, the tree's
        valid nodes below the root for a tree).
    path: ``[B, D + 1]`` int64 tree nodes of the walked path, root first, ``-1`` padded (``None``
        for a chain, whose path is its first ``n`` tokens).
    num_emitted: ``[B]`` int64 tokens the row emits (``None``: ``n + 1``; AMUSD's rows that defer
        their bonus token emit ``n``, :mod:`quickdraft.decoding.amusd`).
    """

    output_ids: torch.Tensor
    num_accepted: torch.Tensor
    num_lossy: torch.Tensor
    drafted_depth: torch.Tensor
    drafted_nodes: torch.Tensor
    path: torch.Tensor | None = None
    num_emitted: torch.Tensor | None = None


class Proposal(Protocol):
    """One step's token tree for every row, with the three verbs that depend on its shape."""

    #: draft-model forwards spent on proposing it
    forwards: int

    def score(self, target: ModelRunner, sequences: list[list[int]]) -> torch.Tensor:
        """One target forward over every row's pending tokens and the tree; returns the logits
        ``[B, M, V']`` after each of the ``M`` tree nodes (root first)."""
        ...

    def verify(self, target_logits: torch.Tensor, ctx: VerifyContext, active: torch.Tensor) -> Walk:
        """Walk every active row's tree with the rule (``target_logits`` from :meth:`score`)."""
        ...

    def commit(self, target: ModelRunner, sequences: list[list[int]], walk: Walk, seq_lens: torch.Tensor,
               active: torch.Tensor) -> None:
        """Roll both KV caches back to what is still a prefix of each row's sequence
        (``seq_lens [B]``: the lengths before this step; ``active [B]``: the rows that took part)."""
        ...


class Proposer(Protocol):
    """The drafting side of a batch; see the module docstring."""

    #: the draft model's runner, whose rows follow the batch's (``None``: no draft model)
    runner: ModelRunner | None
    #: most tokens one step appends beyond a sequence (deepest proposal plus its bonus token)
    room: int
    #: the draft side's context limit (``None``: only the target's counts)
    max_positions: int | None

    def start(self, sequences: list[list[int]]) -> None:
        """A new batch of ``sequences`` (prompts) begins."""
        ...

    def prefill(self, sequences: list[list[int]]) -> None:
        """Feed the draft model every token of every row but the last."""
        ...

    def propose(self, sequences: list[list[int]], active: torch.Tensor, cap: int, ctx: VerifyContext) -> Proposal:
        """This step's proposal for every row; ``cap`` is the most draft tokens any active row may
        still use (its budget left minus the bonus token)."""
        ...


def draft_runner(drafter) -> ModelRunner | None:
    """The draft model's runner of a chain ``drafter`` (``None`` for a model-free drafter)."""
    if isinstance(drafter, NGramModelDrafter):
        return drafter.model.runner
    return getattr(drafter, "runner", None)


class ChainProposer:
    """Chains from a drafter of :mod:`quickdraft.decoding.drafters` (``None``: plain decoding, K = 0).

    Each step drafts ``policy``'s length, at most ``cap`` tokens (:class:`BudgetCap`); a step with
    ``cap = 0`` (or without a drafter) is a plain step, which the rule turns into one bonus token.
    A drafter with ``observe(draft, target_ids, num_accepted)`` sees every verification of its
    drafts before its ``commit`` (``target_ids [B, K+1]``: the target's most likely token after each
    draft prefix), as :class:`quickdraft.decoding.phrase.PhraseDrafter` does to refresh its phrase pools.
    """

    max_positions = None

    def __init__(self, drafter, policy: Policy, rule: Rule, sampling: SamplingParams, vocab_size: int) -> None:
        step_k = policy.begin_step()
        least = 0 if getattr(policy, "may_skip", False) else 1  # a policy that may skip drafting: 0 is a plain step
        if isinstance(step_k, bool) or int(step_k) != step_k or not least <= step_k <= MAX_DRAFT_LENGTH:
            raise QuickdraftError(
                f"policy {policy.name!r} asks for a draft of {step_k!r} tokens; the draft length must be an "
                f"integer in [{least}, {MAX_DRAFT_LENGTH}]"
            )
        self.drafter = drafter
        self.policy = policy
        self.rule = rule
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.needs_raw = getattr(rule, "needs_raw", False)  # the rule reads temperature-1 distributions
        # the rule reads only argmax ids at this temperature: verify on token ids (verify_greedy_ids)
        self.on_ids = sampling.greedy and getattr(rule, "argmax_only", False) and not self.needs_raw
        self.runner = draft_runner(drafter)
        # room for the longest draft and its bonus token (a policy that may skip says its longest: max_k)
        longest = max(step_k, getattr(policy, "max_k", 0) if least == 0 else 0, getattr(drafter, "max_draft", 0))
        self.room = 0 if drafter is None else longest + 1

    def start(self, sequences: list[list[int]]) -> None:
        if self.drafter is not None:
            self.drafter.start(sequences)

    def prefill(self, sequences: list[list[int]]) -> None:
        if self.drafter is not None:
            self.drafter.prefill(sequences)

    def propose(self, sequences, active, cap, ctx) -> "ChainProposal":
        self.policy.observe_rows(int(active.sum()))
        skip = self.drafter is not None and cap > 0 and self.policy.begin_step() == 0  # the policy's plain step
        if self.drafter is None or cap == 0 or skip:
            b, device = len(sequences), active.device
            draft = Draft(
                ids=torch.zeros((b, 0), dtype=torch.long, device=device),
                probs=None, vocab_size=self.vocab_size,
                lengths=torch.zeros(b, dtype=torch.long, device=device),
                raw_probs=torch.zeros((b, 0, self.vocab_size), device=device) if self.needs_raw else None,
            )
            return ChainProposal(draft, self, skipped=skip)
        draft = self.drafter.propose(sequences, BudgetCap(self.policy, cap), self.rule, self.sampling, ctx, active)
        return ChainProposal(draft.truncate(cap).to(active.device), self, drafted=True)


class ChainProposal:
    """A chain of ``K`` draft tokens per row (rows drafted ``draft.lengths ≤ K`` of them).

    Scored as one causal block ``[pending tokens, draft tokens]`` by :meth:`ModelRunner.forward`
    (every backend has it), verified by :func:`quickdraft.verification.verify.verify_chain` with the rule, and
    committed by rolling both caches back to the accepted prefix; the policy then sees the outcome.
    """

    def __init__(self, draft: Draft, proposer: ChainProposer, drafted: bool = False, skipped: bool = False) -> None:
        self.draft = draft
        self.proposer = proposer
        self.drafted = drafted  # whether the policy drafted this step (it sees the outcome at commit)
        self.skipped = skipped  # whether the policy chose a plain step (it is told, as a draft of 0)
        self.target_ids: torch.Tensor | None = None  # [B, K+1] set by verify for a drafter with ``observe``
        self.forwards = draft.forwards

    def score(self, target: ModelRunner, sequences: list[list[int]]) -> torch.Tensor:
        draft = self.draft
        k = draft.ids.shape[1]
        pend_ids, pend_valid = pending_block(sequences, target.lengths)
        pend_ids, pend_valid = pend_ids.to(target.device), pend_valid.to(target.device)
        block = torch.cat([pend_ids, draft.ids], dim=1)
        block_valid = torch.cat([pend_valid, torch.ones_like(draft.ids, dtype=torch.bool)], dim=1)
        return target.forward(block, block_valid, logits_to_keep=k + 1).logits  # [B, K+1, V']

    def verify(self, target_logits: torch.Tensor, ctx: VerifyContext, active: torch.Tensor) -> Walk:
        proposer, draft = self.proposer, self.draft
        k = draft.ids.shape[1]
        target_logits = target_logits[:, :, : proposer.vocab_size]  # [B, K+1, V]
        if hasattr(proposer.drafter, "observe") or proposer.on_ids:
            self.target_ids = argmax(target_logits)  # [B, K+1] target's likeliest token after each prefix
        if proposer.on_ids:  # the same walk as verify_chain's with one-hot distributions, on ids
            result = verify_greedy_ids(draft.ids, self.target_ids, draft.lengths if k else None)
        else:
            target_probs = logits_to_probs(target_logits, proposer.sampling)
            if proposer.needs_raw:
                ctx.raw_target_probs = raw_probs(target_logits)
                ctx.raw_draft_probs = draft.raw_probs
            result = verify_chain(
                draft.ids, draft.dense_probs(), target_probs, proposer.rule, ctx=ctx,
                draft_lengths=draft.lengths if k else None, check_probs=False,
            )
        return Walk(output_ids=result.output_ids, num_accepted=result.num_accepted, num_lossy=result.num_lossy,
                    drafted_depth=draft.lengths, drafted_nodes=draft.lengths)

    def commit(self, target, sequences, walk, seq_lens, active) -> None:
        proposer = self.proposer
        valid_prefix = seq_lens + walk.num_accepted
        target.truncate(torch.minimum(target.lengths, valid_prefix))
        if proposer.drafter is not None:
            if self.drafted and hasattr(proposer.drafter, "observe"):
                proposer.drafter.observe(self.draft, self.target_ids, walk.num_accepted)
            proposer.drafter.commit(sequences, valid_prefix)
        if self.drafted or self.skipped:
            proposer.policy.update(self.draft.ids.shape[1], walk.num_accepted[active])
