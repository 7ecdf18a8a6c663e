"""quickdraft.backends.vllm_plugin: quickdraft's rules as vLLM's speculative-decoding accept step.

The layout tests need no vLLM. The others skip unless vLLM imports (its own environment,
``bash scripts/test_vllm.sh``): goodness of fit of the lossless rules through vLLM's
``RejectionSampler`` on synthetic logits with a control that must fail, FSD's acceptance moving
with its threshold, greedy rows equal to vLLM's, and end to end a tiny saved model pair whose
speculative greedy output equals plain greedy decoding.
"""

from __future__ import annotations

import importlib.util
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from quickdraft.errors import QuickdraftError
from quickdraft.backends import vllm_plugin
from quickdraft.backends.vllm_plugin import (BatchPlan, plan_for_runner, plan_scope, race_drafts, race_row_key,
                                             request_row_id, rule_from_args, verify_requests)
from quickdraft.verification.race import race_keys, race_sample, seed_words
from quickdraft.verification.rules import ExponentialRace, Fuzzy, Lossless, Typical
from quickdraft.verification.verify import verify_chain

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (bash scripts/test_vllm.sh)")


# ---------------------------------------------------------------------------------------------
# choosing a rule
# ---------------------------------------------------------------------------------------------


def test_rule_from_args_builds_the_named_rule_from_prefixed_fields():
    assert rule_from_args(None) is None
    assert rule_from_args({"other": 1}) is None
    assert rule_from_args({"quickdraft_rule": "vllm", "quickdraft_threshold": 1}) is None
    assert rule_from_args({"quickdraft_rule": "lossless"}) == Lossless()
    assert rule_from_args({"quickdraft_rule": "fsd", "quickdraft_threshold": 0.3,
                           "quickdraft_divergence": "tv"}) == Fuzzy(divergence="tv", threshold=0.3)
    assert rule_from_args({"quickdraft_rule": "fsd", "quickdraft_threshold": "inf"}).threshold == math.inf
    assert rule_from_args({"quickdraft_rule": "typical", "quickdraft_epsilon": 0.2}) == Typical(epsilon=0.2)
    assert rule_from_args({"quickdraft_rule": "ersd", "quickdraft_seed": 3}) == ExponentialRace(seed=3)
    # one object per distinct arguments
    assert rule_from_args({"quickdraft_rule": "lossless"}) is rule_from_args({"quickdraft_rule": "lossless"})


@pytest.mark.parametrize("args, message", [
    ({"quickdraft_rule": "nope"}, "unknown quickdraft rule"),
    ({"quickdraft_rule": "lantern"}, "unknown quickdraft rule"),
    ({"quickdraft_rule": "fsd", "quickdraft_treshold": 0.3}, "no field treshold"),
    ({"quickdraft_rule": "fsd", "quickdraft_threshold": -1}, "threshold"),
])
def test_rule_from_args_rejects_bad_arguments(args, message):
    with pytest.raises(QuickdraftError, match=message):
        rule_from_args(args)


# ---------------------------------------------------------------------------------------------
# the accept step on vLLM's ragged layout
# ---------------------------------------------------------------------------------------------


def _ragged_batch(num_drafts, vocab, seed, sharp=3.0):
    """vLLM's layout for drafts of lengths ``num_drafts``: flat draft ids, cumulative counts,
    draft probs and target logits ``[num_tokens, V]``, bonus tokens ``[B, 1]``."""
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(num_drafts)
    draft_probs = torch.softmax(sharp * torch.randn(num_tokens, vocab, generator=gen), dim=-1)
    draft_ids = torch.multinomial(draft_probs, 1, generator=gen).squeeze(-1).to(torch.int32)
    target_logits = sharp * torch.randn(num_tokens, vocab, generator=gen)
    bonus = torch.randint(vocab, (len(num_drafts), 1), generator=gen)
    cu = torch.tensor(np.cumsum(num_drafts), dtype=torch.int32)
    return draft_ids, cu, draft_probs, target_logits, bonus


def _padded_reference(num_drafts, rows, draft_ids, draft_probs, target_logits, bonus, greedy, vocab):
    """The same requests built one by one as verify_chain's padded ``[n, K]`` batch."""
    k = max(num_drafts[r] for r in rows)
    starts = np.concatenate([[0], np.cumsum(num_drafts)])
    ids = torch.zeros(len(rows), k, dtype=torch.long)
    q = torch.zeros(len(rows), k, vocab)
    p = torch.zeros(len(rows), k + 1, vocab)
    for i, r in enumerate(rows):
        n = num_drafts[r]
        for j in range(k + 1):
            if j < n:
                t = starts[r] + j
                logits = target_logits[t]
                p[i, j] = torch.nn.functional.one_hot(logits.argmax(), vocab).float() if greedy[r] else logits.softmax(-1)
                ids[i, j] = int(draft_ids[t])
                q[i, j] = draft_probs[t]
            else:
                p[i, j] = torch.nn.functional.one_hot(bonus[r, 0], vocab).float()
                if j < k:
                    q[i, j] = torch.nn.functional.one_hot(torch.tensor(0), vocab).float()
    return ids, q, p, torch.tensor([num_drafts[r] for r in rows])


