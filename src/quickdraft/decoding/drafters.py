"""Drafters: who proposes the draft tokens. One class per kind of drafter.

Every drafter implements ``start``, ``prefill``, ``propose`` and ``commit``:

``start(sequences)``
    a new batch begins (``sequences`` is the list of token-id lists, prompts included).
``prefill(sequences)``
    feed the draft model every token but the last of every sequence (nothing without a model).
``propose(sequences, policy, rule, sampling, ctx, active) -> Draft``
    draft up to ``policy.begin_step()`` tokens for every row, the same number of columns for all
    rows; ``Draft.lengths`` says how many of them each row really drafted (0 for rows not in
    ``active``).
``commit(sequences, valid_prefix)``
    the sequences after verification; the drafter drops whatever state is no longer valid.

These draft chains; the engine drives them through :class:`quickdraft.decoding.proposals.ChainProposer`,
which adds the draft-length policy and turns each draft into the step's proposal. A tree drafter
(:class:`quickdraft.decoding.tree_decoding.TreeDrafter`) makes its own proposer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quickdraft.decoding.policies import Policy, _check_k
from quickdraft.verification.rules import Rule, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, argmax, logits_to_probs, raw_probs


@dataclass
class Draft:
    """One step's chain drafts of a batch.

    ``probs`` is ``None`` where every distribution is one-hot at its drafted token (copied tokens,
    or argmax drafts at temperature 0): :meth:`dense_probs` then builds them over ``vocab_size``
    tokens, and a greedy verification on token ids never needs them.
    """

    ids: torch.Tensor  # [B, K] int64
    probs: torch.Tensor | None  # [B, K, V] the distributions the ids were drawn from (None: one-hot at ids)
    lengths: torch.Tensor  # [B] int64, tokens actually drafted per row (<= K)
    raw_probs: torch.Tensor | None = None  # [B, K, V] temperature-1 distributions, when the rule wants them
    forwards: int = 0  # draft-model forwards spent
    logits: torch.Tensor | None = None  # [B, K, V] the draft model's logits, when its drafter keeps them
    vocab_size: int | None = None  # V, needed where ``probs`` is None

    def __post_init__(self) -> None:
        if self.probs is None and self.vocab_size is None:
            raise ValueError("a Draft without probs needs vocab_size (its distributions are one-hot at ids)")

    def dense_probs(self) -> torch.Tensor:
        """``[B, K, V]``: ``probs``, or the one-hot distributions at ``ids`` where they are implicit."""
        if self.probs is not None:
            return self.probs
        b, k = self.ids.shape
        out = torch.zeros((b, k, int(self.vocab_size)), device=self.ids.device)
        return out.scatter_(-1, self.ids.unsqueeze(-1), 1.0)

    def truncate(self, k: int) -> "Draft":
        """The first ``k`` columns (rows that drafted more keep ``k`` of them)."""
        if self.ids.shape[1] <= k:
            return self
        return Draft(
            ids=self.ids[:, :k], probs=None if self.probs is None else self.probs[:, :k],
            lengths=self.lengths.clamp_max(k),
            raw_probs=None if self.raw_probs is None else self.raw_probs[:, :k], forwards=self.forwards,
            logits=None if self.logits is None else self.logits[:, :k], vocab_size=self.vocab_size,
        )

    def to(self, device: torch.device) -> "Draft":
        return Draft(
            ids=self.ids.to(device), probs=None if self.probs is None else self.probs.to(device),
            lengths=self.lengths.to(device),
            raw_probs=None if self.raw_probs is None else self.raw_probs.to(device), forwards=self.forwards,
            logits=None if self.logits is None else self.logits.to(device), vocab_size=self.vocab_size,
        )


def pending_block(sequences: list[list[int]], lengths: torch.Tensor, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded block of the tokens each row has not yet fed to a runner.

    With ``sequences = [[5, 6, 7], [8, 9]]`` and ``lengths = [1, 1]`` the block is
    ``[[6, 7], [pad, 9]]`` with validity ``[[1, 1], [0, 1]]``.
    """
    pending = [seq[int(n):] for seq, n in zip(sequences, lengths.tolist())]
    width = max(1, max(len(p) for p in pending))
    ids = torch.full((len(pending), width), pad_id, dtype=torch.long)
    valid = torch.zeros((len(pending), width), dtype=torch.bool)
    for row, p in enumerate(pending):
        if p:
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            valid[row, width - len(p):] = True
    return ids, valid


