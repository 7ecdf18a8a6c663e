"""Text in, text out on a tiny model with a tiny word-level tokenizer: stop strings, streaming,
batching, chat-template errors."""

from __future__ import annotations

import pytest

from quickdraft.errors import QuickdraftError
from quickdraft.pipeline import Pipeline
from quickdraft.sampling import SamplingParams

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