@pytest.mark.parametrize("rule", [Lossless(), Typical(), Fuzzy(threshold=0.5, use_raw=False),
                                  ExponentialRace(seed=5)], ids=lambda r: r.name)
def test_verify_requests_equals_verify_chain_on_the_padded_batch(rule):
    num_drafts = [2, 0, 3, 1, 3]
    vocab = 11
    draft_ids, cu, draft_probs, target_logits, bonus = _ragged_batch(num_drafts, vocab, seed=0)
    is_greedy = torch.tensor([False, False, True, False, False])
    positions = torch.tensor([7, 3, 12, 5, 9])
    row_ids = torch.tensor([101, 102, 103, 104, 105])
    rows = [0, 1, 2, 4]
    got = verify_requests(rule, torch.tensor(rows), draft_ids, cu, draft_probs, target_logits, bonus, is_greedy,
                          positions, row_ids, torch.Generator().manual_seed(9))

    ids, q, p, lengths = _padded_reference(num_drafts, rows, draft_ids, draft_probs, target_logits, bonus,
                                           is_greedy.tolist(), vocab)
    from quickdraft.verification.rules import VerifyContext
    ctx = VerifyContext(positions=positions[rows], raw_draft_probs=q, raw_target_probs=p,
                        extra={"row_ids": row_ids[rows]})
    want = verify_chain(ids, q, p, rule, torch.Generator().manual_seed(9), ctx=ctx, draft_lengths=lengths)
    assert torch.equal(got.output_ids, want.output_ids)
    assert torch.equal(got.num_accepted, want.num_accepted)
    # the request without drafts emits vLLM's bonus token alone
    assert got.output_ids[1].tolist() == [int(bonus[1, 0])] + [-1] * 3


def test_verify_requests_greedy_rows_are_exact_match_and_bonus_is_vllms():
    vocab = 9
    num_drafts = [3, 3]
    target_logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    argmax = target_logits.argmax(-1)
    draft_ids = argmax.clone().to(torch.int32)
    draft_ids[4] = (argmax[4] + 1) % vocab  # request 1 is rejected at its second draft
    bonus = torch.tensor([[4], [5]])
    got = verify_requests(Lossless(), torch.tensor([0, 1]), draft_ids, torch.tensor([3, 6]), None, target_logits,
                          bonus, torch.tensor([True, True]), torch.zeros(2), torch.zeros(2), None)
    assert got.output_ids.tolist() == [argmax[:3].tolist() + [4], [int(argmax[3]), int(argmax[4]), -1, -1]]


def test_verify_requests_negative_draft_id_ends_the_draft():
    vocab = 5
    target_logits = torch.full((3, vocab), -10.0)
    target_logits[0, 2] = target_logits[1, 3] = target_logits[2, 4] = 10.0
    draft_ids = torch.tensor([2, -1, 4], dtype=torch.int32)  # vLLM pads with -1
    got = verify_requests(Lossless(), torch.tensor([0]), draft_ids, torch.tensor([3]), None, target_logits,
                          torch.tensor([[1]]), torch.tensor([True]), torch.zeros(1), torch.zeros(1), None)
    # draft 2 accepted; the target's token at the padded position (3), not vLLM's bonus (1)
    assert got.output_ids.tolist() == [[2, 3, -1, -1]]
    assert got.num_accepted.tolist() == [1]


# ---------------------------------------------------------------------------------------------
# ERSD's race on the draft's side and for the bonus token
# ---------------------------------------------------------------------------------------------


def test_race_row_key_is_the_request_seed_alone_when_it_has_one():
    ersd = ExponentialRace(seed=3)
    assert race_row_key(ersd, "cmpl-a", 11) == race_row_key(ersd, "cmpl-b", 11) == (11, 0)
    assert race_row_key(ersd, "cmpl-a", None) == (3, request_row_id("cmpl-a"))
    assert race_row_key(ersd, "cmpl-a", None) != race_row_key(ersd, "cmpl-b", None)
    assert race_row_key(None, "cmpl-a", None) == (0, request_row_id("cmpl-a"))


def _fake_runner(requests, async_scheduling=False):
    """A stand-in for vLLM's ``GPUModelRunner`` with what :func:`plan_for_runner` reads; ``requests``
    maps request ids to (``extra_args``, ``seed``)."""
    ids = list(requests)
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=ids, num_tokens_no_spec=np.arange(10, 10 + len(ids))),
        requests={rid: SimpleNamespace(sampling_params=SimpleNamespace(extra_args=args, seed=seed))
                  for rid, (args, seed) in requests.items()},
        vllm_config=SimpleNamespace(additional_config=None, model_config=SimpleNamespace(seed=0)),
        use_async_scheduling=async_scheduling)