def one_hot_draft(found: list[list[int]], vocab_size: int, rule: Rule) -> Draft:
    """The :class:`Draft` of copied tokens ``found`` (one list per row, possibly empty): right-padded
    ids and one-hot distributions, the distributions the copies were "drawn" from (implicit:
    :meth:`Draft.dense_probs` builds them)."""
    k = max(len(f) for f in found)
    b = len(found)
    ids = torch.zeros((b, k), dtype=torch.long)
    for row, f in enumerate(found):
        if f:
            ids[row, : len(f)] = torch.tensor(f, dtype=torch.long)
    lengths = torch.tensor([len(f) for f in found], dtype=torch.long)
    draft = Draft(ids=ids, probs=None, lengths=lengths, forwards=0, vocab_size=vocab_size)
    if getattr(rule, "needs_raw", False):  # one tensor for both, built once, as the rule reads both
        draft.probs = draft.raw_probs = draft.dense_probs()
    return draft


class ModelDrafter:
    """Draft with a smaller causal LM, one forward per draft token, through the rule's ``propose``;
    ``keep_logits``: its drafts carry the model's logits (:attr:`Draft.logits`)."""

    name = "model"

    def __init__(self, runner: ModelRunner, vocab_size: int, keep_logits: bool = False) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.keep_logits = keep_logits

    def start(self, sequences: list[list[int]]) -> None:
        self.runner.reset(len(sequences))

    def prefill(self, sequences: list[list[int]]) -> None:
        """Feed all but the last token of every sequence (the last one is fed by the first draft)."""
        prefix = [seq[:-1] for seq in sequences]
        if max(len(p) for p in prefix) > 0:
            ids, valid = pending_block(prefix, self.runner.lengths)
            self.runner.forward(ids, valid, logits_to_keep=1)

    def propose(
        self,
        sequences: list[list[int]],
        policy: Policy,
        rule: Rule,
        sampling: SamplingParams,
        ctx: VerifyContext,
        active: torch.Tensor,
    ) -> Draft:
        max_k = policy.begin_step()
        tokens, dists, raws, kept = [], [], [], []
        forwards = 0
        # argmax drafts at temperature 0: each distribution is one-hot at its token (left implicit)
        one_hot = sampling.greedy and rule.greedy_drafts
        needs_raw = getattr(rule, "needs_raw", False)
        for i in range(max_k):
            out = self.first_forward(sequences, policy) if i == 0 else self.next_forward(token, out, policy)
            forwards += 1
            logits = out.logits[:, -1]  # [B, V]
            logits = logits[:, : self.vocab_size]
            if one_hot:
                token = argmax(logits)  # [B], what the rule's propose takes from the one-hot
            else:
                probs = logits_to_probs(logits, sampling)
                token = rule.propose(probs, ctx, offset=i)  # [B]
                dists.append(probs)
            tokens.append(token)
            if self.keep_logits:
                kept.append(logits)
            raw = raw_probs(logits) if needs_raw or (i + 1 < max_k and getattr(policy, "needs_probs", True)) else None
            if needs_raw:
                raws.append(raw)
            hidden = out.hidden[:, -1] if out.hidden is not None else None
            # policies see the draft's unwarped distribution: a confidence signal that stays
            # meaningful at temperature 0, where ``probs`` is one-hot
            if i + 1 < max_k and not policy.keep_drafting(i, raw, hidden, token=token):
                break
        k = len(tokens)
        lengths = torch.where(active.to(self.runner.device), k, 0)
        return Draft(
            ids=torch.stack(tokens, dim=1),
            probs=None if one_hot else torch.stack(dists, dim=1),
            lengths=lengths,
            raw_probs=torch.stack(raws, dim=1) if raws else None,
            forwards=forwards,
            logits=torch.stack(kept, dim=1) if kept else None,
            vocab_size=self.vocab_size,
        )

    def first_forward(self, sequences: list[list[int]], policy: Policy):
        """The step's first draft forward: every row's tokens not fed yet (its last column drafts
        the first token)."""
        ids, valid = pending_block(sequences, self.runner.lengths)
        return self.runner.forward(ids, valid, logits_to_keep=1, output_hidden=policy.needs_hidden)

    def next_forward(self, token: torch.Tensor, out, policy: Policy):
        """The forward that drafts the token after ``token`` ``[B]`` (``out``: the previous forward's)."""
        return self.runner.forward(token.unsqueeze(1), torch.ones_like(token.unsqueeze(1), dtype=torch.bool),
                                   logits_to_keep=1, output_hidden=policy.needs_hidden)

    def commit(self, sequences: list[list[int]], valid_prefix: torch.Tensor) -> None:
        """Keep the cached tokens that are still a prefix of the sequences (``valid_prefix [B]``)."""
        self.runner.truncate(torch.minimum(self.runner.lengths, valid_prefix))


