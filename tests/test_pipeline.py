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
