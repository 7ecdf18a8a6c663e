"""AMUSD: the draft model drafts the next block while the target verifies this one.

After McDanel, "AMUSD: Asynchronous Multi-Device Speculative Decoding for LLM Acceleration"
(arXiv:2410.17375, 2024). Sequential speculative decoding (``sd``) alternates: the draft model
drafts K tokens while the target waits, then the target verifies them while the draft model waits.
Here the draft model runs on a thread of its own (on the openvino backend with inference threads
of its own, :func:`split_threads`) and, while the target verifies block ``i``, drafts block
``i + 1`` after the end of block ``i``, as if block ``i`` were accepted whole::

    main thread (target)              draft thread
    ------------------------------    ------------------------------------------
    1. propose   block i (ready, or drafted now when it is not)
    2. score     target forward        draft block i+1 after block i's last token
    3. verify    block i               (joined at the end of verify)
    4. commit    block i accepted whole: block i+1 is the next step's block, ready
                 a rejection:            block i+1 is dropped, the draft's cache rolls back

A step then costs ``max(target forward, K draft forwards)`` after a block accepted whole, and
``K draft forwards + max(...)`` after a rejection, against ``K draft forwards + target forward``
for ``sd`` (docs/methods.md, "Asynchronous drafting", measures when that pays).

**The deferred bonus.** A block accepted whole has no bonus token: the target's distribution after
its last token (``target_probs[:, K]`` of the verification) is carried to the next step, where it
verifies the first token of the speculative block like any draft token (accepted with probability
``min(1, p/q)``, else a recovered token from the residual). Sampling a bonus token instead would
keep the speculative block only when its first token equals the bonus (probability
``sum_v p(v) q(v)`` instead of ``sum_v min(p(v), q(v))``). Such a step emits ``n`` tokens, not
``n + 1`` (:attr:`quickdraft.decoding.proposals.Walk.num_emitted`); the mean acceptance length still
equals new tokens per target forward.

**Exactness.** Every draft token at absolute position ``t`` of row ``r`` is drawn from the draft's
distribution given the tokens before it, by an exponential race whose arrival times are keyed by
``(seed, r, t)`` (:func:`quickdraft.verification.race.race_keys`; ``seed`` drawn once from the decoder's
generator), never from a shared generator. A position's key decides a verified token at most once:
a position is drafted again only while it is not committed, that is, when its earlier draft was
never verified. So each verified draft token is drawn from the draft distribution the verifier is
handed, independently of the verifier's uniforms, and each is verified against the target's
distribution after the same prefix (this step's forward, or the carried one): the standard
argument applies and the output is exactly target-distributed (greedy: the target's argmax). The
verifier draws on the main thread in a fixed order and the draft thread always drafts its whole
block (it is never stopped midway), so the same seed gives the same output whatever the threads'
timing: which forwards run on each model, and in which order, depends only on the tokens.

Chains of a constant length K (:class:`quickdraft.decoding.policies.Constant`), with the greedy (T = 0) or
lossless (T > 0) rule.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from quickdraft.decoding.drafters import Draft, pending_block
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Constant, Policy
from quickdraft.decoding.proposals import ChainProposal, ChainProposer, Walk
from quickdraft.verification.race import race_keys, race_sample
from quickdraft.verification.rules import Greedy, Lossless, Rule, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs
from quickdraft.verification.verify import verify_chain


def split_threads(total: int) -> tuple[int, int]:
    """Inference threads ``(target, draft)`` out of ``total`` when both models run at once: the
    target gets the larger half, each at least one."""
    total = max(1, int(total))
    return max(1, total - total // 2), max(1, total // 2)


def keyed_draft_tokens(draft_probs: torch.Tensor, seed: int, row_ids: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
    """One draft token per row from ``draft_probs [B, V]``, drawn by an exponential race keyed by
    ``(seed, row_ids [B], positions [B])``: exactly distributed as each row, and the same token
    whichever thread draws it, whenever."""
    assert draft_probs.dim() == 2 and row_ids.shape == positions.shape == draft_probs.shape[:1]
    return race_sample(draft_probs, race_keys(seed, row_ids.to(draft_probs.device), positions.to(draft_probs.device)))


@dataclass
class ReadyBlock:
    """A row's speculative block, kept after its block was accepted whole.

    Attributes
    ----------
    ids: the draft tokens after the row's sequence.
    probs: ``[n, V]`` the distributions they were drawn from.
    carry: ``[V]`` the target's distribution after the sequence (the deferred bonus).
    """

    ids: list[int]
    probs: torch.Tensor
    carry: torch.Tensor


class AsyncDrafter:
    """Draft with a smaller causal LM on a thread of its own (method ``"amusd"`` of
    :func:`quickdraft.decoding.engine.generate`).

    Attributes
    ----------
    runner: the draft model's runner.
    vocab_size: the target's vocabulary size (logits are cut to it).
    steps: steps proposed since the batch started.
    ready_steps: steps whose every active row found its whole block drafted during the previous
        verification (no draft forward on the critical path).
    """

    name = "amusd"

    def __init__(self, runner: ModelRunner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = int(vocab_size)
        self.steps = 0
        self.ready_steps = 0

    def proposer(self, policy: Policy, rule: Rule, sampling: SamplingParams) -> "AsyncProposer":
        return AsyncProposer(self, policy, rule, sampling)


class AsyncProposer(ChainProposer):
    """The drafting side of AMUSD for one batch (see the module docstring).

    State between steps, per row (keyed by the decoder's stable row ids, so rows may join and
    leave between steps): the :class:`ReadyBlock` of a row whose last block was accepted whole.
    The draft model's cache then holds the row's sequence and its ready tokens but the last.
    """

    def __init__(self, drafter: AsyncDrafter, policy: Policy, rule: Rule, sampling: SamplingParams) -> None:
        if not isinstance(policy, Constant):
            raise QuickdraftError(f"amusd drafts a constant K while the target verifies; use --policy constant, "
                                  f"not {policy.name!r}")
        if not isinstance(rule, (Greedy, Lossless)) or rule.needs_raw:
            raise QuickdraftError(f"amusd verifies with the greedy or lossless rule, not {rule.name!r}")
        super().__init__(drafter, policy, rule, sampling, drafter.vocab_size)
        # a step's block, the next one drafted beside it, and its bonus token
        self.room = 2 * policy.k + 1
        self.ready: dict[int, ReadyBlock] = {}
        self.seed: int | None = None

    def start(self, sequences: list[list[int]]) -> None:
        self.runner.reset(len(sequences))
        self.ready = {}
        self.seed = None
        self.drafter.steps = self.drafter.ready_steps = 0

    def prefill(self, sequences: list[list[int]]) -> None:
        """Feed all but the last token of every sequence (the last one is fed by the first draft)."""
        prefix = [seq[:-1] for seq in sequences]
        if max(len(p) for p in prefix) > 0:
            ids, valid = pending_block(prefix, self.runner.lengths)
            self.runner.forward(ids, valid, logits_to_keep=1)

    # -- drafting (either thread) ----------------------------------------------------------------
    def draft(self, contexts: list[list[int]], need: list[int], row_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Draft ``need[r]`` tokens after ``contexts[r]`` for every row (0: none), appending them to
        ``contexts``. Touches only the draft runner and its arguments, so it runs on the draft
        thread beside a target forward.

        Returns ``tokens [B, n]`` (int64, right-padded with 0), ``probs [B, n, V]`` (the draft
        distributions they were drawn from; 0 where padded) with ``n = max(need)``, and the number
        of forwards run.
        """
        runner, b, width = self.runner, len(contexts), max(need, default=0)
        tokens = torch.zeros((b, width), dtype=torch.long)
        probs = torch.zeros((b, width, self.vocab_size))
        if width == 0:
            return tokens, probs, 0
        # the cache must stop before each context's last token, whose logits the first draft needs
        room = torch.tensor([len(c) - 1 for c in contexts], dtype=torch.long)
        runner.truncate(torch.minimum(runner.lengths, room.to(runner.lengths.device)))
        for j in range(width):
            drafting = torch.tensor([n > j for n in need])  # [B]
            ids, valid = pending_block(contexts, runner.lengths)
            valid &= drafting.unsqueeze(1)  # rows with enough drafts feed nothing
            out = runner.forward(ids.to(runner.device), valid.to(runner.device), logits_to_keep=1)
            dist = logits_to_probs(out.logits[:, -1, : self.vocab_size], self.sampling).cpu()  # [B, V]
            rows = drafting.nonzero().squeeze(1)
            if self.sampling.greedy:
                picked = dist[rows].argmax(dim=-1)
            else:
                positions = torch.tensor([len(contexts[r]) for r in rows.tolist()], dtype=torch.long)
                picked = keyed_draft_tokens(dist[rows], self.seed, row_ids[rows], positions)
            tokens[rows, j] = picked
            probs[rows, j] = dist[rows]
            for r, t in zip(rows.tolist(), picked.tolist()):
                contexts[r].append(t)
        return tokens, probs, width

    # -- one step ----------------------------------------------------------------------------------
    def propose(self, sequences, active, cap, ctx: VerifyContext) -> "AsyncProposal":
        """This step's block of ``min(K, cap)`` tokens per active row: its ready tokens, and what
        the draft model adds now (all of it after a rejection)."""
        device = active.device
        if self.seed is None:  # the draft's race keys; drawn once, on this thread, in step order
            self.seed = int(torch.randint(0, 1 << 62, (1,), generator=ctx.generator, device=ctx.generator.device))
        row_ids = ctx.extra["row_ids"].cpu()  # [B]
        ids_list, live = row_ids.tolist(), active.tolist()
        self.ready = {r: block for r, block in self.ready.items() if r in set(ids_list)}
        k = min(self.policy.begin_step(), cap)
        ready = [self.ready.get(r) if act else None for r, act in zip(ids_list, live)]
        # 1. each active row's block: its ready tokens, cut to k, then the draft model's
        contexts = [list(seq) + (block.ids[:k] if block else []) for seq, block in zip(sequences, ready)]
        have = [len(c) - len(s) for c, s in zip(contexts, sequences)]
        need = [k - h if act else 0 for h, act in zip(have, live)]
        tokens, probs, forwards = self.draft(contexts, need, row_ids)
        b = len(sequences)
        ids = torch.zeros((b, k), dtype=torch.long)
        dists = torch.zeros((b, k, self.vocab_size))
        carry = torch.zeros((b, self.vocab_size))
        carried = torch.zeros(b, dtype=torch.bool)
        for row, block in enumerate(ready):
            h = have[row]
            if block is not None:
                ids[row, :h] = torch.tensor(block.ids[:h], dtype=torch.long)
                dists[row, :h] = block.probs[:h]
                carry[row], carried[row] = block.carry, True
            if need[row]:
                ids[row, h:] = tokens[row, : need[row]]
                dists[row, h:] = probs[row, : need[row]]
        self.drafter.steps += 1
        self.drafter.ready_steps += int(any(live) and forwards == 0 and k > 0)
        lengths = torch.where(active.cpu(), k, 0)
        draft = Draft(ids=ids, probs=dists, lengths=lengths, forwards=forwards).to(device)
        # 2. the next block, drafted during this step's verification: as long as the next step's
        # block if this one is accepted whole (the tokens left after it, minus the bonus)
        next_k = min(self.policy.begin_step(), cap - k)
        return AsyncProposal(draft, self, carry.to(device), carried.to(device), next_k, row_ids)


