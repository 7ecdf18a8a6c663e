"""The acceptance rules of issue 4 through the real engine (tiny fp32 models from conftest).

``tests/test_rules.py`` and ``tests/test_race.py`` prove the rules on distributions; these tests
check what only the engine can get wrong: that FSD sees the raw (temperature-1, unwarped)
distributions by default and the processed ones on request, that its drafts are greedy by default
and sampled on request, the limits T = 0 / T = inf and the fuzzy-fraction metric, hybrid FSD at
T = 0 being speculative sampling draw for draw, typical acceptance at temperature 0, and chain
ERSD being the target's own race sample whatever the drafter, K and draft-length policy — and
really sampling at T > 0 (not reproducing the greedy output).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter
from quickdraft.decoding.engine import Decoder, generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.decoding.policies import Constant, Heuristic
from quickdraft.verification.rules import ExponentialRace, Fuzzy, Lossless, Typical
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs

from conftest import TINY_VOCAB, perturbed_copy, tiny_lm

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


pytestmark = pytest.mark.usefixtures("one_thread")



def _drafter(model) -> ModelDrafter:
    return ModelDrafter(ModelRunner(model, "draft"), TINY_VOCAB)


class Recording(Fuzzy):
    """FSD that records what the engine hands it at every verification."""

    def __init__(self, log: list, **kw):
        super().__init__(**kw)
        object.__setattr__(self, "_log", log)

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        self._log.append(dict(draft_ids=draft_ids.clone(), draft_probs=draft_probs.clone(), target_probs=target_probs.clone(),
                              raw_draft=None if ctx.raw_draft_probs is None else ctx.raw_draft_probs.clone(),
                              raw_target=None if ctx.raw_target_probs is None else ctx.raw_target_probs.clone()))
        return super().accept(draft_ids, draft_probs, target_probs, ctx)


# ---------------------------------------------------------------------------------------------
# FSD
# ---------------------------------------------------------------------------------------------


def test_fsd_divergence_sees_raw_distributions_by_default(tiny_target, tiny_draft):
    """At T = 0.5 with top-k 10 the processed distributions are sharpened and truncated; the raw
    ones the engine hands FSD are the same logits at temperature 1, without truncation."""
    params = SamplingParams(temperature=0.5, top_k=10)
    log: list = []
    generate(ModelRunner(tiny_target), PROMPTS, method="sd", drafter=_drafter(tiny_draft),
             rule=Recording(log, threshold=0.3), sampling=params, max_new_tokens=12)
    assert log
    for step in log:
        raw_draft, raw_target = step["raw_draft"], step["raw_target"]
        k = step["draft_ids"].shape[1]
        assert raw_draft is not None and raw_target is not None
        assert raw_draft.shape == step["draft_probs"].shape and raw_target.shape[:2] == (len(PROMPTS), k + 1)
        assert (raw_draft > 0).all() and (raw_target > 0).all()  # untruncated softmax: full support
        torch.testing.assert_close(raw_draft.sum(-1), torch.ones(raw_draft.shape[:2]))
        # the processed distributions are the raw logits (log-probs) under temperature and top-k
        torch.testing.assert_close(logits_to_probs(raw_draft.log(), params), step["draft_probs"], atol=1e-5, rtol=0)
        # (the rule sees the target's first K positions; the context holds all K + 1)
        torch.testing.assert_close(logits_to_probs(raw_target[:, :k].log(), params), step["target_probs"], atol=1e-5, rtol=0)
        assert ((step["draft_probs"] > 0).sum(-1) <= 10).all()
    # processed on request: the engine does not even compute the raw distributions
    log.clear()
    generate(ModelRunner(tiny_target), PROMPTS, method="sd", drafter=_drafter(tiny_draft),
             rule=Recording(log, threshold=0.3, use_raw=False), sampling=params, max_new_tokens=12)
    assert log and all(step["raw_draft"] is None and step["raw_target"] is None for step in log)


def test_raw_and_processed_divergences_decide_differently_at_temperature_zero(tiny_target):
    """At T = 0 the processed distributions are one-hot: their textbook JS divergence (``jsd``) is 0
    where the argmaxes agree and ln 2 where they differ, so any 0 < T < ln 2 on processed distributions *is* greedy
    exact-match decoding; on the raw distributions FSD accepts some disagreements."""
    target = ModelRunner(tiny_target)
    poor = perturbed_copy(tiny_target, scale=1.0, seed=5)
    greedy = generate(target, PROMPTS, method="ar", max_new_tokens=30).sequences
    processed = generate(target, PROMPTS, method="sd", drafter=_drafter(poor),
                         rule=Fuzzy(divergence="jsd", threshold=0.6, use_raw=False), max_new_tokens=30)
    assert processed.sequences == greedy
    raw = generate(target, PROMPTS, method="sd", drafter=_drafter(poor), rule=Fuzzy(divergence="jsd", threshold=0.6),
               max_new_tokens=30)
    assert raw.sequences != greedy
    assert raw.batch_metrics.accepted_tokens > processed.batch_metrics.accepted_tokens


def test_fsd_drafts_greedy_by_default_and_sampled_on_request(soft_target, tiny_draft):
    params = SamplingParams(temperature=1.0)
    for greedy_drafts, expect_argmax in ((None, True), (False, False)):
        log: list = []
        generate(ModelRunner(soft_target), PROMPTS * 4, method="sd", drafter=_drafter(tiny_draft),
                 rule=Recording(log, threshold=0.2, greedy_drafts=greedy_drafts), sampling=params, max_new_tokens=16)
        ids = torch.cat([s["draft_ids"].reshape(-1) for s in log])
        argmax = torch.cat([s["draft_probs"].argmax(-1).reshape(-1) for s in log])
        share = (ids == argmax).float().mean().item()
        if expect_argmax:
            assert share == 1.0
        else:
            assert share < 0.95, share  # sampled drafts leave the argmax at T = 1


def test_fsd_threshold_limits_and_fuzzy_fraction_end_to_end(soft_target, tiny_draft):
    target = ModelRunner(soft_target)
    params = SamplingParams(temperature=0.8)
    # T = 0 accepts nothing: plain target sampling, draw for draw (greedy drafts use no randomness)
    ar = generate(target, PROMPTS, method="ar", sampling=params, max_new_tokens=20, seed=3)
    zero = generate(target, PROMPTS, method="sd", drafter=_drafter(tiny_draft), rule=Fuzzy(threshold=0.0),
                    sampling=params, max_new_tokens=20, seed=3)
    assert zero.sequences == ar.sequences
    assert zero.batch_metrics.accepted_tokens == 0 and zero.batch_metrics.lossy_share == 0
    # T = inf accepts every draft; every accepted token is a fuzzy acceptance: share K / (K + 1)
    # (21 tokens: the prefill's, then five steps of K + 1)
    k = 3
    inf = generate(target, PROMPTS, method="sd", drafter=_drafter(tiny_draft), rule=Fuzzy(threshold=math.inf),
                   policy=Constant(k), sampling=params, max_new_tokens=21, seed=3)
    for m in inf.metrics:
        assert m.accepted_tokens == m.drafted_tokens == k * m.steps
        assert m.lossy_accepted_tokens == m.accepted_tokens
        assert m.lossy_share == pytest.approx(k / (k + 1))
        assert m.to_dict()["lossy_share"] == m.lossy_share
    # in between: the fuzzy fraction counts exactly the acceptances the divergence test made
    mid = generate(target, PROMPTS, method="sd", drafter=_drafter(tiny_draft), rule=Fuzzy(threshold=0.1),
                   policy=Constant(k), sampling=params, max_new_tokens=20, seed=3)
    for m in mid.metrics:
        assert m.lossy_accepted_tokens == m.accepted_tokens
        assert 0 <= m.lossy_share < k / (k + 1) + 1e-9
    assert 0 < mid.batch_metrics.lossy_share


def test_hybrid_fsd_at_threshold_zero_is_speculative_sampling_end_to_end(soft_target, tiny_draft):
    target = ModelRunner(soft_target)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    for seed in (0, 1):
        sd = generate(target, PROMPTS, method="sd", drafter=_drafter(tiny_draft), rule=Lossless(), sampling=params,
                      max_new_tokens=24, seed=seed)
        hybrid = generate(target, PROMPTS, method="sd", drafter=_drafter(tiny_draft),
                          rule=Fuzzy(threshold=0.0, hybrid=True), sampling=params, max_new_tokens=24, seed=seed)
        assert hybrid.sequences == sd.sequences
        assert hybrid.batch_metrics.accepted_tokens == sd.batch_metrics.accepted_tokens
        assert hybrid.batch_metrics.lossy_accepted_tokens == 0
    # above T = 0 hybrid FSD accepts at least as much per step, some of it fuzzy
    loose = generate(target, PROMPTS, method="sd", drafter=_drafter(tiny_draft), rule=Fuzzy(threshold=0.3, hybrid=True),
                     sampling=params, max_new_tokens=24, seed=0)
    assert loose.batch_metrics.lossy_accepted_tokens > 0


def test_methods_pass_fsd_and_typical_options():
    spec = build_method("fsd", divergence="topk_js", divergence_top_k=7, fsd_raw=False, drafts="sampled", threshold=0.2)
    assert spec.rule == Fuzzy(divergence="topk_js", top_k=7, use_raw=False, greedy_drafts=False, threshold=0.2)
    spec = build_method("fsd", divergence="topp_jsd", divergence_top_p=0.5)
    assert spec.rule == Fuzzy(divergence="topp_jsd", top_p=0.5)
    assert build_method("fsd").rule.greedy_drafts and not build_method("fsd", hybrid=True).rule.greedy_drafts
    assert build_method("typical", drafts="greedy").rule.greedy_drafts
    assert not build_method("typical").rule.greedy_drafts
    for kwargs, msg in [
        (dict(name="fsd", drafts="beam"), "unknown drafts"),
        (dict(name="sd", drafts="greedy"), "applies to fsd and typical"),
        (dict(name="fsd", hybrid=True, drafts="greedy"), "sampled drafts"),
        (dict(name="fsd", divergence="topk_tv", divergence_top_k=0), "top_k"),
        (dict(name="fsd", divergence="topp_tv", divergence_top_p=0.0), "top_p"),
    ]:
        name = kwargs.pop("name")
        with pytest.raises(QuickdraftError, match=msg):
            build_method(name, **kwargs)


# ---------------------------------------------------------------------------------------------
# typical acceptance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("greedy_drafts", [False, True])
def test_typical_at_temperature_zero_is_greedy_decoding(tiny_target, greedy_drafts):
    """One-hot target: only the argmax clears min(ε, δ·e^0) < 1, and the recovered token is the argmax."""
    target = ModelRunner(tiny_target)
    poor = perturbed_copy(tiny_target, scale=1.0, seed=5)
    greedy = generate(target, PROMPTS, method="ar", max_new_tokens=30).sequences
    out = generate(target, PROMPTS, method="sd", drafter=_drafter(poor), rule=Typical(greedy_drafts=greedy_drafts),
                   max_new_tokens=30)
    assert out.sequences == greedy
    assert out.batch_metrics.lossy_accepted_tokens == out.batch_metrics.accepted_tokens > 0


# ---------------------------------------------------------------------------------------------
# chain ERSD
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=20, top_p=0.9)],
                         ids=["T0.7", "top"])
def test_chain_ersd_is_drafter_invariant_end_to_end(soft_target, params):
    """Same seed: token for token the target's race sample alone, for drafts of every quality,
    any K, adaptive draft lengths and the model-free n-gram drafter."""
    target = ModelRunner(soft_target)
    seed = 21
    reference = generate(target, PROMPTS, method="ar", rule=ExponentialRace(seed=seed), sampling=params,
                         max_new_tokens=28)
    drafts = {"close": perturbed_copy(soft_target, 0.3, 1), "far": perturbed_copy(soft_target, 3.0, 2),
              "unrelated": tiny_lm(seed=7), "self": soft_target}
    accepted = {}
    for name, model in drafts.items():
        for policy in (Constant(1), Constant(3), Constant(6), Heuristic(initial_k=2, max_k=8)):
            out = generate(target, PROMPTS, method="sd", drafter=_drafter(model), rule=ExponentialRace(seed=seed),
                           policy=policy, sampling=params, max_new_tokens=28)
            assert out.sequences == reference.sequences, (name, policy)
            accepted[name, type(policy).__name__, getattr(policy, "k", None)] = out.batch_metrics.acceptance_rate
    ngram = generate(target, PROMPTS, method="ngram", drafter=NGramDrafter(TINY_VOCAB), rule=ExponentialRace(seed=seed),
                     sampling=params, max_new_tokens=28)
    assert ngram.sequences == reference.sequences
    assert accepted["self", "Constant", 6] == 1.0  # the target drafting for itself: every draft accepted
    assert accepted["close", "Constant", 3] > accepted["unrelated", "Constant", 3]
    # and the seed matters: another seed is another sample
    other = generate(target, PROMPTS, method="ar", rule=ExponentialRace(seed=seed + 1), sampling=params, max_new_tokens=28)
    assert other.sequences != reference.sequences


def test_ersd_at_temperature_0_7_samples():
    """ERSD at T = 0.7 is not greedy decoding in disguise: on 400 rows of one prompt (row ids key
    different noise), the share of completions equal to the greedy one matches the exact
    probability prod_t p_0.7(g_t | g_<t) of sampling the greedy path (binomial test), and the
    first token follows p_0.7 (chi-square)."""
    model = tiny_lm(seed=0)
    with torch.no_grad():  # peaked, like a code model: the greedy path is likely but far from certain
        model.lm_head.weight.mul_(32.0)
    target, draft = ModelRunner(model), _drafter(perturbed_copy(model, scale=0.3, seed=1))
    prompt, n_rows, n_new = [3, 14, 15, 9, 2], 400, 3
    params = SamplingParams(temperature=0.7)
    greedy = generate(target, [prompt], method="ar", max_new_tokens=n_new).sequences[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + greedy[:-1]])).logits[0, -n_new:]
    probs = logits_to_probs(logits, params).double()  # [n_new, V] along the greedy path
    p_greedy_path = float(probs.gather(1, torch.tensor(greedy).unsqueeze(1)).prod())
    assert 0.2 < p_greedy_path < 0.8  # the check has power both ways
    out = generate(target, [prompt] * n_rows, method="sd", drafter=draft, rule=ExponentialRace(seed=0),
                   sampling=params, max_new_tokens=n_new)
    equal = sum(s == greedy for s in out.sequences)
    assert out.batch_metrics.accepted_tokens > 0
    assert scipy.stats.binomtest(equal, n_rows, p_greedy_path).pvalue > 1e-4, (equal, n_rows * p_greedy_path)
    first = np.bincount([s[0] for s in out.sequences], minlength=TINY_VOCAB)
    p_first = probs[0].numpy()
    big = p_first * n_rows >= 5
    obs = np.append(first[big], first[~big].sum())
    exp = np.append(p_first[big], p_first[~big].sum()) * n_rows
    assert scipy.stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-4


def test_ersd_rows_keyed_by_their_own_seed_decode_as_alone_in_any_batch(soft_target):
    """A row added with seed s and row id i draws what row i of the batch decoded alone with seed s
    draws: its text is the same whatever rows join and leave beside it, however the batch is
    seeded, and whatever draft length the batch runs. Without its seed (negative control) the same
    row in the same batch is another sample."""
    target, draft = ModelRunner(soft_target), perturbed_copy(soft_target, 0.3, 1)
    params = SamplingParams(temperature=0.8)
    alone = {s: generate(target, [PROMPTS[i]] * 2, method="sd", drafter=_drafter(draft), rule=ExponentialRace(seed=s),
                         sampling=params, max_new_tokens=20).sequences
             for i, s in ((0, 5), (2, 2 ** 64 - 3))}

    def shared(keyed: bool, k: int) -> list[list[int]]:
        decoder = Decoder(target, [], method="sd", drafter=_drafter(draft), rule=ExponentialRace(seed=99),
                          policy=Constant(k), sampling=params)
        decoder.add_rows([PROMPTS[1]], [30])  # an unkeyed row, there from the start
        decoder.step()
        extra = dict(seeds=[5], row_ids=[1]) if keyed else {}
        decoder.add_rows([PROMPTS[0]], [20], **extra)
        decoder.step()
        extra = dict(seeds=[2 ** 64 - 3] * 2, row_ids=[0, 1]) if keyed else {}
        decoder.add_rows([PROMPTS[2]] * 2, [20, 20], **extra)
        decoder.step()
        decoder.remove_rows([0])  # the first row leaves mid-way
        while decoder.active.any():
            decoder.step()
        return decoder.new_ids

    for k in (2, 5):
        rows = shared(True, k)
        assert rows == [alone[5][1]] + alone[2 ** 64 - 3], k
    assert shared(False, 3) != [alone[5][1]] + alone[2 ** 64 - 3]


def test_ersd_row_keys_refuse_bad_input(soft_target, tiny_draft):
    target = ModelRunner(soft_target)
    decoder = Decoder(target, [], method="sd", drafter=_drafter(tiny_draft), rule=Lossless())
    with pytest.raises(QuickdraftError, match="ersd rule only"):
        decoder.add_rows([PROMPTS[0]], [4], seeds=[1])
    decoder = Decoder(target, [], method="sd", drafter=_drafter(tiny_draft), rule=ExponentialRace(seed=0))
    with pytest.raises(QuickdraftError, match="1 prompts but 2 seeds"):
        decoder.add_rows([PROMPTS[0]], [4], seeds=[1, 2])
    with pytest.raises(QuickdraftError, match="race seed must be an integer"):
        decoder.add_rows([PROMPTS[0]], [4], seeds=[1.5])
    with pytest.raises(QuickdraftError, match="row_ids must be integers"):
        decoder.add_rows([PROMPTS[0]], [4], row_ids=[-1])
    assert decoder.batch_size == 0 and decoder.row_seeds is None  # nothing was added