def test_plan_for_runner_keys_seeded_requests_by_their_seed_and_keeps_ersd_off_async_scheduling():
    ersd = {"quickdraft_rule": "ersd", "quickdraft_seed": 3}
    requests = {"a": (ersd, 11), "b": (ersd, None), "c": ({"quickdraft_rule": "lossless"}, 5), "d": (None, None),
                "e": (None, 8)}
    plan = plan_for_runner(_fake_runner(requests))
    assert plan.rules == [ExponentialRace(seed=3), ExponentialRace(seed=3), Lossless(), None, None]
    assert plan.positions.tolist() == [10, 11, 12, 13, 14]
    assert plan.row_seeds.tolist() == seed_words([11, 3, 5, 0, 8]).tolist()
    assert plan.row_ids.tolist() == [0, request_row_id("b"), 0, request_row_id("d"), 0]
    assert plan.seeded == [True, False, True, False, True] and plan.races
    # keyed drafts: ERSD's always; a seeded request's under any rule (vLLM's own too, "e") where the
    # proposer's drafts are draws; unseeded requests under other rules ("d") keep vLLM's draws
    assert plan.keyed_drafts(probabilistic=True) == [True, True, True, False, True]
    assert plan.keyed_drafts(probabilistic=False) == [True, True, False, False, False]
    # vLLM's asynchronous scheduling updates the token counts a step late: ERSD's requests get vLLM's
    # rule there, the others keep theirs; requests under vLLM's rule keep vLLM's draft draws there
    # (seeded "a" now under vLLM's rule, and "e"), a seeded one under a quickdraft rule is keyed ("c")
    plan = plan_for_runner(_fake_runner(requests, async_scheduling=True))
    assert plan.rules == [None, None, Lossless(), None, None] and not plan.races
    assert plan.keyed_drafts(probabilistic=True) == [False, False, True, False, False]


def test_drafting_reuses_the_plan_of_its_steps_verification(monkeypatch):
    drafting = []
    monkeypatch.setitem(vllm_plugin._vllm, "propose_draft_token_ids",
                        lambda self, *a, **k: drafting.append(vllm_plugin._draft_plan))
    ersd = {"quickdraft_rule": "ersd"}
    runner = _fake_runner({"a": (ersd, 1), "b": (ersd, None)})
    verified = plan_for_runner(runner)
    runner._quickdraft_verified_plan = (["a", "b"], verified)
    vllm_plugin.propose_draft_token_ids(runner)
    assert drafting[-1] is verified and runner._quickdraft_verified_plan is None
    # another batch of requests (or none verified this step): a plan of its own
    runner._quickdraft_verified_plan = (["a"], verified)
    vllm_plugin.propose_draft_token_ids(runner)
    assert drafting[-1] is not verified and drafting[-1].rules == verified.rules
    assert drafting[-1].row_ids.tolist() == verified.row_ids.tolist()
    assert vllm_plugin._draft_plan is None


@pytest.mark.parametrize("probabilistic", [True, False])
def test_drafting_keys_seeded_requests_only_where_the_proposers_drafts_are_draws(monkeypatch, probabilistic):
    drafting = []
    monkeypatch.setitem(vllm_plugin._vllm, "propose_draft_token_ids",
                        lambda self, *a, **k: drafting.append(vllm_plugin._draft_plan))
    runner = _fake_runner({"a": ({"quickdraft_rule": "lossless"}, 1), "b": (None, 2)})
    runner.drafter = SimpleNamespace(_enable_probabilistic_draft_probs=probabilistic)
    vllm_plugin.propose_draft_token_ids(runner)
    # argmax drafts repeat by themselves: no plan, vLLM's drafting path untouched
    assert (drafting[-1] is not None) == probabilistic
    if probabilistic:
        assert drafting[-1].keyed_drafts(True) == [True, True]


@pytest.mark.parametrize("layout, keyed", [
    (dict(needs_extra_input_slots=True, pass_hidden_states_to_model=False), True),  # the draft-model proposer
    (dict(needs_extra_input_slots=False, pass_hidden_states_to_model=True), False),  # EAGLE: hidden states shifted
    (dict(needs_extra_input_slots=True, pass_hidden_states_to_model=False, parallel_drafting=True), False),
    (dict(needs_extra_input_slots=True, pass_hidden_states_to_model=False, uses_mrope=True), False),
])
def test_race_positions_come_from_the_draft_model_proposers_layout_only(monkeypatch, layout, keyed):
    positions = torch.tensor([0, 1, 2, 3, 4, 7, 8, 20, 21, 22])  # the proposer's input positions
    sample_at = torch.tensor([4, 6, 9])  # each request's last input slot (positions 4, 8, 22)
    monkeypatch.setitem(vllm_plugin._vllm, "set_inputs_first_pass", lambda self, *a, **k: (10, sample_at, None))
    plan = BatchPlan(rules=[ExponentialRace()] * 3, positions=torch.zeros(3), row_ids=torch.arange(3))
    monkeypatch.setattr(vllm_plugin, "_draft_plan", plan)
    proposer = SimpleNamespace(positions=positions, **layout)
    assert vllm_plugin.set_inputs_first_pass(proposer)[1] is sample_at
    if keyed:
        assert vllm_plugin._race_positions(proposer, 3).tolist() == [5, 9, 23]
        proposer._quickdraft_draft_index = 2  # the third draft token
        assert vllm_plugin._race_positions(proposer, 3).tolist() == [7, 11, 25]
        assert vllm_plugin._race_positions(proposer, 2) is None  # rows that are not the batch's requests
    else:
        assert vllm_plugin._race_positions(proposer, 3) is None