class _DraftThread(threading.Thread):
    """One call of :meth:`AsyncProposer.draft` on a thread of its own; :meth:`result` joins it and
    re-raises what it raised."""

    def __init__(self, proposer: AsyncProposer, contexts, need, row_ids) -> None:
        super().__init__(name="quickdraft-amusd-draft", daemon=True)
        self.args = (contexts, need, row_ids)
        self.proposer = proposer
        self.output = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.output = self.proposer.draft(*self.args)
        except BaseException as err:  # handed to the main thread by result()
            self.error = err

    def result(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        self.join()
        if self.error is not None:
            raise self.error
        return self.output


class AsyncProposal(ChainProposal):
    """A chain of K draft tokens per row whose first target distribution may be carried from the
    previous step (``carried [B]``, ``carry [B, V]``), with the next block drafted on the draft
    thread while the target scores this one."""

    def __init__(self, draft: Draft, proposer: AsyncProposer, carry: torch.Tensor, carried: torch.Tensor,
                 next_k: int, row_ids: torch.Tensor) -> None:
        super().__init__(draft, proposer, drafted=draft.ids.shape[1] > 0)
        self.carry = carry  # [B, V]
        self.carried = carried  # [B] bool
        self.next_k = next_k
        self.row_ids = row_ids
        self.thread: _DraftThread | None = None
        self.next_block: tuple[torch.Tensor, torch.Tensor] | None = None  # [B, next_k], [B, next_k, V]
        self.deferred: torch.Tensor | None = None  # [B] bool, set by verify
        self.last_probs: torch.Tensor | None = None  # [B, V] the target after each block

    def score(self, target, sequences) -> torch.Tensor:
        """Start drafting the next block on the draft thread, then run the target forward over
        every row's pending tokens (none for a carried row) and its block."""
        draft, k = self.draft, self.draft.ids.shape[1]
        if self.next_k > 0:
            live = self.draft.lengths.cpu() > 0
            contexts = [list(seq) + self.draft.ids[row, :k].tolist() if live[row] else list(seq)
                        for row, seq in enumerate(sequences)]
            need = [self.next_k if act else 0 for act in live.tolist()]
            self.thread = _DraftThread(self.proposer, contexts, need, self.row_ids)
        pend_ids, pend_valid = pending_block(sequences, target.lengths)
        if not bool(pend_valid.any()) and k > 0:  # every row carried: the block alone, logits after it
            logits = target.forward(draft.ids, torch.ones_like(draft.ids, dtype=torch.bool), logits_to_keep=k).logits
            return torch.cat([torch.zeros_like(logits[:, :1]), logits], dim=1)  # [B, K+1, V'], column 0 carried
        return super().score(target, sequences)

    def verify(self, target_logits: torch.Tensor, ctx: VerifyContext, active: torch.Tensor) -> Walk:
        """Verify the block against the target (a carried row's first distribution from the
        previous step); a row that accepts its whole block defers its bonus when a next block is
        being drafted. Joins the draft thread."""
        proposer, draft = self.proposer, self.draft
        k = draft.ids.shape[1]
        target_probs = logits_to_probs(target_logits[:, :, : proposer.vocab_size], proposer.sampling)  # [B, K+1, V]
        target_probs[:, 0] = torch.where(self.carried.unsqueeze(1), self.carry, target_probs[:, 0])
        result = verify_chain(draft.ids, draft.probs, target_probs, proposer.rule, ctx=ctx,
                              draft_lengths=draft.lengths if k else None, check_probs=False)
        whole = active & (result.num_accepted == draft.lengths) & (draft.lengths > 0)
        self.deferred = whole & (self.next_k > 0)
        self.last_probs = target_probs[:, k]
        output_ids = result.output_ids.clone()
        output_ids[self.deferred, k] = -1
        if self.thread is not None:
            tokens, probs, forwards = self.thread.result()
            self.next_block = (tokens, probs)
            self.forwards += forwards
        return Walk(output_ids=output_ids, num_accepted=result.num_accepted, num_lossy=result.num_lossy,
                    drafted_depth=draft.lengths, drafted_nodes=draft.lengths,
                    num_emitted=result.num_accepted + 1 - self.deferred.long())

    def commit(self, target, sequences, walk, seq_lens, active) -> None:
        """Roll the target back to the accepted prefix; keep the next block of every row that
        accepted its whole block and emitted it all (no end-of-sequence or stop string cut it),
        and roll the draft model back everywhere else."""
        proposer, runner = self.proposer, self.proposer.runner
        valid_prefix = seq_lens + walk.num_accepted
        target.truncate(torch.minimum(target.lengths, valid_prefix))
        lengths = self.draft.lengths.tolist()
        keep = torch.zeros(len(sequences), dtype=torch.bool)
        for row, rid in enumerate(self.row_ids.tolist()):
            proposer.ready.pop(rid, None)
            if (self.deferred[row] and self.next_block is not None
                    and len(sequences[row]) == int(seq_lens[row]) + lengths[row]):
                tokens, probs = self.next_block
                proposer.ready[rid] = ReadyBlock(ids=tokens[row, : self.next_k].tolist(),
                                                 probs=probs[row, : self.next_k], carry=self.last_probs[row])
                keep[row] = True
        keep = keep.to(runner.lengths.device)
        runner.truncate(torch.where(keep, runner.lengths, torch.minimum(runner.lengths, valid_prefix.to(keep.device))))
        if self.drafted:
            proposer.policy.update(self.draft.ids.shape[1], walk.num_accepted[active])
