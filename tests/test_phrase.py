"""Phrase drafting (Ouroboros): the pool's harvest and lookup on constructed cases, exactness
through the engine (greedy equality, goodness of fit with a control that must fail), longer
accepted runs than the draft model alone where the text repeats, the pipeline and the command line."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.decoding.drafters import ModelDrafter
from quickdraft.decoding.engine import generate
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.decoding.phrase import PhraseConfig, PhraseDrafter, PhrasePool
from quickdraft.pipeline import Pipeline
from quickdraft.decoding.policies import Constant
from quickdraft.verification.rules import Greedy, Lossless
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams

from conftest import (TINY_VOCAB, chi_square_pvalue, counts_after_first, exact_after_first, perturbed_copy, tiny_lm,
                      word_tokenizer)
from test_cli import _run, tiny_pipeline  # noqa: F401  (tiny_pipeline is a fixture)


def test_pool_finds_the_latest_phrase_after_the_longest_key():
    pool = PhrasePool(max_phrase=3)
    pool.add([1, 2, 3, 4, 5])
    assert pool.phrases[(1,)] == (2, 3, 4) and pool.phrases[(1, 2)] == (3, 4, 5) and pool.phrases[(4,)] == (5,)
    assert pool.lookup([9, 2, 3], 2) == [4, 5]  # key (2, 3)
    assert pool.lookup([9, 3], 5) == [4, 5]  # key (3,): the two-token key (9, 3) is unknown
    assert pool.lookup([7, 8], 3) == [] and pool.lookup([], 3) == []
    pool.add([6, 2, 3, 7, 7])  # a later occurrence of (2, 3) wins
    assert pool.lookup([2, 3], 3) == [7, 7]
    pool.put((2, 3), (7,))  # a prefix of the stored phrase refreshes it, it does not shorten it
    assert pool.lookup([2, 3], 3) == [7, 7]
    pool.put((2, 3), (8, 8, 8, 8))  # another phrase replaces it, cut to max_phrase
    assert pool.lookup([2, 3], 9) == [8, 8, 8]


def test_pool_keeps_the_most_recently_seen_phrases():
    pool = PhrasePool(max_phrase=2, size=3)
    for key in [(1,), (2,), (3,)]:
        pool.put(key, (9,))
    pool.put((1,), (9,))  # seen again: now the most recent
    pool.put((4,), (9,))  # evicts (2,), the least recently seen
    assert list(pool.phrases) == [(3,), (1,), (4,)] and len(pool) == 3


def test_pool_harvests_a_growing_sequence_once_its_phrases_are_whole():
    pool = PhrasePool(max_phrase=2)
    pool.harvest([1, 2, 3])
    assert pool.phrases[(2,)] == (3,) and pool.seen == 1
    pool.harvest([1, 2, 3, 4, 5])  # the short phrase after 2 is completed
    assert pool.phrases[(2,)] == (3, 4) and pool.phrases[(4,)] == (5,) and pool.seen == 3


def test_pool_learns_the_rejected_tail_and_the_targets_verification():
    pool = PhrasePool(max_phrase=4)
    # draft [5, 6, 7, 8]: 5 accepted, 6 rejected; the target's argmax after [], [5], [5, 6], ...
    draft, target_ids = [5, 6, 7, 8], [5, 9, 7, 1, 2]
    pool.add_verification(draft, target_ids, num_accepted=1)
    assert pool.phrases[(6,)] == (7, 1)  # after [5, 6] the target says 7, the draft agreed, then 1
    assert pool.phrases[(5, 6)] == (7, 1)
    assert pool.phrases[(6, 7)] == (1,)  # after [5, 6, 7]: 1, and the draft's 8 disagreed
    assert pool.phrases[(8,)] == (2,)  # after the whole draft
    assert pool.lookup([0, 7], 3) == [1]  # the target's phrase refreshed the draft's (7,) -> (8,)
    empty = PhrasePool()
    empty.add_verification(draft, target_ids, num_accepted=4)  # fully accepted: nothing rejected
    assert len(empty) == 0


def test_config_errors():
    with pytest.raises(QuickdraftError, match="max_phrase"):
        PhraseConfig(max_phrase=0)
    with pytest.raises(QuickdraftError, match="at most 64"):
        PhraseConfig(max_draft=65)
    with pytest.raises(QuickdraftError, match="pool_size"):
        PhraseConfig(pool_size=0)
    spec = build_method("phrase_sd", phrase_len=3, phrase_pool=10, phrase_max_draft=6)
    assert spec.needs_draft and spec.phrase == PhraseConfig(3, 10, 6)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


@pytest.mark.parametrize("rule", [Greedy(), Lossless()])
def test_phrase_sd_greedy_equals_plain_greedy(tiny_target, tiny_draft, rule):
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=30)
    for batch in (PROMPTS[:1], PROMPTS):  # B = 1 and B = 3
        for k, config in [(3, PhraseConfig()), (4, PhraseConfig(max_phrase=2, max_draft=7))]:
            drafter = PhraseDrafter(ModelRunner(tiny_draft), TINY_VOCAB, config)
            out = generate(target, batch, method="phrase_sd", drafter=drafter, rule=rule, policy=Constant(k),
                           max_new_tokens=30)
            assert out.sequences == plain.sequences[: len(batch)]
            assert drafter.phrase_tokens > 0 and out.batch_metrics.accepted_tokens > 0
            assert len(drafter.pools) == len(batch)
    drafter.start(PROMPTS)
    assert drafter.pools == {} and drafter.phrase_tokens == 0


def test_phrases_lengthen_accepted_runs_where_the_text_repeats(tiny_target):
    """The tiny target's greedy text falls into the cycle 29 18 56; a prompt of that cycle fills the
    pool with it. A close draft model drafts the cycle too, two tokens a step; the pool's phrases
    lengthen its drafts to 16 tokens, accepted whole, with the same output and fewer draft forwards."""
    target = ModelRunner(tiny_target)
    prompt = [[29, 18, 56] * 6]
    draft = perturbed_copy(tiny_target, scale=0.1, seed=1)
    sd = generate(target, prompt, method="sd", drafter=ModelDrafter(ModelRunner(draft), TINY_VOCAB),
                  policy=Constant(2), max_new_tokens=40)
    phrase = generate(target, prompt, method="phrase_sd", drafter=PhraseDrafter(ModelRunner(draft), TINY_VOCAB),
                      policy=Constant(2), max_new_tokens=40)
    assert phrase.sequences == sd.sequences
    assert sd.sequences[0][18:24] == [29, 18, 56, 29, 18, 56]  # the target does continue the cycle
    assert phrase.batch_metrics.mean_acceptance_length > 2 * sd.batch_metrics.mean_acceptance_length
    assert phrase.batch_metrics.draft_forwards < sd.batch_metrics.draft_forwards


class AcceptAll(Lossless):
    """A broken rule: every drafted token accepted."""

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return torch.ones_like(draft_ids, dtype=torch.bool), None


def test_phrase_sd_sampling_matches_the_target(one_thread):
    """At T = 1 on a vocabulary-8 pair, 8,000 rows generate five tokens with one-token phrases from
    a repetitive prompt's pool (so the draft model checks and cuts phrases between its forwards,
    and phrase tokens are rejected and accepted); the three after the prefill's follow the target's exact law
    (512 cells, chi-square p > 1e-4). Accepting every draft fails the same test (p < 1e-6)."""
    v, n = 8, 8_000
    model = tiny_lm(seed=31, vocab=v, max_positions=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    params = SamplingParams(temperature=1.0)
    prompt = [5, 4, 7, 5, 4, 7, 5, 4]
    exact = exact_after_first(model, prompt, params, 3)
    target = ModelRunner(model)

    def run(rule):
        drafter = PhraseDrafter(ModelRunner(tiny_lm(seed=7, vocab=v, max_positions=64)), v,
                                PhraseConfig(max_phrase=1, max_draft=3))
        out = generate(target, [prompt] * n, method="phrase_sd", drafter=drafter, rule=rule, policy=Constant(3),
                       sampling=params, max_new_tokens=5, seed=17)
        counts = counts_after_first(out.sequences, v, 3)
        return counts, out.batch_metrics, drafter

    counts, metrics, drafter = run(Lossless())
    assert n // 10 < metrics.accepted_tokens < metrics.drafted_tokens
    assert drafter.phrase_tokens > n // 2 and metrics.draft_forwards > 1
    assert chi_square_pvalue(counts, exact) > 1e-4
    assert chi_square_pvalue(run(AcceptAll())[0], exact) < 1e-6


def test_pipeline_runs_phrase_sd(tiny_target, tiny_draft):
    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    plain = pipe.generate("w1 w2 w3", method="ar", max_new_tokens=20, chat=False)
    out = pipe.generate("w1 w2 w3", method="phrase_sd", max_new_tokens=20, chat=False,
                        phrase=PhraseConfig(max_phrase=4, pool_size=64, max_draft=8))
    assert out.completions[0].text == plain.completions[0].text
    assert out.metrics.accepted_tokens > 0 and out.metrics.draft_forwards > 0
    drafter = pipe.drafter_for("phrase_sd", phrase=PhraseConfig(max_phrase=4))
    assert isinstance(drafter, PhraseDrafter) and drafter.max_draft == 16 and drafter.config.max_phrase == 4


@pytest.mark.parametrize("args, needle", [
    (["--phrase-len", "0"], "max_phrase (--phrase-len) must be an integer >= 1"),
    (["--phrase-pool", "0"], "pool_size (--phrase-pool) must be an integer >= 1"),
    (["--phrase-max-draft", "100"], "max_draft (--phrase-max-draft) must be at most 64"),
])
def test_cli_phrase_errors(args, needle):
    result = _run("generate", "hello", "--method", "phrase_sd", *args, "--target", "/nonexistent/model/dir")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_cli_phrase_sd_end_to_end(tiny_pipeline):  # noqa: F811
    common = ["generate", "w1 w2 w3 w1 w2 w3", "--no-chat", "--max-new-tokens", "12", "--json"]
    result = _run(*common, "--method", "phrase_sd", "--policy", "constant", "--phrase-len", "4", "--phrase-pool", "100",
                  "--phrase-max-draft", "8")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output[result.output.index("{"):])
    plain = json.loads((r := _run(*common, "--method", "ar")).output[r.output.index("{"):])
    assert payload["method"] == "phrase_sd" and payload["text"] == plain["text"]
    assert payload["metrics"]["draft_forwards"] > 0