def _race_batch(n, k, vocab, seed, temperature=1.0):
    """``n`` ERSD requests of which the first half draft from the target's own logits, the rest
    from a perturbed copy; the drafts by :func:`race_drafts` at positions ``pos + j``."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = 2.0 * torch.randn(n, k, vocab, generator=gen)
    draft_logits = target_logits.clone()
    draft_logits[n // 2:] += 1.5 * torch.randn(n - n // 2, k, vocab, generator=gen)
    rules = [ExponentialRace(seed=4)] * n
    plan = BatchPlan(rules=rules, positions=torch.arange(n) + 20, row_ids=torch.arange(n) + 7,
                     row_seeds=seed_words(range(100, 100 + n)))
    temperatures = torch.full((n,), temperature)
    draft_ids = torch.stack([
        race_drafts(draft_logits[:, j].argmax(-1), draft_logits[:, j], temperatures, plan, plan.positions + j)
        for j in range(k)], dim=1)
    draft_probs = torch.softmax(draft_logits / temperature, dim=-1)
    return plan, draft_ids, draft_probs, target_logits / temperature


def test_race_drafts_are_the_drafts_race_winners_under_the_targets_keys():
    n, k, vocab = 40, 3, 50
    plan, draft_ids, draft_probs, target_logits = _race_batch(n, k, vocab, seed=0)
    keys = race_keys(plan.row_seeds[:, None], plan.row_ids[:, None], plan.positions[:, None] + torch.arange(k))
    assert torch.equal(draft_ids, race_sample(draft_probs, keys))
    # a draft with the target's distribution proposes exactly the target's winners: every draft accepted
    cu = torch.arange(1, n + 1, dtype=torch.int32) * k
    bonus = torch.zeros(n, 1, dtype=torch.long)
    got = verify_requests(ExponentialRace(seed=4), torch.arange(n), draft_ids.reshape(-1).to(torch.int32), cu,
                          draft_probs.reshape(n * k, vocab), target_logits.reshape(n * k, vocab), bonus,
                          torch.zeros(n, dtype=torch.bool), plan.positions, plan.row_ids, None,
                          row_seeds=plan.row_seeds)
    same = got.num_accepted[: n // 2]
    assert same.tolist() == [k] * (n // 2)
    # the perturbed drafts are rejected somewhere, and keyed by another seed even the exact ones are
    assert got.num_accepted[n // 2:].float().mean() < k
    other = verify_requests(ExponentialRace(seed=4), torch.arange(n), draft_ids.reshape(-1).to(torch.int32), cu,
                            draft_probs.reshape(n * k, vocab), target_logits.reshape(n * k, vocab), bonus,
                            torch.zeros(n, dtype=torch.bool), plan.positions, plan.row_ids, None,
                            row_seeds=seed_words(range(500, 500 + n)))
    assert other.num_accepted[: n // 2].float().mean() < 1.0


def test_race_drafts_leave_greedy_and_unseeded_other_rules_requests_alone():
    n, vocab = 6, 30
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2))
    given = torch.arange(n)
    rules = [ExponentialRace(), Lossless(), ExponentialRace(), None, ExponentialRace(), ExponentialRace()]
    plan = BatchPlan(rules=rules, positions=torch.full((n,), 5), row_ids=torch.arange(n))
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.7, 1e-6])
    got = race_drafts(given, logits, temperature, plan, plan.positions)
    assert got[[1, 2, 3, 5]].tolist() == [1, 2, 3, 5]
    keys = race_keys(seed_words([0, 0]), plan.row_ids[[0, 4]], plan.positions[[0, 4]])
    want = race_sample(torch.softmax(logits[[0, 4]] / temperature[[0, 4], None], dim=-1), keys)
    assert got[[0, 4]].tolist() == want.tolist()
    assert race_drafts(given, logits, None, plan, plan.positions) is given  # a batch of greedy requests
    # where the proposer hands on its distributions, a seeded request under another rule (a quickdraft
    # rule, 1, or vLLM's own, 3) draws its draft by its key too (an exact draw from q); without
    # them, or unseeded, it keeps vLLM's
    plan.seeded = [False, True, False, True, False, False]
    assert race_drafts(given, logits, temperature, plan, plan.positions)[[1, 3]].tolist() == [1, 3]
    keyed = race_drafts(given, logits, temperature, plan, plan.positions, probabilistic=True)
    want = race_sample(torch.softmax(logits[[1, 3]], dim=-1), race_keys(seed_words([0, 0]), plan.row_ids[[1, 3]],
                                                                       plan.positions[[1, 3]]))
    assert keyed[[1, 3]].tolist() == want.tolist() and want.tolist() != [1, 3]
    greedy = temperature.clone()
    greedy[3] = 0.0  # a seeded greedy request keeps its argmax draft
    assert race_drafts(given, logits, greedy, plan, plan.positions, probabilistic=True)[3].item() == 3
    plan.seeded = [False] * n
    assert race_drafts(given, logits, temperature, plan, plan.positions, probabilistic=True)[[1, 3]].tolist() == [1, 3]


def test_verify_requests_races_ersds_bonus_from_the_bonus_distribution():
    vocab, k = 13, 2
    gen = torch.Generator().manual_seed(5)
    target_logits = torch.full((2 * k, vocab), -30.0)
    target_logits[:, 3] = 30.0  # both requests accept their drafts [3, 3]
    draft_ids = torch.full((2 * k,), 3, dtype=torch.int32)
    cu = torch.tensor([k, 2 * k], dtype=torch.int32)
    bonus_probs = torch.softmax(torch.randn(2, vocab, generator=gen), dim=-1)
    vllm_bonus = torch.tensor([[9], [9]])
    positions, row_ids = torch.tensor([4, 8]), torch.tensor([1, 2])
    args = (torch.arange(2), draft_ids, cu, None, target_logits, vllm_bonus)
    for greedy in (False, True):
        is_greedy = torch.tensor([greedy, False])
        got = verify_requests(ExponentialRace(seed=2), *args, is_greedy, positions, row_ids, None,
                              bonus_probs=bonus_probs)
        keys = race_keys(2, row_ids, positions + k)
        raced = race_sample(bonus_probs, keys)
        want_first = 9 if greedy else int(raced[0])  # a greedy request keeps vLLM's bonus
        assert got.output_ids[:, -1].tolist() == [want_first, int(raced[1])]
    # every other rule emits vLLM's bonus token
    got = verify_requests(Lossless(), *args, torch.tensor([False, False]), positions, row_ids, None,
                          bonus_probs=bonus_probs)
    assert got.output_ids[:, -1].tolist() == [9, 9]


# ---------------------------------------------------------------------------------------------
# inside vLLM's sampler
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_sampler():
    """vLLM's RejectionSampler with the plugin's hook installed (CPU kernels registered)."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (bash scripts/test_vllm.sh)")
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    current_platform.register_triton_kernel_overrides()
    vllm_plugin.register()
    return RejectionSampler(Sampler())


