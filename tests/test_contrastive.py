"""Contrastive decoding with the draft model as the amateur (``cd``) and its speculative form
(``scd``): the scores against their definition, greedy ``scd`` equal to greedy ``cd`` token for
token, sampled ``scd`` and ``cd`` against the exact contrastive law (goodness of fit, with controls
that must fail), β = 0 as ``sd``, parameter errors, the pipeline and the command line."""

from __future__ import annotations

import doctest
import json
import math

import numpy as np
import pytest
import torch

import quickdraft.verification.rules
from quickdraft.decoding.contrastive import ContrastiveDrafter
from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Constant
from quickdraft.verification.rules import Contrastive, Lossless, contrastive_scores
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs

from conftest import TINY_VOCAB, chi_square_pvalue, perturbed_copy, tiny_lm, word_tokenizer
from test_cli import _run, tiny_pipeline  # noqa: F401  (tiny_pipeline is a fixture)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


# -- the scores ------------------------------------------------------------------------------------


def test_the_docstring_example_passes():
    scores = contrastive_scores(torch.tensor([0.6, 0.36, 0.04]).log(), torch.tensor([0.9, 0.05, 0.05]).log(), 0.1, 1.0)
    assert torch.allclose(scores.exp(), torch.tensor([0.6 / 0.9, 0.36 / 0.05, 0.0]))
    assert doctest.testmod(quickdraft.verification.rules).failed == 0


@pytest.mark.parametrize("alpha, beta", [(0.1, 0.5), (0.0, 1.0), (0.5, 2.0), (1.0, 0.5), (0.1, 0.0)])
def test_scores_follow_their_definition(alpha, beta):
    """Against the definition in probabilities, row by row: V_head = {x : p_exp(x) >= α max p_exp},
    log p_exp − β log p_ama on it, −inf elsewhere; and a constant added to either model's logits
    changes nothing."""
    gen = torch.Generator().manual_seed(3)
    target_logits = torch.randn(4, 3, 50, generator=gen) * 3
    amateur_logits = torch.randn(4, 3, 50, generator=gen) * 3
    scores = contrastive_scores(target_logits, amateur_logits, alpha, beta)
    p_exp, p_ama = target_logits.double().softmax(-1), amateur_logits.double().softmax(-1)
    head = p_exp >= alpha * p_exp.amax(-1, keepdim=True) * (1 - 1e-6)
    expected = torch.where(head, p_exp.log() - beta * p_ama.log(), torch.tensor(-math.inf, dtype=torch.float64))
    assert torch.equal(scores.isinf(), expected.isinf())
    assert torch.allclose(scores[~scores.isinf()].double(), expected[~expected.isinf()], atol=1e-4)
    shifted = contrastive_scores(target_logits + 7.0, amateur_logits - 5.0, alpha, beta)
    assert torch.allclose(shifted, scores, atol=1e-4) and torch.equal(shifted.isinf(), scores.isinf())
    # the target's argmax is always plausible; α = 1 leaves it alone
    assert not scores.gather(-1, target_logits.argmax(-1, keepdim=True)).isinf().any()
    if alpha == 1.0:
        assert torch.equal(scores.argmax(-1), target_logits.argmax(-1)) and (~scores.isinf()).sum(-1).eq(1).all()


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.3, top_k=10, top_p=0.9)])
def test_beta_and_alpha_zero_give_the_target_distribution(params):
    gen = torch.Generator().manual_seed(5)
    target_logits, amateur_logits = torch.randn(2, 5, 40, generator=gen) * 4, torch.randn(2, 5, 40, generator=gen)
    scores = contrastive_scores(target_logits, amateur_logits, alpha=0.0, beta=0.0)
    assert torch.allclose(logits_to_probs(scores, params), logits_to_probs(target_logits, params), atol=1e-6)
    assert Contrastive(alpha=0, beta=0).lossless and not Contrastive().lossless


@pytest.mark.parametrize("bad", [dict(alpha=-0.1), dict(alpha=1.5), dict(alpha=math.nan), dict(alpha=True),
                                 dict(alpha="0.1"), dict(beta=-1.0), dict(beta=math.inf), dict(beta=math.nan),
                                 dict(beta=None)])
