"""Phrase drafting in the manner of Ouroboros (Zhao et al., 2024, "Ouroboros: Generating Longer
Drafts Phrase by Phrase for Faster Speculative Decoding", EMNLP): a pool of phrases extends the
draft model's drafts, so that one draft-model forward can yield several draft tokens.

The pool (:class:`PhrasePool`, one per row, emptied by ``start``) maps a key, the last one or two
tokens of a context, to the latest phrase (up to ``max_phrase`` tokens) seen after that key. It is
filled from

* the row's sequence: the prompt and every verified token (the target's outputs),
* the rejected tail of each draft (the draft model's tokens after the first rejected one),
* the target's verification of the rejected positions: after a rejected draft prefix the target's
  most likely next tokens, chained while the draft agreed with them (Ouroboros' phrases from the
  discarded verification results).

A step of :class:`PhraseDrafter` (method ``phrase_sd``) runs the draft model up to the policy's
``k`` forwards, at least one. Before the first forward, and after each forward's one token drawn
from the draft model, it looks the draft up in the pool (its longest key, two tokens then one) and
appends the phrase found, as one-hot draft tokens. The next forward feeds the drawn token and the phrase as one block; the draft model keeps
the phrase up to the first token it would not pick itself (its argmax), and draws its next token
after the kept part. The phrase appended after the last forward stays unchecked: it lengthens the
draft at no draft-model cost. Draft tokens per step, model and phrase tokens together, are at most
``max_draft``.

Worked example (greedy, ``k = 2``): the pool holds nothing after ``(5, 6)``, so after
``[.., 5, 6]`` the first forward draws 7 alone; the pool holds
``(6, 7) -> [8, 9, 4]``, so the draft is ``[7, 8, 9, 4]``. The second forward feeds ``[7, 8, 9, 4]``;
the draft model's argmax after 7 is 8, after 8 is 9, after 9 is 2: it keeps ``[8, 9]``, drops 4 and
draws 2, and the pool's phrase after ``(9, 2)`` is appended unchecked.

Why it is lossless. A lossless rule is exact when each draft token's recorded distribution is the
law it was drawn from given the tokens before it. Model tokens are drawn from the draft model's
distribution, which is recorded. Which phrase is appended, and how much of it the draft model
keeps, is a function of tokens already fixed (the sequence, this draft's earlier tokens and the
pool, built from earlier steps) and of the draft model's deterministic outputs, never of the
random draws the verifier makes or reuses; so a phrase token is drawn from a point mass, and its
recorded distribution is one-hot. For ERSD the model tokens take the race keys of their own
positions, as in plain drafting.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from quickdraft.decoding.drafters import Draft, pending_block
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Policy, _check_k
from quickdraft.verification.rules import Rule, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs, raw_probs

#: longest key of the pool (tokens of context a phrase is looked up by)
KEY_LENGTH = 2


@dataclass(frozen=True)
class PhraseConfig:
    """The phrase pool and draft of ``phrase_sd``."""

    max_phrase: int = 8
    """Most tokens a phrase holds (one lookup appends at most this many)."""
    pool_size: int = 4096
    """Most phrases a row's pool keeps; the least recently seen goes first."""
    max_draft: int = 16
    """Most draft tokens per step, the draft model's and the phrases' together."""

    def __post_init__(self) -> None:
        _check_k(self.max_phrase, "max_phrase (--phrase-len)")
        _check_k(self.max_draft, "max_draft (--phrase-max-draft)")
        if isinstance(self.pool_size, bool) or int(self.pool_size) != self.pool_size or self.pool_size < 1:
            raise QuickdraftError(f"pool_size (--phrase-pool) must be an integer >= 1, got {self.pool_size!r}")


