"""The generation loop: plain decoding, chain and token-tree speculative decoding, batched.

One step, for every row of the batch at once (the verbs of :mod:`quickdraft.decoding.proposals`)::

    1. propose   the proposer drafts a token tree whose root is the last emitted token: a chain of
                 up to K tokens (the policy decides K) or a tree (its config decides the shape),
                 no more than the tokens left to generate minus one     -> Proposal
    2. score     one target forward over [pending tokens, tree nodes]    -> [B, M, V]
    3. verify    walk each row's tree with the rule (verify_chain for a chain, verify_tree for a
                 tree)                                                   -> Walk: n accepted per row
    4. commit    append the n accepted tokens and the recovered-or-bonus token; roll both KV caches
                 back to the part that is still a prefix of the sequence

Plain decoding is the same step with K = 0: ``verify_chain`` then only emits the bonus token, so
every rule (greedy, sampling, exponential race) also defines its own plain decoding.

The prefill reads every prompt token, and the logits after the last one give each row its first
new token, drawn by the rule as such a plain step; the draft side then reads the prompt, and the
first step already drafts after that token (the runtimes' own loops do the same, and it streams the
first token one speculative step sooner). Contrastive decoding scores against the amateur's
distributions, so there the first step emits the first token after a prefill of all but the last
prompt token.

:class:`Decoder` holds a batch's state and runs one step per :meth:`Decoder.step`; :func:`generate`
steps a fixed batch to the end, and the server's scheduler (continuous batching) adds and removes
rows between steps.

A draft longer than the budget left (``max_new_tokens`` minus the tokens emitted, minus the bonus
token) would be cut off after verification anyway, so each step drafts at most that many tokens
(:class:`quickdraft.decoding.policies.BudgetCap`); a chain's last token is then a plain step, a tree keeps
at least one layer. The cap depends only on the tokens emitted so far, so it leaves the output
distribution (and the greedy text) as it is. Policies may ask for at most
:data:`quickdraft.decoding.policies.MAX_DRAFT_LENGTH` tokens per step.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

import torch

from quickdraft.decoding.amusd import AsyncProposer
from quickdraft.decoding.contrastive import ContrastiveProposer
from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter, NGramModelDrafter, pending_block
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.metrics import GenerationMetrics
from quickdraft.decoding.policies import Constant, Policy
from quickdraft.decoding.proposals import ChainProposer, Proposer, Walk
from quickdraft.verification.race import seed_words
from quickdraft.verification.rules import Contrastive, ExponentialRace, Greedy, Lossless, Rule, VerifyContext
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams

if TYPE_CHECKING:
    from quickdraft.decoding.tree_decoding import TreeDrafter

Method = Literal["ar", "sd", "ngram", "ngram_sd", "rest", "rest_sd", "phrase_sd", "amusd", "cd", "scd", "tree"]
METHODS: tuple[str, ...] = (
    "ar", "sd", "ngram", "ngram_sd", "rest", "rest_sd", "phrase_sd", "amusd", "cd", "scd", "tree")

#: the methods whose steps may be plain at a policy's choice (chains drafted by ChainProposer)
SKIPPABLE: tuple[str, ...] = ("sd", "ngram", "ngram_sd", "rest", "rest_sd", "phrase_sd")

#: called as ``on_tokens(row, new_token_ids)`` whenever a row gains tokens
TokenCallback = Callable[[int, list[int]], None]


@dataclass
class GenerationOutput:
    """Result of :func:`generate` for a batch.

    Attributes
    ----------
    sequences: the new token ids of every row (prompt excluded).
    metrics: one :class:`GenerationMetrics` per row.
    batch_metrics: sums over rows, with the batch's wall times.
    """

    sequences: list[list[int]]
    metrics: list[GenerationMetrics]
    batch_metrics: GenerationMetrics
    finish_reasons: list[str] = field(default_factory=list)


def default_rule(sampling: SamplingParams) -> Rule:
    """Greedy exact match at temperature 0, lossless speculative sampling otherwise."""
    return Greedy() if sampling.greedy else Lossless()


def check_max_new_tokens(max_new_tokens: int) -> None:
    """Raise :class:`QuickdraftError` unless ``max_new_tokens`` is an integer >= 1."""
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, float))
            or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1):
        raise QuickdraftError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


def check_prompts(prompts: list[list[int]], vocab_size: int) -> None:
    """Raise :class:`QuickdraftError` unless ``prompts`` is a non-empty list of non-empty lists of
    token ids in ``[0, vocab_size)`` (an id outside the model's vocabulary has no embedding)."""
    if isinstance(prompts, (str, bytes)) or not prompts:
        raise QuickdraftError("prompts must be a non-empty list of token-id lists")
    for row, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise QuickdraftError(f"prompt {row} must be a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise QuickdraftError("empty prompt: every prompt needs at least one token")
        for t in prompt:
            try:
                ok = not isinstance(t, bool) and 0 <= operator.index(t) < vocab_size
            except TypeError:
                ok = False
            if not ok:
                raise QuickdraftError(
                    f"prompt {row} holds token id {t!r}, not an id in the model's vocabulary [0, {vocab_size})"
                )


def _stop_index(new_ids: list[int], eos_ids: set[int]) -> int | None:
    for i, t in enumerate(new_ids):
        if t in eos_ids:
            return i
    return None


def append_emitted(
    row: int,
    emitted: list[int],
    new_ids: list[list[int]],
    sequences: list[list[int]],
    finish: list[str],
    max_new_tokens: int,
    eos_ids: set[int],
    stop: Callable[[int, list[int]], int | None] | None,
    on_tokens: TokenCallback | None,
) -> bool:
    """Append one step's emitted tokens to ``row``, cut at ``max_new_tokens``, EOS (kept) and stop
    strings; stream them; update ``finish[row]``. Returns whether the row is still active."""
    emitted = emitted[: max_new_tokens - len(new_ids[row])]
    cut = _stop_index(emitted, eos_ids)
    if cut is not None:
        emitted = emitted[: cut + 1]
        finish[row] = "eos"
    new_ids[row].extend(emitted)
    sequences[row].extend(emitted)
    if stop is not None:
        stop_cut = stop(row, new_ids[row])
        if stop_cut is not None:
            drop = len(new_ids[row]) - stop_cut
            if drop > 0:
                del new_ids[row][stop_cut:]
                del sequences[row][len(sequences[row]) - drop:]
                emitted = emitted[: max(0, len(emitted) - drop)]
            finish[row] = "stop"
    if on_tokens is not None and emitted:
        on_tokens(row, emitted)
    return finish[row] == "length" and len(new_ids[row]) < max_new_tokens


def finish_output(
    new_ids: list[list[int]],
    metrics: list[GenerationMetrics],
    finish: list[str],
    prefill_seconds: float,
    decode_seconds: float,
    target_forwards: int,
    draft_forwards: int,
) -> GenerationOutput:
    """Stamp every row's metrics with its token count and the batch's wall times, and sum them."""
    for m, ids in zip(metrics, new_ids):
        m.new_tokens = len(ids)
        m.prefill_seconds = prefill_seconds
        m.decode_seconds = decode_seconds
    batch = GenerationMetrics.aggregate(metrics)
    batch.prefill_seconds = prefill_seconds
    batch.decode_seconds = decode_seconds
    batch.target_forwards = target_forwards
    batch.draft_forwards = draft_forwards
    return GenerationOutput(sequences=new_ids, metrics=metrics, batch_metrics=batch, finish_reasons=finish)


def generate(
    target: ModelRunner,
    prompts: list[list[int]],
    *,
    method: Method = "sd",
    drafter: ModelDrafter | NGramDrafter | NGramModelDrafter | TreeDrafter | None = None,
    rule: Rule | None = None,
    policy: Policy | None = None,
    sampling: SamplingParams = SamplingParams(),
    max_new_tokens: int = 128,
    seed: int | None = 0,
    eos_token_ids: set[int] | None = None,
    stop: Callable[[int, list[int]], int | None] | None = None,
    on_tokens: TokenCallback | None = None,
) -> GenerationOutput:
    """Generate continuations of a batch of tokenised prompts.

    Parameters
    ----------
    target:
        The target model's runner.
    prompts:
        ``B`` non-empty lists of token ids in ``[0, vocab_size)`` of the target.
    method:
        ``"ar"`` plain decoding, ``"sd"`` / ``"ngram"`` / ``"ngram_sd"`` / ``"rest"`` / ``"rest_sd"`` /
        ``"phrase_sd"`` chain speculative decoding with ``drafter``, ``"amusd"`` chains drafted on a
        thread of their own while the target verifies (:mod:`quickdraft.decoding.amusd`), ``"cd"`` / ``"scd"`` contrastive
        decoding with the draft model as the amateur, plain / speculative (:mod:`quickdraft.decoding.contrastive`),
        ``"tree"`` token-tree speculative decoding.
    drafter:
        A :class:`ModelDrafter` (``"sd"``), :class:`NGramDrafter` (``"ngram"``),
        :class:`quickdraft.decoding.retrieval.RetrievalDrafter` (``"rest"``), :class:`NGramModelDrafter`
        (``"ngram_sd"`` / ``"rest_sd"``: prompt lookup / retrieval, the draft model where it finds
        nothing), :class:`quickdraft.decoding.phrase.PhraseDrafter` (``"phrase_sd"``: the draft model's
        tokens extended by phrases), :class:`quickdraft.decoding.amusd.AsyncDrafter` (``"amusd"``),
        :class:`quickdraft.decoding.contrastive.ContrastiveDrafter` (``"cd"`` /
        ``"scd"``) or :class:`quickdraft.decoding.tree_decoding.TreeDrafter` (``"tree"``).
    rule:
        Acceptance rule (default: :func:`default_rule`); trees take the lossless rules, FSD and
        ERSD (:mod:`quickdraft.decoding.tree_decoding`).
    policy:
        Draft-length policy of a chain (default ``Constant(4)``); each step drafts at most the
        tokens left to generate minus one, and at most :data:`quickdraft.decoding.policies.MAX_DRAFT_LENGTH`.
    sampling:
        Temperature / top-k / top-p, applied identically to target and draft.
    max_new_tokens:
        Per row.
    seed:
        Seeds the random generator; same seed, same inputs -> same output.
    eos_token_ids:
        A row stops after emitting one of these (the EOS token is kept).
    stop:
        ``stop(row, new_ids) -> cut or None``: a row stops when it returns a cut index (e.g. for
        stop strings); the new tokens are cut to ``new_ids[:cut]``.
    on_tokens:
        Streaming callback.
    """
    if method not in METHODS:
        raise QuickdraftError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    check_prompts(prompts, int(target.model.config.vocab_size))
    t0 = time.perf_counter()
    decoder = Decoder(
        target, prompts, method=method, drafter=drafter, rule=rule, policy=policy, sampling=sampling,
        max_new_tokens=max_new_tokens, seed=seed, eos_token_ids=eos_token_ids, stop=stop, on_tokens=on_tokens,
    )
    prefill_seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    while decoder.active.any():
        decoder.step()
    decode_seconds = time.perf_counter() - t1
    return finish_output(decoder.new_ids, decoder.metrics, decoder.finish, prefill_seconds, decode_seconds,
                         target.num_forwards, decoder.draft_forwards)


def proposer_for(drafter, policy: Policy, rule: Rule, sampling: SamplingParams, vocab_size: int) -> Proposer:
    """The proposer of ``drafter``: its own when it makes one (a tree drafter's
    ``proposer(policy, rule, sampling)``), else a :class:`ChainProposer` around it (``None``: plain
    decoding)."""
    make = getattr(drafter, "proposer", None)
    if make is not None:
        return make(policy, rule, sampling)
    return ChainProposer(drafter, policy, rule, sampling, vocab_size)


def _grow(runner, n: int) -> None:
    if runner.batch_size == 0:
        runner.reset(n)
    else:
        runner.add_rows(n)


def _shrink(runner, rows: list[int]) -> None:
    if len(set(rows)) == runner.batch_size:
        runner.reset(0)
    else:
        runner.remove_rows(rows)


def _prefill(runner, sequences: list[list[int]], first_new: int, whole: bool = False):
    """Feed rows ``first_new ..`` every token but their last (``whole``: every token); earlier rows
    are padding. Returns the forward's output (logits ``[B, 1, V']`` after each row's last fed
    token), or ``None`` where there was nothing to feed."""
    lengths = runner.lengths.tolist()
    prefix = [s[: int(n)] for s, n in zip(sequences[:first_new], lengths)] + [
        s if whole else s[:-1] for s in sequences[first_new:]]
    if max(len(p) - int(n) for p, n in zip(prefix, lengths)) <= 0:
        return None
    ids, valid = pending_block(prefix, runner.lengths)
    return runner.forward(ids, valid, logits_to_keep=1)


class Decoder:
    """A batch decoded one step at a time: :func:`generate` steps a fixed batch to the end; a
    scheduler (continuous batching, :mod:`quickdraft.serve.scheduler`) adds rows with
    :meth:`add_rows` and drops them with :meth:`remove_rows` between steps.

    Parameters are those of :func:`generate`; ``prompts`` may be empty, and ``max_new_tokens`` is the
    budget of these first rows (:meth:`add_rows` takes one per row). The runners need
    ``add_rows`` / ``remove_rows`` for rows to join or leave a batch that is not empty.

    Attributes
    ----------
    sequences: prompt plus new tokens of every row.
    new_ids: the new tokens of every row.
    metrics: one :class:`GenerationMetrics` per row.
    finish: ``"length"`` while a row runs or when it ran out of budget, ``"eos"``, ``"stop"``.
    active: ``[B]`` bool, rows still generating.
    max_new_tokens: every row's budget.
    proposer: the drafting side (:func:`proposer_for`): its runner's rows follow the batch's.
    draft_forwards: draft forwards of all steps.
    """

    def __init__(
        self,
        target: ModelRunner,
        prompts: list[list[int]],
        *,
        method: Method = "sd",
        drafter: ModelDrafter | NGramDrafter | NGramModelDrafter | TreeDrafter | None = None,
        rule: Rule | None = None,
        policy: Policy | None = None,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int = 128,
        seed: int | None = 0,
        eos_token_ids: set[int] | None = None,
        stop: Callable[[int, list[int]], int | None] | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> None:
        if method not in METHODS:
            raise QuickdraftError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
        self.vocab = int(target.model.config.vocab_size)
        if isinstance(prompts, (str, bytes)) or len(prompts):
            check_prompts(prompts, self.vocab)
        check_max_new_tokens(max_new_tokens)
        if method != "ar" and drafter is None:
            raise QuickdraftError(f"method {method!r} needs a drafter")
        self.target = target
        self.method = method
        self.drafter = drafter
        self.rule = rule or default_rule(sampling)
        self.policy = policy or Constant(4)
        self.sampling = sampling
        self.eos_ids = set(eos_token_ids or ())
        self.stop = stop
        self.on_tokens = on_tokens
        if getattr(self.policy, "may_skip", False) and method not in SKIPPABLE:
            raise QuickdraftError(f"policy {self.policy.name!r} chooses between drafting a chain and a plain step: "
                                  f"run it with {', '.join(SKIPPABLE)}")
        self.proposer = proposer_for(None if method == "ar" else drafter, self.policy, self.rule, sampling, self.vocab)
        if (method == "tree") == isinstance(self.proposer, ChainProposer) or (
                (method == "amusd") != isinstance(self.proposer, AsyncProposer)):
            raise QuickdraftError(f"method {method!r} cannot draft with a {type(drafter).__name__}")
        if isinstance(self.rule, Contrastive) and not isinstance(self.proposer, ContrastiveProposer):
            raise QuickdraftError("the contrastive rule verifies against scores made from the amateur's distributions: "
                                  "run it with method cd or scd")
        self._check_context(prompts, [max_new_tokens] * len(prompts))

        b = len(prompts)
        device = target.device
        # a token tree is built and walked on the host (small tensors, many steps); only the model
        # forwards run on the target's device, so the tree's random source lives on the host
        self.generator = torch.Generator(device="cpu" if method == "tree" else device).manual_seed(
            int(seed) if seed is not None else int(torch.seed() % (1 << 62)))
        self.sequences = [list(p) for p in prompts]
        self.new_ids: list[list[int]] = [[] for _ in range(b)]
        self.metrics = [GenerationMetrics(prompt_tokens=len(p)) for p in prompts]
        self.active = torch.ones(b, dtype=torch.bool, device=device)
        self.finish = ["length"] * b
        self.max_new_tokens = [int(max_new_tokens)] * b
        self.row_ids = torch.arange(b, device=device)
        self._next_row_id = b
        #: per-row race seeds (int64 ``[B]``) once a row was added with a seed of its own (:meth:`add_rows`)
        self.row_seeds: torch.Tensor | None = None
        self.draft_forwards = 0

        # -- prefill: the target reads each prompt and gives its first token, then the draft side ---
        # (the contrastive rule scores against the amateur, which has not read the prompt yet: its
        # first token comes from the first step, after a prefill of every prompt token but the last)
        self.first_from_prefill = not isinstance(self.rule, Contrastive)
        target.reset(b)
        target.num_forwards = 0
        self.proposer.start(self.sequences)
        # a policy that will never draft (CostAware on a target whose verification no draft repays)
        # leaves the draft model unfed: a draft that came after all would feed it what is pending
        self.feeds_draft = not getattr(self.policy, "never_drafts", False)
        if b:
            self._prefill_target(0)
            if self.feeds_draft:
                self.proposer.prefill(self.sequences)

    # -- rows ------------------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.sequences)

    def _check_context(self, prompts: list[list[int]], max_new_tokens: list[int]) -> None:
        if not prompts:
            return
        row = max(range(len(prompts)), key=lambda r: len(prompts[r]) + max_new_tokens[r])
        limit, whose = self.target.max_positions, "the target's"
        if self.proposer.max_positions is not None:
            limit, whose = min(limit, self.proposer.max_positions), "the models'"
        if len(prompts[row]) + max_new_tokens[row] + self.proposer.room > limit:
            raise QuickdraftError(
                f"context overflow: prompt ({len(prompts[row])} tokens) + max_new_tokens ({max_new_tokens[row]}) "
                f"+ draft exceeds {whose} maximum of {limit} tokens"
            )

    def add_rows(self, prompts: list[list[int]], max_new_tokens: list[int], *, seeds: list[int] | None = None,
                 row_ids: list[int] | None = None) -> None:
        """Append rows for ``prompts`` (each with its own ``max_new_tokens``) and prefill them; they
        take part from the next :meth:`step`. On an error the batch is left as it was.

        ``seeds`` and ``row_ids`` (ERSD only, whose draws are keyed by (seed, row id, position)):
        each new row's race seed and row id (defaults: the rule's seed, a fresh id). A row added with
        seed ``s`` and id ``i`` draws what row ``i`` of a batch decoded alone with seed ``s`` draws,
        so its text does not depend on the rows beside it, the draft length or the drafter.
        """
        if not prompts:
            return
        check_prompts(prompts, self.vocab)
        if len(max_new_tokens) != len(prompts):
            raise QuickdraftError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        for n in max_new_tokens:
            check_max_new_tokens(n)
        for name, values in (("seeds", seeds), ("row_ids", row_ids)):
            if values is None:
                continue
            if not isinstance(self.rule, ExponentialRace):
                raise QuickdraftError(f"{name} key the draws of rows under the ersd rule only, not {self.rule.name!r}")
            if len(values) != len(prompts):
                raise QuickdraftError(f"{len(prompts)} prompts but {len(values)} {name}")
        if row_ids is not None and any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 1 << 63
                                       for i in row_ids):
            raise QuickdraftError(f"row_ids must be integers in [0, 2**63), got {row_ids!r}")
        new_seeds = seed_words(seeds) if seeds is not None else None  # checks them
        self._check_context(prompts, max_new_tokens)
        first, n = self.batch_size, len(prompts)
        device = self.target.device
        runners = [self.target] + [r for r in [self.proposer.runner] if r is not None]
        self.sequences += [list(p) for p in prompts]
        self.new_ids += [[] for _ in prompts]
        self.metrics += [GenerationMetrics(prompt_tokens=len(p)) for p in prompts]
        self.active = torch.cat([self.active, torch.ones(n, dtype=torch.bool, device=device)])
        self.finish += ["length"] * n
        self.max_new_tokens += [int(m) for m in max_new_tokens]
        ids = (torch.tensor(row_ids, dtype=torch.long, device=device) if row_ids is not None
               else torch.arange(self._next_row_id, self._next_row_id + n, device=device))
        self.row_ids = torch.cat([self.row_ids, ids])
        self._next_row_id += n
        if new_seeds is not None or self.row_seeds is not None:
            default = seed_words([self.rule.seed]).to(device)
            before = self.row_seeds if self.row_seeds is not None else default.expand(first)
            added = new_seeds.to(device) if new_seeds is not None else default.expand(n)
            self.row_seeds = torch.cat([before, added])
        grown = []
        try:
            for runner in runners:
                _grow(runner, n)
                grown.append(runner)
            self._prefill_target(first)
            for runner in runners[1:] if self.feeds_draft else ():
                _prefill(runner, self.sequences, first)
        except Exception:
            rows = list(range(first, first + n))
            for runner in grown:
                if runner.batch_size == first + n:
                    _shrink(runner, rows)
            self._drop(rows)
            raise

    def _prefill_target(self, first: int) -> None:
        """Prefill rows ``first ..`` of the target; unless the rule is contrastive, emit each row's
        first token from the prefill's last logits, drawn by the rule as a plain step (a step with no
        draft: the rule's own plain decoding, so the output distribution is the same), counted as a
        prefill token rather than a step."""
        out = _prefill(self.target, self.sequences, first, whole=self.first_from_prefill)
        if out is not None:
            for m in self.metrics[first:]:
                m.target_forwards += 1
        if not self.first_from_prefill:
            return
        rows = range(first, self.batch_size)
        gen_device = self.generator.device
        prompts = self.sequences[first:]
        active = self.active[first:].to(gen_device)
        ctx = VerifyContext(generator=self.generator,
                            positions=torch.tensor([len(s) for s in prompts], dtype=torch.long, device=gen_device),
                            extra=self._row_keys(slice(first, None), gen_device))
        plain = ChainProposer(None, Constant(1), self.rule, self.sampling, self.vocab)
        walk = plain.propose(prompts, active, 0, ctx).verify(out.logits[first:].to(gen_device), ctx, active)
        for row, token in zip(rows, walk.output_ids[:, 0].tolist()):
            self.metrics[row].prefill_tokens = 1
            if not append_emitted(row, [token], self.new_ids, self.sequences, self.finish, self.max_new_tokens[row],
                                  self.eos_ids, self.stop, self.on_tokens):
                self.active[row] = False

    def _drop(self, rows: list[int]) -> None:
        gone = set(rows)
        keep = [r for r in range(self.batch_size) if r not in gone]
        for name in ("sequences", "new_ids", "metrics", "finish", "max_new_tokens"):
            items = getattr(self, name)
            setattr(self, name, [items[r] for r in keep])
        index = torch.tensor(keep, dtype=torch.long, device=self.target.device)
        self.active = self.active.index_select(0, index)
        self.row_ids = self.row_ids.index_select(0, index)
        if self.row_seeds is not None:
            self.row_seeds = self.row_seeds.index_select(0, index)

    def _row_keys(self, rows: slice, device: torch.device) -> dict:
        """The verify context's ``extra`` for ``rows``: their ids and, where rows were added with
        seeds of their own, their race seeds."""
        extra = {"row_ids": self.row_ids[rows].to(device)}
        if self.row_seeds is not None:
            extra["row_seeds"] = self.row_seeds[rows].to(device)
        return extra

    def remove_rows(self, rows: list[int]) -> None:
        """Drop ``rows`` (finished or cancelled) from the batch and from both KV caches; the other
        rows keep their order."""
        rows = sorted({int(r) for r in rows})
        if not rows:
            return
        _shrink(self.target, rows)
        runner = self.proposer.runner
        if runner is not None:
            _shrink(runner, rows)
        self._drop(rows)

    def compact(self, min_slots: int = 64) -> None:
        """Drop the KV-cache holes of a runner whose cache is more than half holes (``min_slots``
        slots or more); a long-lived batch whose rows come and go stays about as long as its
        longest row."""
        for runner in (self.target, self.proposer.runner):
            if runner is None or not hasattr(runner, "compact") or runner.num_slots < min_slots:
                continue
            if 2 * int((runner.slot_pos < 0).sum()) > runner.batch_size * runner.num_slots:
                runner.compact()

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> None:
        """One propose-score-verify-commit step for every active row (see the module docstring)."""
        if not bool(self.active.any()):
            return
        target, sequences, active = self.target, self.sequences, self.active
        b, device = self.batch_size, target.device
        seq_lens = torch.tensor([len(s) for s in sequences], dtype=torch.long, device=device)
        ctx = VerifyContext(generator=self.generator, positions=seq_lens.clone(), extra=self._row_keys(slice(None), device))
        # 1. propose: at most what is left of the longest active row's budget after its bonus token
        live = active.tolist()
        cap = max(self.max_new_tokens[row] - len(self.new_ids[row]) for row in range(b) if live[row]) - 1
        proposal = self.proposer.propose(sequences, active, cap, ctx)
        was_active = active.clone()
        # 2. score: one target forward over [pending, tree]
        target_logits = proposal.score(target, sequences)
        # 3. verify (a proposal's draft forwards are known here: AMUSD drafts during 2 and 3)
        walk = proposal.verify(target_logits, ctx, was_active)
        self.draft_forwards += proposal.forwards
        # 4. emit the accepted tokens and the recovered-or-bonus token, then roll the caches back
        self._emit(walk, proposal.forwards)
        proposal.commit(target, sequences, walk, seq_lens, was_active)

    def _emit(self, walk: Walk, draft_forwards: int) -> None:
        """Append every active row's accepted tokens and its recovered-or-bonus token, cut at its
        budget, EOS and stop strings; count the step in the row's metrics."""
        accepted = walk.num_accepted.tolist()
        emitted = (walk.num_accepted + 1 if walk.num_emitted is None else walk.num_emitted).tolist()
        output_rows = walk.output_ids.tolist()
        depth = walk.drafted_depth.tolist()
        nodes = walk.drafted_nodes.tolist()
        lossy = walk.num_lossy.tolist()
        active, active_list = self.active, self.active.tolist()
        for row in range(self.batch_size):
            if not active_list[row]:
                continue
            n = accepted[row]
            m = self.metrics[row]
            m.target_forwards += 1
            m.draft_forwards += draft_forwards
            m.record_step(depth[row], n, lossy[row], emitted[row])
            m.drafted_tokens += nodes[row] - depth[row]
            if not append_emitted(row, output_rows[row][: emitted[row]], self.new_ids, self.sequences,
                                  self.finish, self.max_new_tokens[row], self.eos_ids, self.stop, self.on_tokens):
                active[row] = False