def test_bad_parameters_give_a_clear_error(bad):
    with pytest.raises(QuickdraftError, match="contrastive decoding (alpha|beta)"):
        Contrastive(**bad)
    keys = {"alpha": "cd_alpha", "beta": "cd_beta"}
    with pytest.raises(QuickdraftError, match="contrastive decoding (alpha|beta)"):
        build_method("scd", **{keys[k]: v for k, v in bad.items()})


def test_methods_build_the_contrastive_rule():
    greedy = build_method("scd", cd_alpha=0.2, cd_beta=1.0)
    sampled = build_method("cd", sampling=SamplingParams(temperature=0.7))
    assert greedy.engine_method == "scd" and greedy.needs_draft and greedy.rule == Contrastive(0.2, 1.0, True)
    assert sampled.engine_method == "cd" and sampled.rule == Contrastive(0.1, 0.5, False)
    assert isinstance(sampled.rule.test, Lossless) and quickdraft.verification.rules.RULES["contrastive"] is Contrastive


# -- through the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def amateur():
    """A small model unrelated to the tiny target: the contrast moves many greedy tokens."""
    return tiny_lm(seed=7)


@pytest.fixture(scope="module")
def weak_amateur(tiny_target):
    """A perturbed, flatter copy of the tiny target: its argmax often survives the contrast (drafts
    accepted, bonus tokens), and the contrast still moves about a third of the greedy tokens."""
    model = perturbed_copy(tiny_target, scale=0.3, seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)
    return model


def _run_cd(target_model, amateur_model, prompts, method, rule, k=4, sampling=SamplingParams(), n=30, seed=0):
    drafter = ContrastiveDrafter(ModelRunner(amateur_model, "draft"), target_model.config.vocab_size,
                                 drafts=method == "scd")
    return generate(ModelRunner(target_model, "target"), prompts, method=method, drafter=drafter, rule=rule,
                    policy=Constant(k), sampling=sampling, max_new_tokens=n, seed=seed)


def _reference_greedy_cd(target_model, amateur_model, prompt, n, alpha, beta) -> list[int]:
    """Greedy contrastive decoding by full forwards over the whole sequence, no cache, no engine."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            t = target_model(torch.tensor([seq])).logits[0, -1]
            a = amateur_model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(contrastive_scores(t, a, alpha, beta).argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("alpha, beta", [(0.1, 0.5), (0.05, 1.0)])
def test_greedy_cd_is_contrastive_decoding(tiny_target, amateur, alpha, beta):
    rule = Contrastive(alpha, beta, greedy_drafts=True)
    out = _run_cd(tiny_target, amateur, PROMPTS, "cd", rule)
    assert out.sequences == [_reference_greedy_cd(tiny_target, amateur, p, 30, alpha, beta) for p in PROMPTS]
    plain = generate(ModelRunner(tiny_target), PROMPTS, method="ar", max_new_tokens=30)
    assert out.sequences != plain.sequences  # the contrast changes the text
    for m in out.metrics:  # the amateur and the target once a token, no drafts
        assert m.draft_forwards == m.steps == m.new_tokens == 30 and m.drafted_tokens == 0
        assert m.prefill_tokens == 0  # the first token needs the amateur's scores: the first step emits it


@pytest.mark.parametrize("k", range(1, 7))
def test_greedy_scd_equals_greedy_cd(tiny_target, weak_amateur, k):
    """The exactness statement: every token of greedy scd is greedy cd's, for B = 1 and B = 3."""
    rule = Contrastive(0.1, 0.5, greedy_drafts=True)
    cd = _run_cd(tiny_target, weak_amateur, PROMPTS, "cd", rule, n=40)
    assert cd.sequences != generate(ModelRunner(tiny_target), PROMPTS, method="ar", max_new_tokens=40).sequences
    for prompts in (PROMPTS[:1], PROMPTS):
        scd = _run_cd(tiny_target, weak_amateur, prompts, "scd", rule, k=k, n=40)
        assert scd.sequences == cd.sequences[: len(prompts)]
        m = scd.batch_metrics
        assert m.accepted_tokens > 0 and m.steps < sum(len(s) for s in scd.sequences)