def _run_vllm_sampler(sampler, draft_ids, target_logits, draft_probs, temperature, rules, seed, plan=None,
                      bonus_probs=None):
    """One call of ``RejectionSampler.forward`` on requests with drafts ``draft_ids [B, K]``,
    target logits ``[B, K+1, V]`` (the last row is the bonus position), and ``rules`` (one per
    request, ``None``: vLLM's); returns its ``[B, K+1]`` output tokens. ``plan`` replaces the
    default plan (positions 10, row ids ``0..B-1``); ``bonus_probs="sampler"`` sets its bonus
    distributions as the runner's wrapper does (:func:`vllm_plugin.bonus_distributions`), a tensor
    sets them to that tensor."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    b, k = draft_ids.shape
    vocab = target_logits.shape[-1]
    index = torch.arange(b * (k + 1)).view(b, k + 1)  # [B, K+1] rows of vLLM's logits
    metadata = SpecDecodeMetadata(
        draft_token_ids=draft_ids.reshape(-1).to(torch.int32),
        num_draft_tokens=[k] * b,
        cu_num_draft_tokens=torch.arange(1, b + 1, dtype=torch.int32) * k,
        cu_num_sampled_tokens=torch.arange(1, b + 1, dtype=torch.int32) * (k + 1),
        target_logits_indices=index[:, :k].reshape(-1).to(torch.int32),
        bonus_logits_indices=index[:, k].to(torch.int32),
        logits_indices=index.reshape(-1).to(torch.int32),
    )
    greedy = temperature == 0
    sampling = SamplingMetadata(
        temperature=torch.full((b,), float(temperature)), all_greedy=greedy, all_random=not greedy,
        top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(b), presence_penalties=torch.zeros(b),
        repetition_penalties=torch.ones(b), output_token_ids=[[] for _ in range(b)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )
    torch.manual_seed(seed)  # vLLM's own draws (bonus tokens, its rule) use the global generator
    vllm_plugin.seed_generator(seed)
    if plan is None:
        plan = BatchPlan(rules=list(rules), positions=torch.full((b,), 10), row_ids=torch.arange(b))
    logits = target_logits.reshape(b * (k + 1), vocab).clone()
    if isinstance(bonus_probs, str):
        plan.bonus_probs = vllm_plugin.bonus_distributions(sampler.sampler, logits, metadata.bonus_logits_indices,
                                                           sampling)
    elif bonus_probs is not None:
        plan.bonus_probs = bonus_probs
    flat_draft_probs = None if draft_probs is None else draft_probs.reshape(b * k, vocab).contiguous()
    with plan_scope(plan):
        out = sampler(metadata, flat_draft_probs, logits, sampling)
    return out.sampled_token_ids


TARGET = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])
DRAFT = torch.tensor([0.05, 0.10, 0.40, 0.25, 0.15, 0.05])


def _synthetic_drafts(n, k, seed):
    """``n`` requests drafting ``k`` tokens from DRAFT, verified against TARGET at every position."""
    gen = torch.Generator().manual_seed(seed)
    draft_ids = torch.multinomial(DRAFT, n * k, replacement=True, generator=gen).view(n, k)
    draft_probs = DRAFT.expand(n, k, -1).contiguous()
    target_logits = TARGET.log().expand(n, k + 1, -1).contiguous()
    return draft_ids, draft_probs, target_logits


def _fit(tokens):
    """Chi-square p-value of ``tokens [N]`` against TARGET."""
    return _fit_to(tokens, TARGET)


def _fit_to(tokens, dist):
    """Chi-square p-value of ``tokens [N]`` against the distribution ``dist [V]``."""
    counts = np.bincount(tokens.numpy(), minlength=len(dist))
    expected = dist.double().numpy()
    return stats.chisquare(counts, expected / expected.sum() * counts.sum()).pvalue


@needs_vllm
@pytest.mark.parametrize("rule", [Lossless(), ExponentialRace(seed=1), Fuzzy(threshold=0.0, hybrid=True), None],
                         ids=["lossless", "ersd", "fsd-hybrid-T0", "vllm"])
def test_lossless_rules_fit_the_target_inside_vllms_sampler(vllm_sampler, rule):
    n, k = 20_000, 2
    draft_ids, draft_probs, target_logits = _synthetic_drafts(n, k, seed=0)
    out = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, draft_probs, 1.0, [rule] * n, seed=0)
    _assert_first_two_fit(out)


def _assert_first_two_fit(out):
    """The first emitted token of every request, and the second where the first draft was accepted,
    fit TARGET (the target is the same at every position, so both are distributed as TARGET)."""
    assert _fit(out[:, 0]) > 1e-3
    second = out[:, 1][out[:, 1] >= 0]
    assert len(second) > 1_000 and _fit(second) > 1e-3


@needs_vllm
@pytest.mark.parametrize("rule", [Lossless(), None], ids=["lossless", "vllm"])
def test_lossless_rule_with_keyed_drafts_fits_the_target_inside_vllms_sampler(vllm_sampler, rule):
    # seeded requests draft by their race keys (an exact draw from DRAFT): speculative sampling on
    # those drafts, ours or vLLM's, is still lossless
    n, k = 20_000, 2
    plan = BatchPlan(rules=[rule] * n, positions=torch.full((n,), 10), row_ids=torch.zeros(n, dtype=torch.long),
                     row_seeds=seed_words(range(n)), seeded=[True] * n)
    draft_logits = DRAFT.log().expand(n, -1)
    ones = torch.ones(n)
    draft_ids = torch.stack([race_drafts(draft_logits.argmax(-1), draft_logits, ones, plan, plan.positions + j,
                                         probabilistic=True) for j in range(k)], dim=1)
    assert _fit_to(draft_ids[:, 0], DRAFT) > 1e-3  # the keyed drafts are draws from DRAFT
    draft_probs = DRAFT.expand(n, k, -1).contiguous()
    target_logits = TARGET.log().expand(n, k + 1, -1).contiguous()
    out = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, draft_probs, 1.0, plan.rules, seed=0, plan=plan)
    _assert_first_two_fit(out)


@needs_vllm
def test_bonus_distributions_are_what_vllms_sampler_draws_the_bonus_from(vllm_sampler):
    from dataclasses import replace

    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    b, vocab = 6, 40
    gen = torch.Generator().manual_seed(7)
    logits = 3.0 * torch.randn(b, vocab, generator=gen)
    sampling = SamplingMetadata(
        temperature=torch.tensor([0.7, 1.0, 1.3, 0.5, 0.9, 1.1]), all_greedy=False, all_random=True,
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0, 0.95, 1.0]), top_k=torch.tensor([vocab, 10, vocab, 5, vocab, 20]),
        generators={}, max_num_logprobs=-1, no_penalties=False,
        prompt_token_ids=torch.randint(vocab, (b, 4), generator=gen), frequency_penalties=torch.full((b,), 0.3),
        presence_penalties=torch.full((b,), 0.2), repetition_penalties=torch.full((b,), 1.2),
        output_token_ids=[[1, 2, 3], [4], [5, 5], [], [6, 7], [8]], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(), spec_token_ids=[[9], [], [10, 11], [], [], [12]])
    # the logits vLLM's sampler draws the bonus token from (its "processed_logits" logprobs mode)
    processed = Sampler(logprobs_mode="processed_logits")(logits.clone(), sampling, predict_bonus_token=True)
    want = torch.softmax(processed.logprobs_tensors.logprobs, dim=-1)
    got = vllm_plugin.bonus_distributions(Sampler(), logits, torch.arange(b), replace(sampling, max_num_logprobs=None))
    assert torch.allclose(got, want, atol=1e-6)
    assert (got == 0).any()  # top-k / top-p cut some tokens
    # control: without the penalties (the spec tokens included) the distributions differ
    unpenalised = vllm_plugin.bonus_distributions(Sampler(), logits, torch.arange(b),
                                                  replace(sampling, max_num_logprobs=None, no_penalties=True))
    assert not torch.allclose(unpenalised, want, atol=1e-3)


@needs_vllm
def test_negative_control_accept_every_draft_fails_the_fit(vllm_sampler):
    n, k = 20_000, 2
    draft_ids, draft_probs, target_logits = _synthetic_drafts(n, k, seed=0)
    out = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, draft_probs, 1.0,
                            [Fuzzy(threshold=math.inf)] * n, seed=0)
    assert torch.equal(out[:, :k], draft_ids.to(out.dtype))
    assert _fit(out[:, 0]) < 1e-6


def _ersd_race_requests(n, k, temperature, seed):
    """``n`` ERSD requests drafting ``k`` tokens from DRAFT by the race (:func:`race_drafts`), the
    target TARGET at every position, at ``temperature``: (plan, drafts, draft probs, target logits)."""
    plan = BatchPlan(rules=[ExponentialRace(seed=seed)] * n, positions=torch.full((n,), 10), row_ids=torch.arange(n))
    draft_logits = DRAFT.log().expand(n, -1)
    temperatures = torch.full((n,), float(temperature))
    draft_ids = torch.stack([race_drafts(draft_logits.argmax(-1), draft_logits, temperatures, plan, plan.positions + j)
                             for j in range(k)], dim=1)
    draft_probs = torch.softmax(DRAFT.log() / temperature, dim=-1).expand(n, k, -1).contiguous()
    return plan, draft_ids, draft_probs, TARGET.log().expand(n, k + 1, -1).contiguous()


@needs_vllm
def test_ersd_race_drafts_and_raced_bonus_fit_the_tempered_target_inside_vllms_sampler(vllm_sampler):
    n, k, temperature = 20_000, 2, 0.7
    tempered = torch.softmax(TARGET.log() / temperature, dim=-1)
    plan, draft_ids, draft_probs, target_logits = _ersd_race_requests(n, k, temperature, seed=1)
    out = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, draft_probs, temperature, plan.rules, seed=0,
                            plan=plan, bonus_probs="sampler")

    # every emitted position, bonus included (the third, after two accepted drafts), fits the tempered target
    for j in range(k + 1):
        emitted = out[:, j][out[:, j] >= 0]
        assert len(emitted) > 2_000 and _fit_to(emitted, tempered) > 1e-3, j
    # the race couples the drafts to the target: more accepted than drafts drawn independently would be
    # (sum_v p_v q_v per position)
    independent = float((tempered * draft_probs[0, 0]).sum())
    assert (out[:, 0] == draft_ids[:, 0].to(out.dtype)).float().mean() > independent + 0.05
    # control: a bonus raced from the untempered distribution fails the fit
    plan, draft_ids, draft_probs, target_logits = _ersd_race_requests(n, k, temperature, seed=1)
    out = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, draft_probs, temperature, plan.rules, seed=0,
                            plan=plan, bonus_probs=TARGET.expand(n, -1))
    bonus = out[:, k][out[:, k] >= 0]
    assert _fit_to(bonus, tempered) < 1e-6


@needs_vllm
def test_fsd_acceptance_moves_with_the_threshold(vllm_sampler):
    n, k, vocab = 400, 3, 32
    gen = torch.Generator().manual_seed(3)
    target_logits = 2.0 * torch.randn(n, k + 1, vocab, generator=gen)
    # drafts near the target for some requests, far for others: divergences spread out
    noise = torch.linspace(0.1, 3.0, n)[:, None, None] * torch.randn(n, k, vocab, generator=gen)
    draft_probs = torch.softmax(target_logits[:, :k] + noise, dim=-1)
    draft_ids = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(n, k)
    accepted = []
    for threshold in (0.0, 0.02, 0.1, 0.5, math.inf):
        out = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, draft_probs, 1.0,
                                [Fuzzy(threshold=threshold)] * n, seed=0)
        emitted = (out >= 0).sum(dim=-1) - 1
        accepted.append(int(emitted.sum()))
    assert accepted[0] == 0 and accepted[-1] == n * k
    assert all(a < b for a, b in zip(accepted, accepted[1:])), accepted


@needs_vllm
def test_greedy_requests_match_vllms_own_rule(vllm_sampler):
    n, k, vocab = 64, 3, 16
    gen = torch.Generator().manual_seed(4)
    target_logits = torch.randn(n, k + 1, vocab, generator=gen)
    draft_ids = target_logits[:, :k].argmax(-1)
    wrong = torch.rand(n, k, generator=gen) < 0.3
    draft_ids = torch.where(wrong, (draft_ids + 1) % vocab, draft_ids)
    ours = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, None, 0.0, [Lossless()] * n, seed=0)
    theirs = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, None, 0.0, [None] * n, seed=0)
    assert torch.equal(ours, theirs)
    # mixed: every other request keeps vLLM's rule
    mixed = _run_vllm_sampler(vllm_sampler, draft_ids, target_logits, None, 0.0,
                              [Lossless() if i % 2 else None for i in range(n)], seed=0)
    assert torch.equal(mixed, theirs)


# ---------------------------------------------------------------------------------------------
# end to end: vLLM's engine with the plugin loaded through its entry point
# ---------------------------------------------------------------------------------------------

VOCAB = 512


def _save_tiny_pair(root) -> tuple[str, str]:
    """A tiny fp32 Qwen2 target and a perturbed copy as draft, each saved with a word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=f"w{VOCAB - 1}", unk_token="w0")
    paths = []
    for name, scale in (("target", 0.0), ("draft", 0.05)):
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                             tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=0)
        model = Qwen2ForCausalLM(config).eval()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # sharper outputs: greedy texts that are not pure noise
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * scale * param.std().clamp_min(1e-3))
        path = os.path.join(root, name)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths.append(path)
    return paths[0], paths[1]


