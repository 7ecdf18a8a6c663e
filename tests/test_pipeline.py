"""Text in, text out on a tiny model with a tiny word-level tokenizer: stop strings, streaming,
batching, chat-template errors."""

from __future__ import annotations

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.pipeline import Pipeline
from quickdraft.verification.sampling import SamplingParams

from conftest import TINY_VOCAB, word_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer()


@pytest.fixture(scope="module")
def pipe(tiny_target, tiny_draft, tokenizer):
    return Pipeline(tiny_target, tokenizer, tiny_draft)


def test_streamed_text_concatenates_to_the_final_text(pipe):
    pieces = []
    out = pipe.generate(["w1 w2 w3"], method="sd", k=3, max_new_tokens=20, chat=False,
                        on_text=lambda row, text: pieces.append(text))
    assert "".join(pieces) == out.completions[0].text
    assert out.completions[0].text.strip()


def test_stop_string_cuts_text_and_tokens(pipe):
    free = pipe.generate(["w1 w2 w3"], method="ar", max_new_tokens=20, chat=False).completions[0]
    words = free.text.split()
    stop_word = words[4]
    first = words.index(stop_word)
    cut = pipe.generate(["w1 w2 w3"], method="sd", k=4, max_new_tokens=20, chat=False,
                        stop_strings=(stop_word,)).completions[0]
    assert cut.finish_reason == "stop"
    assert cut.text.split() == words[:first]
    assert cut.token_ids == free.token_ids[: first + 1]  # up to the token that completes the stop string


def test_batch_through_the_pipeline_equals_single_prompts(pipe):
    prompts = ["w1 w2 w3", "w9", "w4 w4 w4 w4 w4"]
    batch = pipe.generate(prompts, method="sd", k=3, max_new_tokens=15, chat=False)
    for prompt, completion in zip(prompts, batch.completions):
        alone = pipe.generate([prompt], method="ar", max_new_tokens=15, chat=False).completions[0]
        assert completion.token_ids == alone.token_ids


def test_sampled_generation_is_reproducible(pipe):
    params = SamplingParams(temperature=1.0)
    a = pipe.generate(["w1 w2"], method="sd", sampling=params, seed=3, max_new_tokens=15, chat=False)
    b = pipe.generate(["w1 w2"], method="sd", sampling=params, seed=3, max_new_tokens=15, chat=False)
    assert a.completions[0].token_ids == b.completions[0].token_ids


def test_errors_name_the_problem(pipe, tiny_target, tokenizer):
    with pytest.raises(QuickdraftError, match="empty prompt"):
        pipe.generate([""], method="ar", chat=False)
    with pytest.raises(QuickdraftError, match="chat template"):
        pipe.generate(["w1"], method="ar", chat=True)
    with pytest.raises(QuickdraftError, match="needs a draft model"):
        Pipeline(tiny_target, tokenizer).generate(["w1"], method="sd", chat=False)