def test_greedy_scd_equals_greedy_cd_when_every_draft_is_rejected(tiny_target, amateur):
    """An unrelated amateur's argmax is what the contrast penalises most: scd accepts nothing,
    emits one recovered token per step, and still equals cd."""
    rule = Contrastive(0.1, 0.5, greedy_drafts=True)
    cd = _run_cd(tiny_target, amateur, PROMPTS, "cd", rule, n=40)
    scd = _run_cd(tiny_target, amateur, PROMPTS, "scd", rule, k=3, n=40)
    assert scd.sequences == cd.sequences and scd.batch_metrics.drafted_tokens > 0


def _exact_cd_triples(target_model, amateur_model, prompt, params, alpha, beta) -> np.ndarray:
    """P(t1, t2, t3 | prompt) of contrastive decoding ``[V, V, V]``: the processed scores of the
    two models after every one- and two-token context (one batched forward each)."""
    v = target_model.config.vocab_size

    def law(contexts):
        with torch.no_grad():
            t = target_model(torch.tensor(contexts)).logits[:, -1]
            a = amateur_model(torch.tensor(contexts)).logits[:, -1]
        return logits_to_probs(contrastive_scores(t, a, alpha, beta), params).double()

    p1 = law([prompt])[0]
    p2 = law([prompt + [x] for x in range(v)])
    p3 = law([prompt + [x, y] for x in range(v) for y in range(v)]).view(v, v, v)
    return (p1.view(v, 1, 1) * p2.view(v, v, 1) * p3).numpy()


class AcceptAll(Contrastive):
    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return torch.ones_like(draft_ids, dtype=torch.bool), None


class VerifiesTheTarget(Contrastive):
    """Negative control: the drafts verified against the target's own scores (plain ``sd``)."""

    def scores(self, target_logits, amateur_logits):
        return target_logits.float()


class BonusWithoutTheAmateur(Contrastive):
    """Negative control on the same support: as if the amateur's distribution were not at hand past
    the draft, the position after it (bonus or plain step) gets the target cut to V_head (β = 0)."""

    def scores(self, target_logits, amateur_logits):
        scores = super().scores(target_logits, amateur_logits)  # [B, K+1, V]
        scores[:, -1] = contrastive_scores(target_logits[:, -1], amateur_logits[:, -1], self.alpha, 0.0)
        return scores


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5)])
def test_sampled_scd_and_cd_match_contrastive_decoding(one_thread, params):
    """On a vocabulary-8 pair, 8,000 rows generate three tokens with scd (K = 3: the budget cuts the
    first step to two drafts, so the third token is a bonus token or a later step's; rejections
    and residuals are frequent with an unrelated amateur) and with cd; the first three tokens follow
    contrastive decoding's exact law (512 cells, chi-square p > 1e-4). Three broken versions fail
    the test (p < 1e-6): the drafts verified against the target's own distribution (sd), the
    position after the draft scored without the amateur, and every draft accepted."""
    v, n, alpha, beta = 8, 8_000, 0.1, 0.8
    target_model = tiny_lm(seed=31, vocab=v, max_positions=64)
    with torch.no_grad():
        target_model.lm_head.weight.mul_(6.0)
    amateur_model = tiny_lm(seed=7, vocab=v, max_positions=64)
    with torch.no_grad():
        amateur_model.lm_head.weight.mul_(6.0)
    prompt = [5, 4, 7, 1]
    exact = _exact_cd_triples(target_model, amateur_model, prompt, params, alpha, beta)

    def counts(method, rule):
        out = _run_cd(target_model, amateur_model, [prompt] * n, method, rule, k=3, sampling=params, n=3, seed=17)
        seqs = np.array([s[:3] for s in out.sequences])
        c = np.zeros((v, v, v))
        np.add.at(c, (seqs[:, 0], seqs[:, 1], seqs[:, 2]), 1)
        return c, out.batch_metrics

    scd, metrics = counts("scd", Contrastive(alpha, beta))
    assert n // 10 < metrics.accepted_tokens < metrics.drafted_tokens  # accepted and rejected drafts both
    assert chi_square_pvalue(scd, exact) > 1e-4
    assert chi_square_pvalue(counts("cd", Contrastive(alpha, beta))[0], exact) > 1e-4
    assert chi_square_pvalue(counts("scd", VerifiesTheTarget(alpha, beta))[0], exact) < 1e-6
    assert chi_square_pvalue(counts("scd", BonusWithoutTheAmateur(alpha, beta))[0], exact) < 1e-6
    assert chi_square_pvalue(counts("scd", AcceptAll(alpha, beta))[0], exact) < 1e-6