class PhrasePool:
    """The phrases one sequence has seen: for each key (one or two tokens) the latest phrase that
    followed it, at most ``size`` keys, the least recently seen dropped first.

    With ``max_phrase = 3``, ``add([1, 2, 3, 4, 5])`` stores ``(1,) -> [2, 3, 4]``,
    ``(1, 2) -> [3, 4, 5]``, ``(2,) -> [3, 4, 5]`` … ``(4,) -> [5]``, and
    ``lookup([9, 2, 3], 2)`` is ``[4, 5]`` (key ``(2, 3)``).
    """

    def __init__(self, max_phrase: int = 8, size: int = 4096) -> None:
        self.max_phrase = max_phrase
        self.size = size
        self.phrases: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()
        self.seen = 0  # positions of the row's sequence whose phrases are final (see harvest)

    def __len__(self) -> int:
        return len(self.phrases)

    def put(self, key: tuple[int, ...], phrase: tuple[int, ...]) -> None:
        """Make ``phrase`` the latest after ``key`` (a prefix of the stored phrase refreshes it)."""
        if not phrase:
            return
        stored = self.phrases.get(key)
        if stored is None or stored[: len(phrase)] != phrase:
            self.phrases[key] = phrase[: self.max_phrase]
        self.phrases.move_to_end(key)
        while len(self.phrases) > self.size:
            self.phrases.popitem(last=False)

    def add(self, tokens: list[int], first: int = 0) -> None:
        """Store the phrase after every position ``i >= first`` of ``tokens`` (keys end at ``i``),
        later positions last, so that the latest occurrence of a key wins."""
        for i in range(max(first, 0), len(tokens) - 1):
            phrase = tuple(tokens[i + 1: i + 1 + self.max_phrase])
            for n in range(1, KEY_LENGTH + 1):
                if i - n + 1 >= 0:
                    self.put(tuple(tokens[i - n + 1: i + 1]), phrase)

    def harvest(self, sequence: list[int]) -> None:
        """Add the phrases of ``sequence`` not added yet; those of its last ``max_phrase`` positions
        are still short and are added again when the sequence grows."""
        self.add(sequence, self.seen)
        self.seen = max(self.seen, len(sequence) - self.max_phrase)

    def lookup(self, context: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens of the phrase after the longest key ending ``context`` (``[]``: none)."""
        for n in range(min(KEY_LENGTH, len(context)), 0, -1):
            phrase = self.phrases.get(tuple(context[-n:]))
            if phrase is not None:
                return list(phrase[:k])
        return []

    def add_verification(self, draft: list[int], target_ids: list[int], num_accepted: int) -> None:
        """Phrases from a verified draft that was rejected at ``draft[num_accepted]``: its rejected
        tail, and the target's most likely tokens after each rejected prefix.

        ``target_ids[c]`` is the target's argmax after ``draft[:c]`` (``len(draft) + 1`` of them).
        After the prefix ``draft[:c]`` (``c > num_accepted``) the phrase is ``target_ids[c]``, then
        ``target_ids[c + 1]`` if ``draft[c] == target_ids[c]`` (the target's next token after its own
        prediction), and so on while the draft agrees.
        """
        n, d = num_accepted, len(draft)
        if n >= d:
            return
        self.add(draft[n:])
        for c in range(n + 1, d + 1):
            phrase = [target_ids[c]]
            j = c
            while j < d and draft[j] == target_ids[j] and len(phrase) < self.max_phrase:
                phrase.append(target_ids[j + 1])
                j += 1
            for length in range(1, min(KEY_LENGTH, c) + 1):
                self.put(tuple(draft[c - length: c]), tuple(phrase))


class PhraseDrafter:
    """Ouroboros-style phrase drafting (method ``phrase_sd``): the draft model's tokens extended by
    phrases from a per-row :class:`PhrasePool`; see the module docstring.

    Attributes
    ----------
    runner: the draft model's runner.
    config: the pool and draft limits (:class:`PhraseConfig`).
    pools: the pool of every row, by the row's stable id (``ctx.extra["row_ids"]``, else its index).
    phrase_tokens: phrase tokens drafted since ``start`` (the rest came from the draft model).
    """

    name = "phrase_sd"

    def __init__(self, runner: ModelRunner, vocab_size: int, config: PhraseConfig = PhraseConfig()) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.config = config
        self.pools: dict[int, PhrasePool] = {}
        self.phrase_tokens = 0
        self._rows: list[int] = []  # row ids of the last proposal, in batch order

    @property
    def max_draft(self) -> int:
        """The longest draft of a step (the engine sizes its context check by it)."""
        return self.config.max_draft

    def start(self, sequences: list[list[int]]) -> None:
        self.runner.reset(len(sequences))
        self.pools = {}
        self.phrase_tokens = 0

    def prefill(self, sequences: list[list[int]]) -> None:
        """Feed all but the last token of every sequence (the last one is fed by the first draft)."""
        prefix = [seq[:-1] for seq in sequences]
        if max(len(p) for p in prefix) > 0:
            ids, valid = pending_block(prefix, self.runner.lengths)
            self.runner.forward(ids, valid, logits_to_keep=1)

    def _pools_for(self, sequences: list[list[int]], ctx: VerifyContext) -> list[PhrasePool]:
        """Every row's pool, with its sequence's new phrases added; pools of rows that left the
        batch are dropped."""
        ids = ctx.extra.get("row_ids")
        self._rows = torch.as_tensor(ids).tolist() if ids is not None else list(range(len(sequences)))
        self.pools = {r: self.pools[r] for r in self._rows if r in self.pools}
        cfg = self.config
        for row_id, seq in zip(self._rows, sequences):
            self.pools.setdefault(row_id, PhrasePool(cfg.max_phrase, cfg.pool_size)).harvest(seq)
        return [self.pools[r] for r in self._rows]

    def propose(
        self,
        sequences: list[list[int]],
        policy: Policy,
        rule: Rule,
        sampling: SamplingParams,
        ctx: VerifyContext,
        active: torch.Tensor,
    ) -> Draft:
        max_k = policy.begin_step()  # draft-model forwards
        limit = min(self.config.max_draft, getattr(policy, "cap", self.config.max_draft))
        pools = self._pools_for(sequences, ctx)
        runner, b, v = self.runner, len(sequences), self.vocab_size
        needs_raw = getattr(rule, "needs_raw", False)
        live = active.tolist()
        drafted: list[list[int]] = [[] for _ in range(b)]
        # per draft token: the forward whose distribution it was drawn from, None for a phrase token
        source: list[list[int | None]] = [[] for _ in range(b)]
        step_probs: list[torch.Tensor] = []  # [B, V] per forward
        step_raws: list[torch.Tensor] = []  # [B, V] per forward, when the rule reads raw distributions
        unchecked = [0] * b  # phrase tokens appended after the last forward
        for r in range(b):  # the phrase after the sequence itself, checked by the first forward
            if live[r]:  # (leaving room for the draft model's token: every step runs it at least once)
                self._append_phrase(r, pools[r], sequences[r], drafted, source, unchecked, limit - 1)
        for i in range(max_k):
            rows = [r for r in range(b) if live[r] and len(drafted[r]) < limit]
            if not rows:
                break
            drafting = set(rows)
            # 1. feed the drafting rows' new tokens (the last drawn token and its phrase) as one block
            fed = runner.lengths.tolist()
            view = [seq + d if r in drafting else (seq + d)[: fed[r]] for r, (seq, d) in enumerate(zip(sequences, drafted))]
            ids, valid = pending_block(view, runner.lengths)
            keep = 1 + max(unchecked[r] for r in rows)
            out = runner.forward(ids, valid, logits_to_keep=keep, output_hidden=policy.needs_hidden)
            logits = out.logits[:, :, :v]  # [B, keep, V]
            # 2. keep each phrase up to the first token the draft model would not pick
            cols = [keep - 1] * b  # where each row's next token is drawn
            for r in rows:
                u, unchecked[r] = unchecked[r], 0
                if u == 0:
                    continue
                first = keep - 1 - u  # the column after the drawn token, predicting the phrase's first
                picks = logits[r, first: first + u].argmax(dim=-1).tolist()
                phrase = drafted[r][-u:]
                j = next((j for j in range(u) if picks[j] != phrase[j]), u)
                if j < u:
                    del drafted[r][len(drafted[r]) - u + j:], source[r][len(source[r]) - u + j:]
                cols[r] = first + j
            lengths = torch.tensor([len(s) + len(d) for s, d in zip(sequences, drafted)], device=runner.device)
            if bool((runner.lengths > lengths).any()):
                runner.truncate(torch.minimum(runner.lengths, lengths))
            # 3. draw the next token of every drafting row from the draft model
            at = torch.tensor(cols, device=logits.device)
            picked = logits[torch.arange(b, device=logits.device), at]  # [B, V]
            idle = torch.tensor([r not in drafting for r in range(b)], device=logits.device)
            picked = picked.masked_fill(idle.unsqueeze(1), 0.0)  # rows not drafting: any valid distribution
            probs = logits_to_probs(picked, sampling)
            offsets = torch.tensor([len(d) for d in drafted], device=logits.device)
            token = rule.propose(probs, ctx, offset=offsets)  # [B]
            raw = raw_probs(picked) if needs_raw or i + 1 < max_k else None
            tokens = token.tolist()
            step_probs.append(probs)
            if needs_raw:
                step_raws.append(raw)
            # 4. append each drawn token and the pool's phrase after it (unchecked until the next forward)
            for r in rows:
                drafted[r].append(tokens[r])
                source[r].append(i)
                self._append_phrase(r, pools[r], sequences[r], drafted, source, unchecked, limit)
            hidden = out.hidden[torch.arange(b, device=logits.device), at] if out.hidden is not None else None
            if i + 1 < max_k and not policy.keep_drafting(i, raw, hidden, token=token):
                break
        self.phrase_tokens += sum(f is None for row in source for f in row)
        return _draft_of(drafted, source, step_probs, step_raws if needs_raw else None, v, runner.device)

    def _append_phrase(self, r, pool, sequence, drafted, source, unchecked, limit) -> None:
        """Append to row ``r``'s draft the pool's phrase after it (one-hot, unchecked), within ``limit``."""
        room = min(limit - len(drafted[r]), self.config.max_phrase)
        phrase = pool.lookup(sequence + drafted[r], room) if room > 0 else []
        drafted[r] += phrase
        source[r] += [None] * len(phrase)
        unchecked[r] = len(phrase)

    def observe(self, draft: Draft, target_ids: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Refresh the pools from this step's verification: ``target_ids [B, K + 1]`` the target's
        most likely token after each draft prefix, ``num_accepted [B]``."""
        ids, lengths = draft.ids.tolist(), draft.lengths.tolist()
        target, accepted = target_ids.tolist(), num_accepted.tolist()
        for r, row_id in enumerate(self._rows):
            pool = self.pools.get(row_id)
            if pool is not None and accepted[r] < lengths[r]:
                d = lengths[r]
                pool.add_verification(ids[r][:d], target[r][: d + 1], accepted[r])

    def commit(self, sequences: list[list[int]], valid_prefix: torch.Tensor) -> None:
        """Keep the cached tokens that are still a prefix of the sequences (``valid_prefix [B]``)."""
        self.runner.truncate(torch.minimum(self.runner.lengths, valid_prefix))


def _draft_of(drafted: list[list[int]], source: list[list[int | None]], step_probs: list[torch.Tensor],
              step_raws: list[torch.Tensor] | None, vocab_size: int, device: torch.device) -> Draft:
    """The :class:`Draft` of ragged rows: token ``drafted[r][j]`` was drawn from the draft model's
    distribution ``step_probs[f][r]`` (``[V]``) of forward ``f = source[r][j]``, or is a phrase token
    (``None``: one-hot); padding is one-hot at token 0."""
    b, k = len(drafted), max(len(d) for d in drafted)
    ids = torch.tensor([d + [0] * (k - len(d)) for d in drafted], dtype=torch.long, device=device).view(b, k)
    one_hot = torch.zeros((b, k, vocab_size), device=device).scatter_(-1, ids.unsqueeze(-1), 1.0)  # [B, K, V]
    model = [(r, j, f) for r, row in enumerate(source) for j, f in enumerate(row) if f is not None]
    rows, cols, forward = torch.tensor(model, dtype=torch.long, device=device).view(-1, 3).unbind(1)  # [M] each

    def fill(per_forward: list[torch.Tensor]) -> torch.Tensor:
        out = one_hot.clone()
        if model:
            out[rows, cols] = torch.stack(per_forward)[forward, rows]  # [F, B, V] -> [M, V]
        return out

    return Draft(
        ids=ids, probs=fill(step_probs), lengths=torch.tensor([len(d) for d in drafted], dtype=torch.long, device=device),
        raw_probs=fill(step_raws) if step_raws is not None else None, forwards=len(step_probs),
    )