class LookupDrafter:
    """A model-free drafter: each row's draft is what :meth:`lookup` finds for its sequence, with
    one-hot draft distributions, so every rule verifies the copied tokens exactly (for the lossless
    rule a copied token is accepted with probability p(token)). No model, no forwards, no state
    across steps. Subclasses define ``vocab_size`` and :meth:`lookup`."""

    vocab_size: int

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens to draft after ``seq`` (``[]``: nothing found)."""
        raise NotImplementedError

    def start(self, sequences: list[list[int]]) -> None:
        return None

    def prefill(self, sequences: list[list[int]]) -> None:
        return None

    def propose(self, sequences, policy, rule, sampling, ctx, active) -> Draft:
        max_k = policy.begin_step()
        found = [self.lookup(seq, max_k) if act else [] for seq, act in zip(sequences, active.tolist())]
        return one_hot_draft(found, self.vocab_size, rule)

    def commit(self, sequences, valid_prefix) -> None:
        return None


class NGramDrafter(LookupDrafter):
    """Prompt lookup decoding: copy the continuation of the latest earlier occurrence of the
    sequence's last n-gram (n from ``max_ngram`` down to ``min_ngram``). No model, no forwards.

    The draft distributions are one-hot at the copied tokens, so every rule verifies them exactly
    (for the lossless rule a copied token is accepted with probability p(token)).
    """

    name = "ngram"

    def __init__(self, vocab_size: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not (1 <= min_ngram <= max_ngram):
            from quickdraft.errors import QuickdraftError

            raise QuickdraftError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.vocab_size = vocab_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def lookup(self, seq: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier match of the last n-gram."""
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + k]
        return []


class NGramModelDrafter:
    """A model-free drafter first, the draft model where it finds nothing: ``ngram_sd`` over prompt
    lookup (:class:`NGramDrafter`), ``rest_sd`` over retrieval
    (:class:`quickdraft.decoding.retrieval.RetrievalDrafter`). ``lookup`` is any drafter with
    ``lookup(seq, k) -> list[int]`` (``[]``: nothing found) and ``vocab_size``.

    A step drafts up to ``lookup_k`` copied tokens when the lookup finds a continuation for every
    active row (prompt lookup: the last n-gram, at least ``lookup.min_ngram`` tokens, occurred
    earlier in the sequence), and drafts with the model (``policy``'s length) otherwise. A lookup
    step costs no draft forward, so where the text repeats itself or the datastore (code restating
    its prompt, edits, quotations) a step costs one target forward alone, and a longer lookup costs
    little more where verification cost is flat in the block length (``docs/performance.md``);
    elsewhere it is ordinary speculative decoding. The draft model skips the looked-up steps and
    feeds the tokens it missed in one block at its next step (its KV cache is always a prefix of
    the sequence).

    Which drafter runs depends only on the sequence so far, and each step's draft distributions
    are the ones its tokens were drawn from (one-hot for copied tokens), so every lossless rule
    stays exactly target-distributed.
    """

    def __init__(self, lookup, model: ModelDrafter, lookup_k: int = 8) -> None:
        _check_k(lookup_k, "lookup_k")
        self.lookup = lookup
        self.model = model
        self.lookup_k = int(lookup_k)
        self.lookup_steps = 0  # steps drafted by the lookup since start (the rest by the model)
        self.name = f"{lookup.name}_sd"

    @property
    def max_draft(self) -> int:
        """The longest draft a lookup step makes (the engine sizes its context check by it)."""
        return self.lookup_k

    def start(self, sequences: list[list[int]]) -> None:
        self.lookup_steps = 0
        self.model.start(sequences)

    def prefill(self, sequences: list[list[int]]) -> None:
        self.model.prefill(sequences)

    def propose(self, sequences, policy, rule, sampling, ctx, active) -> Draft:
        live = active.tolist()
        found = [self.lookup.lookup(seq, self.lookup_k) if act else [] for seq, act in zip(sequences, live)]
        if any(live) and all(f for f, act in zip(found, live) if act):
            self.lookup_steps += 1
            policy.begin_step()  # a step begins for the policy as well (it sees the outcome in update)
            return one_hot_draft(found, self.lookup.vocab_size, rule)
        return self.model.propose(sequences, policy, rule, sampling, ctx, active)

    def commit(self, sequences: list[list[int]], valid_prefix: torch.Tensor) -> None:
        self.model.commit(sequences, valid_prefix)