def test_beta_zero_is_sd(tiny_target, tiny_draft):
    """β = 0: greedy scd (any α) is plain greedy decoding, token for token. (Sampled, scd at
    α = β = 0 draws from the target's distribution, but not sd's draws: sd takes its first token
    from the prefill, scd from its first step, so their random streams part; the scores' identity is
    ``test_beta_and_alpha_zero_give_the_target_distribution``.)"""
    plain = generate(ModelRunner(tiny_target), PROMPTS, method="ar", max_new_tokens=30)
    greedy = _run_cd(tiny_target, tiny_draft, PROMPTS, "scd", Contrastive(0.1, 0.0, greedy_drafts=True))
    assert greedy.sequences == plain.sequences
    sd = generate(ModelRunner(tiny_target), PROMPTS, method="sd", drafter=ModelDrafter(ModelRunner(tiny_draft),
                  TINY_VOCAB), rule=Lossless(), policy=Constant(4), max_new_tokens=30)
    assert sd.sequences == greedy.sequences


def test_the_rule_and_the_method_go_together(tiny_target, tiny_draft):
    target = ModelRunner(tiny_target)
    with pytest.raises(QuickdraftError, match="run it with method cd or scd"):
        generate(target, PROMPTS, method="sd", drafter=ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB),
                 rule=Contrastive())
    with pytest.raises(QuickdraftError, match="needs the contrastive rule"):
        generate(target, PROMPTS, method="scd", drafter=ContrastiveDrafter(ModelRunner(tiny_draft), TINY_VOCAB),
                 rule=Lossless())


# -- pipeline and command line ---------------------------------------------------------------------


def test_pipeline_runs_cd_and_scd(tiny_target, tiny_draft):
    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    texts = {}
    for method in ("cd", "scd"):
        spec = build_method(method, cd_alpha=0.1, cd_beta=1.0)
        out = pipe.generate("w1 w2 w3", method=spec.engine_method, rule=spec.rule, max_new_tokens=20, chat=False)
        texts[method] = out.completions[0].text
        assert out.metrics.draft_forwards > 0
    assert texts["cd"] == texts["scd"] and texts["cd"].strip()
    drafter = pipe.drafter_for("cd")
    assert isinstance(drafter, ContrastiveDrafter) and not drafter.drafts and pipe.drafter_for("scd").drafts


def test_pipeline_refuses_a_draft_with_a_reduced_head(tiny_target, tiny_draft):
    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    pipe.draft.head_ids = torch.arange(32)  # as an openvino draft exported with --draft-vocab 32
    for method in ("cd", "scd"):
        with pytest.raises(QuickdraftError, match="reduced head"):
            pipe.drafter_for(method)


@pytest.mark.parametrize("args, needle", [
    (["--cd-alpha", "1.5"], "contrastive decoding alpha must be a plausibility cut in [0, 1]"),
    (["--cd-beta", "-0.5"], "contrastive decoding beta must be a finite number >= 0"),
])
def test_cli_contrastive_errors(args, needle):
    result = _run("generate", "hello", "--method", "scd", *args, "--target", "/nonexistent/model/dir")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_cli_scd_end_to_end(tiny_pipeline):  # noqa: F811
    common = ["generate", "w1 w2 w3 w1 w2", "--no-chat", "--max-new-tokens", "12", "--json", "--cd-alpha", "0.1",
              "--cd-beta", "1.0"]
    payloads = {}
    for method in ("cd", "scd", "ar"):
        result = _run(*common, "--method", method)
        assert result.exit_code == 0, result.output
        payloads[method] = json.loads(result.output[result.output.index("{"):])
    assert payloads["scd"]["method"] == "scd" and payloads["scd"]["text"] == payloads["cd"]["text"]
    assert payloads["scd"]["metrics"]["draft_forwards"] > 0