#: prompts (token ids) and engine settings of the end-to-end tests on the tiny pair
TINY_PROMPTS = [{"prompt_token_ids": [5, 17, 42, 7]}, {"prompt_token_ids": [100, 3, 9]}, {"prompt_token_ids": [11, 250]}]
TINY_ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4, seed=0)


@pytest.fixture
def tiny_pair(tmp_path, monkeypatch):
    """(target, draft) paths of the tiny pair, for an engine core in this process (no spawn:
    smaller, faster, and its counters readable here)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    return _save_tiny_pair(str(tmp_path))


@needs_vllm
def test_end_to_end_lossless_rule_leaves_greedy_output_unchanged(tiny_pair):
    from vllm import LLM, SamplingParams

    target, draft = tiny_pair
    prompts = TINY_PROMPTS
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = TINY_ENGINE

    llm = LLM(target, **common)
    plain = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    del llm

    vllm_plugin.ACCEPTANCE_COUNTS.clear()
    llm = LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2},
              additional_config={"quickdraft_rule": "lossless"}, **common)
    speculative = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]
    assert speculative == plain
    counts = vllm_plugin.ACCEPTANCE_COUNTS["lossless"]
    assert counts.steps > 0 and 0 < counts.accepted <= counts.drafted

    # per request: extra_args override the engine's rule
    per_request = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                 extra_args={"quickdraft_rule": "greedy"})
    overridden = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, per_request)]
    assert overridden == plain
    assert vllm_plugin.ACCEPTANCE_COUNTS["greedy"].steps > 0


@needs_vllm
def test_end_to_end_ersd_drafts_by_the_race_and_keys_seeded_requests_by_their_seed(tiny_pair):
    from vllm import LLM, SamplingParams

    target, draft = tiny_pair
    prompts = TINY_PROMPTS
    common = TINY_ENGINE

    def run(llm, seeds, batch):
        params = [SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=seed,
                                 extra_args={"quickdraft_rule": "ersd"}) for seed in seeds]
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params)]

    # a draft identical to the target races to the target's tokens: every draft accepted
    # (drafts sampled independently of the race accepted 7 of 258 here)
    llm = LLM(target, speculative_config={"method": "draft_model", "model": target, "num_speculative_tokens": 3},
              **common)
    vllm_plugin.ACCEPTANCE_COUNTS.clear()
    exact = run(llm, [7, 8, 9], prompts)
    counts = vllm_plugin.ACCEPTANCE_COUNTS["ersd"]
    assert counts.drafted > 0 and counts.accepted == counts.drafted
    del llm

    llm = LLM(target, speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
                                          "draft_sample_method": "probabilistic"}, **common)
    vllm_plugin.ACCEPTANCE_COUNTS.clear()
    perturbed = run(llm, [7, 8, 9], prompts)
    counts = vllm_plugin.ACCEPTANCE_COUNTS["ersd"]
    assert 0 < counts.accepted < counts.drafted
    # every token is the target's race winner keyed by the request's seed: the text does not depend
    # on the drafter, the request's id or what shares its batch
    assert perturbed == exact
    assert run(llm, [8], prompts[1:2]) == [exact[1]]
    # control: other seeds, other texts
    other = run(llm, [17, 18, 19], prompts)
    assert all(o != e for o, e in zip(other, exact))


def test_expand_batch_to_tokens_repeats_per_request():
    from quickdraft.backends.vllm_plugin import expand_batch_to_tokens

    cu = torch.tensor([2, 5, 5, 6], dtype=torch.int32)
    got = expand_batch_to_tokens(torch.tensor([0.5, 0.0, 9.0, 2.0]), cu, 6, replace_from=0, replace_to=1)
    assert got.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]
    assert expand_batch_to_tokens(torch.tensor([3, 0, 4, 7], dtype=torch.int32), cu, 6).tolist() == [3, 3, 0, 0, 0, 7]


@needs_vllm
def test_register_installs_a_working_expand_on_cpu(vllm_sampler):
    from vllm.v1.sample import rejection_sampler

    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    got = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.5, 0.0, 2.0]), cu, 6, replace_from=0, replace_to=1)
    assert got.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]


@needs_vllm
def test_register_refuses_bad_rule_arguments_at_admission(vllm_sampler):
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    SamplingParams(extra_args={"quickdraft_rule": "fsd", "quickdraft_threshold": 0.3})._validate_spec_decode(None)
    SamplingParams(extra_args={"other": 1})._validate_spec_decode(None)
    with pytest.raises(VLLMValidationError, match="unknown quickdraft rule 'nope'"):
        SamplingParams(extra_args={"quickdraft_rule": "nope"})._validate_spec_decode(None)
    with pytest.raises(VLLMValidationError, match="no field treshold"):
        SamplingParams(extra_args={"quickdraft_rule": "fsd", "quickdraft_treshold": 0.3})._validate_spec_decode(None)