def test_mismatched_vocabularies_are_rejected(tiny_target, tokenizer):
    from conftest import tiny_lm

    with pytest.raises(QuickdraftError, match="vocabularies differ"):
        Pipeline(tiny_target, tokenizer, tiny_lm(seed=2, vocab=TINY_VOCAB // 2))


def test_a_bare_string_is_one_prompt(pipe):
    one = pipe.generate("w1 w2 w3", method="sd", k=3, max_new_tokens=10, chat=False)
    listed = pipe.generate(["w1 w2 w3"], method="sd", k=3, max_new_tokens=10, chat=False)
    assert len(one.completions) == 1
    assert one.completions[0].token_ids == listed.completions[0].token_ids


def test_bad_text_inputs_are_rejected_before_tokenizing(pipe):
    with pytest.raises(QuickdraftError, match="empty stop string"):
        pipe.generate(["w1 w2"], method="ar", max_new_tokens=4, chat=False, stop_strings=("",))
    with pytest.raises(QuickdraftError, match=r"prompt is not valid UTF-8.*\\udcff"):
        pipe.generate(["w1 \udcff"], method="ar", max_new_tokens=4, chat=False)
    with pytest.raises(QuickdraftError, match="stop string is not valid UTF-8"):
        pipe.generate(["w1"], method="ar", max_new_tokens=4, chat=False, stop_strings=("\ud800",))
    with pytest.raises(QuickdraftError, match="must be a str"):
        pipe.generate([1, 2], method="ar", max_new_tokens=4, chat=False)


@pytest.mark.parametrize("bad", [TINY_VOCAB, -1, 2.5, "w1"])
def test_out_of_vocabulary_prompt_ids_are_rejected(pipe, bad):
    with pytest.raises(QuickdraftError, match=rf"token id .* vocabulary \[0, {TINY_VOCAB}\)"):
        pipe.generate([], method="sd", prompt_ids=[[1, 2], [3, bad]], max_new_tokens=4)
    with pytest.raises(QuickdraftError, match="vocabulary"):
        pipe.generate([], method="tree", prompt_ids=[[1, bad]], max_new_tokens=4)


def test_a_tiny_positive_temperature_decodes_greedily(pipe):
    from quickdraft.verification.sampling import GREEDY_TEMPERATURE

    assert SamplingParams(temperature=1e-40).greedy and not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    greedy = pipe.generate(["w1 w2"], method="sd", max_new_tokens=12, chat=False)
    for t in (1e-40, 1e-300, GREEDY_TEMPERATURE / 2):
        out = pipe.generate(["w1 w2"], method="sd", sampling=SamplingParams(temperature=t), seed=3,
                            max_new_tokens=12, chat=False)
        assert out.completions[0].token_ids == greedy.completions[0].token_ids


def test_rules_that_read_the_whole_draft_distribution_refuse_a_cut_draft_head(tiny_target, tiny_draft, tokenizer):
    """A draft head cut to part of the vocabulary (the openvino backend's --draft-vocab) gives the
    other tokens probability 0: FSD's js (and kl_reverse) are then infinite and would reject every
    draft, and contrastive decoding reads log q of every token. Such a rule is refused by name with
    the fix; a divergence that stays finite runs; the CLI loads the full head for them by default."""
    import torch

    from quickdraft.cli import full_head_unless_given
    from quickdraft.verification import divergences
    from quickdraft.verification.rules import Contrastive, Fuzzy, Lossless

    p = torch.softmax(torch.randn(2, TINY_VOCAB), -1)
    q_cut = torch.softmax(torch.randn(2, TINY_VOCAB), -1)
    q_cut[:, TINY_VOCAB // 2:] = 0
    q_cut /= q_cut.sum(-1, keepdim=True)
    assert torch.isinf(divergences.js(p, q_cut)).all() and torch.isinf(divergences.kl_reverse(p, q_cut)).all()
    assert torch.isfinite(divergences.jsd(p, q_cut)).all() and torch.isfinite(divergences.kl(p, q_cut)).all()

    needs = {d: Fuzzy(divergence=d, threshold=0.4).needs_full_draft
             for d in ("js", "kl_reverse", "topk_js", "topp_kl_reverse", "jsd", "kl", "tv", "topk_tv")}
    assert needs == {"js": True, "kl_reverse": True, "topk_js": True, "topp_kl_reverse": True,
                     "jsd": False, "kl": False, "tv": False, "topk_tv": False}
    assert not Fuzzy(divergence="js", threshold=0).needs_full_draft  # accepts nothing fuzzily: no divergence
    assert Contrastive().needs_full_draft and not Lossless().needs_full_draft

    cut = Pipeline(tiny_target, tokenizer, tiny_draft)
    cut.draft.head_ids = torch.arange(TINY_VOCAB // 2)
    with pytest.raises(QuickdraftError, match="divergence is infinite.*--draft-vocab 0.*jsd, kl, tv"):
        cut.generate(["w1 w2"], method="sd", rule=Fuzzy(divergence="js", threshold=0.4), max_new_tokens=4)
    with pytest.raises(QuickdraftError, match="whole distribution.*--draft-vocab 0"):
        cut.generate(["w1 w2"], method="scd", rule=Contrastive(), max_new_tokens=4)
    out = cut.generate(["w1 w2"], method="sd", rule=Fuzzy(divergence="jsd", threshold=0.4), max_new_tokens=4)
    assert len(out.completions[0].token_ids) == 4
    assert full_head_unless_given(None, Fuzzy(divergence="js")) == 0
    assert full_head_unless_given(None, Fuzzy(divergence="jsd")) is None
    assert full_head_unless_given(49152, Fuzzy(divergence="js")) == 49152  # the user's choice stands
