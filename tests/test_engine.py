"""The generation engine on tiny fp32 models: exactness, batching, roll-back, reproducibility, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quickdraft.decoding.drafters import ModelDrafter, NGramDrafter, NGramModelDrafter
from quickdraft.decoding.engine import Decoder, generate
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.policies import Constant
from quickdraft.verification.rules import Greedy, Lossless
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams, logits_to_probs, sample

from conftest import (TINY_VOCAB, chi_square_pvalue as _chi_square_pvalue, counts_after_first, exact_after_first,
                      tiny_lm)

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15]]


def test_runner_holes_and_rollback_match_running_the_path_alone(tiny_target):
    runner = ModelRunner(tiny_target, "target")
    runner.reset(2)
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, TINY_VOCAB, (2, 6), generator=gen)
    valid = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], dtype=torch.bool)  # row 1 left-padded
    runner.forward(first, valid)
    second = torch.randint(0, TINY_VOCAB, (2, 3), generator=gen)
    runner.forward(second)
    runner.truncate(torch.tensor([9, 5]))  # row 0 keeps all 3, row 1 keeps 1 (two holes remain)
    third = torch.randint(0, TINY_VOCAB, (2, 2), generator=gen)
    out = runner.forward(third)
    paths = [torch.cat([first[0], second[0], third[0]]), torch.cat([first[1, 2:], second[1, :1], third[1]])]
    for row, path in enumerate(paths):
        with torch.no_grad():
            alone = tiny_target(path.unsqueeze(0)).logits[0, -2:]
        assert torch.allclose(out.logits[row], alone, atol=1e-5), row
    assert runner.lengths.tolist() == [11, 7]


def test_truncate_crops_trailing_slots_for_a_single_row(tiny_target):
    runner = ModelRunner(tiny_target)
    runner.reset(1)
    runner.forward(torch.arange(10).unsqueeze(0))
    runner.truncate(torch.tensor([4]))
    assert runner.num_slots == 4 and runner.cache.get_seq_length() == 4


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_speculative_equals_plain_greedy(tiny_target, tiny_draft, k):
    target = ModelRunner(tiny_target, "target")
    drafter = ModelDrafter(ModelRunner(tiny_draft, "draft"), TINY_VOCAB)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=40)
    for prompts in (PROMPTS[:1], PROMPTS):  # B = 1 and B = 3
        spec = generate(target, prompts, method="sd", drafter=drafter, policy=Constant(k), max_new_tokens=40)
        assert spec.sequences == plain.sequences[: len(prompts)]
        m = spec.batch_metrics
        assert m.accepted_tokens > 0, "the perturbed draft should agree sometimes"
        assert m.steps < sum(len(s) for s in spec.sequences)  # fewer target calls than tokens


def test_batched_plain_decoding_equals_one_prompt_at_a_time(tiny_target):
    target = ModelRunner(tiny_target)
    batch = generate(target, PROMPTS, method="ar", max_new_tokens=25)
    for row, prompt in enumerate(PROMPTS):
        assert generate(target, [prompt], method="ar", max_new_tokens=25).sequences[0] == batch.sequences[row]


@pytest.mark.parametrize("rule", [Greedy(), Lossless()])
def test_ngram_drafter_greedy_equals_plain_greedy(tiny_target, rule):
    target = ModelRunner(tiny_target)
    # repetitive prompts so the lookup finds matches
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 9, 9, 9], [1, 2]]
    plain = generate(target, prompts, method="ar", max_new_tokens=40)
    ngram = generate(target, prompts, method="ngram", drafter=NGramDrafter(TINY_VOCAB), rule=rule,
                     policy=Constant(4), max_new_tokens=40)
    assert ngram.sequences == plain.sequences
    assert ngram.batch_metrics.drafted_tokens > 0


@pytest.mark.parametrize("rule", [Greedy(), Lossless()])
def test_ngram_sd_greedy_equals_plain_greedy_and_uses_both_drafters(tiny_target, tiny_draft, rule):
    target = ModelRunner(tiny_target)
    prompts = [[3, 4, 5, 3, 4, 5, 3, 4], [9, 9, 9, 9], [1, 2]]
    plain = generate(target, prompts, method="ar", max_new_tokens=40)
    for batch in (prompts[:1], prompts):
        drafter = NGramModelDrafter(NGramDrafter(TINY_VOCAB, max_ngram=3, min_ngram=2),
                                    ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB), lookup_k=6)
        out = generate(target, batch, method="ngram_sd", drafter=drafter, rule=rule, policy=Constant(3),
                       max_new_tokens=40)
        assert out.sequences == plain.sequences[: len(batch)]
        assert drafter.lookup_steps > 0, "the repetitive prompts should be looked up"
        assert out.batch_metrics.draft_forwards > 0, "steps without a match should use the draft model"
        assert out.batch_metrics.steps > drafter.lookup_steps


def test_ngram_sd_sampling_matches_the_target(tiny_target):
    """Lookup steps (one-hot drafts) and model steps mixed in one batch keep the target's exact law
    of the tokens after the prefill's (the first step is a lookup for every row: the prompt holds
    every token, so the first new token always matches); accepting every draft instead must fail
    the same test."""
    params = SamplingParams(temperature=1.0)
    prompt = list(range(TINY_VOCAB)) + [1, 2]
    exact = _exact_two_token_distribution(tiny_target, prompt, params)
    n = 40_000
    target = ModelRunner(tiny_target)

    def run(rule):
        drafter = NGramModelDrafter(NGramDrafter(TINY_VOCAB, max_ngram=2, min_ngram=1),
                                    ModelDrafter(ModelRunner(tiny_lm(seed=7)), TINY_VOCAB), lookup_k=3)
        out = generate(target, [prompt] * n, method="ngram_sd", drafter=drafter, rule=rule, policy=Constant(3),
                       sampling=params, max_new_tokens=3, seed=13)
        assert drafter.lookup_steps >= 1
        return _two_token_counts(out.sequences)

    assert _chi_square_pvalue(run(Lossless()), exact) > 1e-4

    class AcceptAll(Lossless):
        def accept(self, draft_ids, draft_probs, target_probs, ctx):
            return torch.ones_like(draft_ids, dtype=torch.bool), None

    assert _chi_square_pvalue(run(AcceptAll()), exact) < 1e-6


def test_ngram_sampling_matches_the_target(one_thread):
    """Plain prompt lookup at T = 0.9 on a vocabulary-8 pair: where the prefill emits a 7 (target
    probability 0.53), the sequence ends with a repeated bigram, so the first step verifies a copied
    (one-hot) draft of two tokens; later steps copy what matches or draft nothing. 10,000 rows
    generate four tokens; the three after the prefill's follow the target's exact law (512 cells,
    chi-square p > 1e-4). Two broken rules fail the same test (p < 1e-6): accepting every copied token, and recovering a rejected copy from the target instead of the
    residual (the target with the copied token removed), the bug a one-hot draft invites."""
    v, n = 8, 10_000
    model = tiny_lm(seed=31, vocab=v, max_positions=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    params = SamplingParams(temperature=0.9)
    prompt = [5, 4, 7, 5, 4]  # after a first 7 (probability 0.53) it copies 5, 4
    exact = exact_after_first(model, prompt, params, 3)
    target = ModelRunner(model)

    def run(rule):
        out = generate(target, [prompt] * n, method="ngram", drafter=NGramDrafter(v, max_ngram=2, min_ngram=2),
                       rule=rule, policy=Constant(3), sampling=params, max_new_tokens=4, seed=17)
        counts = counts_after_first(out.sequences, v, 3)
        return counts, out.batch_metrics

    counts, metrics = run(Lossless())
    assert n // 10 < metrics.accepted_tokens < metrics.drafted_tokens  # copies accepted and rejected
    assert _chi_square_pvalue(counts, exact) > 1e-4

    class AcceptAll(Lossless):
        def accept(self, draft_ids, draft_probs, target_probs, ctx):
            return torch.ones_like(draft_ids, dtype=torch.bool), None

    class RecoverFromTarget(Lossless):
        def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
            return sample(target_probs, ctx.generator)

    assert _chi_square_pvalue(run(AcceptAll())[0], exact) < 1e-6
    assert _chi_square_pvalue(run(RecoverFromTarget())[0], exact) < 1e-6


def test_ngram_sd_rejects_a_bad_lookup_length(tiny_draft):
    with pytest.raises(QuickdraftError, match="lookup_k"):
        NGramModelDrafter(NGramDrafter(TINY_VOCAB), ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB), lookup_k=0)


def test_ngram_lookup_copies_the_latest_continuation():
    drafter = NGramDrafter(100, max_ngram=2)
    assert drafter.lookup([1, 2, 3, 9, 1, 2, 4, 5, 1, 2], 3) == [4, 5, 1]
    assert drafter.lookup([7, 8], 3) == []


def test_seeded_sampling_is_reproducible(tiny_target, tiny_draft):
    target = ModelRunner(tiny_target)
    drafter = ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB)
    params = SamplingParams(temperature=0.9, top_p=0.95)
    runs = [generate(target, PROMPTS, method="sd", drafter=drafter, sampling=params, seed=s, max_new_tokens=30)
            for s in (5, 5, 6)]
    assert runs[0].sequences == runs[1].sequences
    assert runs[0].sequences != runs[2].sequences


def test_eos_and_max_new_tokens_stop_rows(tiny_target, tiny_draft):
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=30)
    eos = plain.sequences[0][5]
    drafter = ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB)
    out = generate(target, PROMPTS, method="sd", drafter=drafter, max_new_tokens=30, eos_token_ids={eos})
    first = plain.sequences[0].index(eos)
    assert out.sequences[0] == plain.sequences[0][: first + 1]
    assert out.finish_reasons[0] == "eos"
    assert all(len(s) <= 30 for s in out.sequences)


def test_the_prefill_emits_the_first_token(tiny_target, tiny_draft):
    """The prefill's forward gives every row its first token (at T = 0 the target's greedy token),
    counted as a prefill token and not as a step; the first step then drafts after it, and a
    one-token budget takes no step and no draft forward."""
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=12)
    assert plain.batch_metrics.steps == 3 * 11 and plain.batch_metrics.prefill_tokens == 3
    assert plain.batch_metrics.emitted_tokens == 3 * 11 and plain.batch_metrics.new_tokens == 3 * 12
    drafter = ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB)
    decoder = Decoder(target, PROMPTS, method="sd", drafter=drafter, max_new_tokens=12)
    assert decoder.new_ids == [s[:1] for s in plain.sequences]
    assert target.num_forwards == 1 and drafter.runner.num_forwards == 1  # one prefill each
    assert all(m.prefill_tokens == 1 and m.steps == 0 and m.target_forwards == 1 for m in decoder.metrics)
    decoder.step()
    assert all(m.steps == 1 and m.drafted_tokens == 4 for m in decoder.metrics)
    assert all(s == p[: len(s)] and len(s) >= 2 for s, p in zip(decoder.new_ids, plain.sequences))
    one = generate(target, PROMPTS, method="sd", drafter=drafter, max_new_tokens=1)
    assert one.sequences == [s[:1] for s in plain.sequences]
    assert one.batch_metrics.steps == 0 and one.batch_metrics.draft_forwards == 0
    assert one.batch_metrics.target_forwards == 1 and one.batch_metrics.tokens_per_second == 0.0


def test_a_row_whose_first_token_is_eos_ends_at_the_prefill(tiny_target, tiny_draft):
    """A row whose prefill emits EOS (or a stop) is done before the first step; the others run on
    and match plain decoding with the same EOS."""
    target = ModelRunner(tiny_target)
    eos = generate(target, PROMPTS, method="ar", max_new_tokens=1).sequences[1][0]
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=20, eos_token_ids={eos})
    drafter = ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB)
    out = generate(target, PROMPTS, method="sd", drafter=drafter, max_new_tokens=20, eos_token_ids={eos})
    assert out.sequences == plain.sequences and out.sequences[1] == [eos]
    assert out.finish_reasons[1] == "eos" and out.metrics[1].steps == 0 and out.metrics[1].prefill_tokens == 1
    assert out.metrics[0].steps > 0
    stopped = generate(target, PROMPTS, method="sd", drafter=drafter, max_new_tokens=20,
                       stop=lambda row, ids: 0 if row == 2 else None)
    assert stopped.sequences[2] == [] and stopped.finish_reasons[2] == "stop" and stopped.metrics[2].steps == 0


def _exact_two_token_distribution(model, prompt, params):
    """P(t2, t3 | prompt) of the target under ``params``, as a [V, V] array: the law of the two
    tokens after the first, which the prefill emits (the steps emit these)."""
    return exact_after_first(model, prompt, params, 2)


def _two_token_counts(sequences):
    return counts_after_first(sequences, TINY_VOCAB, 2)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=10, top_p=0.9)])
def test_speculative_sampling_end_to_end_matches_the_target(tiny_target, params):
    """40,000 three-token continuations drawn through the whole engine in one batch (the prefill
    emits the first token; K = 3, which the budget left cuts to one draft token and, after a
    rejection, a plain step; a draft that disagrees often): their second and third tokens follow
    the target's exact joint distribution; the same test on
    deliberately broken rules (accept every draft; at T < 1, verify against the raw target) must
    fail. (The rule-level goodness-of-fit tests
    with >= 100,000 samples are in test_rules.py; this one checks the engine's plumbing: drafts
    drawn from the distributions handed to the verifier, residuals, bonus tokens, roll-back.)"""
    prompt = [1, 2, 3]
    draft_model = tiny_lm(seed=7)  # an unrelated draft: many rejections, residual sampling matters
    exact = _exact_two_token_distribution(tiny_target, prompt, params)
    n = 40_000
    target = ModelRunner(tiny_target)
    drafter = ModelDrafter(ModelRunner(draft_model), TINY_VOCAB)
    out = generate(target, [prompt] * n, method="sd", drafter=drafter, rule=Lossless(), policy=Constant(3),
                   sampling=params, max_new_tokens=3, seed=11)
    p_value = _chi_square_pvalue(_two_token_counts(out.sequences), exact)
    assert p_value > 1e-4

    class AcceptAll(Lossless):
        def accept(self, draft_ids, draft_probs, target_probs, ctx):
            return torch.ones_like(draft_ids, dtype=torch.bool), None

    bad = generate(target, [prompt] * n, method="sd", drafter=drafter, rule=AcceptAll(), policy=Constant(3),
                   sampling=params, max_new_tokens=3, seed=11)
    assert _chi_square_pvalue(_two_token_counts(bad.sequences), exact) < 1e-6
    if params.temperature != 1.0:
        # the realistic bug: verification against the raw (temperature-1, untruncated) target while
        # the draft samples the processed distribution; fails on a quarter of the samples
        wrong = generate(target, [prompt] * (n // 4), method="sd", drafter=drafter, rule=VerifiesRawTarget(),
                         policy=Constant(3), sampling=params, max_new_tokens=3, seed=11)
        assert _chi_square_pvalue(_two_token_counts(wrong.sequences), exact) < 1e-6


class VerifiesRawTarget(Lossless):
    """Negative control: speculative sampling against the target's raw (temperature-1, untruncated)
    distributions from the context instead of the processed ones it is handed."""

    needs_raw = True

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return super().accept(draft_ids, draft_probs, ctx.raw_target_probs[:, : draft_ids.shape[1]], ctx)

    def correct(self, rejected_ids, draft_probs, target_probs, ctx, offsets):
        raw = ctx.raw_target_probs[torch.arange(offsets.shape[0]), offsets]  # [b, V]
        return super().correct(rejected_ids, draft_probs, raw, ctx, offsets)

    def bonus(self, target_probs, ctx, offsets):
        return super().bonus(ctx.raw_target_probs[torch.arange(offsets.shape[0]), offsets], ctx, offsets)


def test_bad_inputs_give_clear_errors(tiny_target):
    target = ModelRunner(tiny_target)
    with pytest.raises(QuickdraftError, match="empty prompt"):
        generate(target, [[]], method="ar")
    with pytest.raises(QuickdraftError, match="unknown method"):
        generate(target, [[1]], method="beam")
    with pytest.raises(QuickdraftError, match="needs a drafter"):
        generate(target, [[1]], method="sd")
    with pytest.raises(QuickdraftError, match="context overflow"):
        generate(target, [[1] * 500], method="ar", max_new_tokens=100)
    with pytest.raises(QuickdraftError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(QuickdraftError, match="top_p"):
        SamplingParams(temperature=1, top_p=0)
    with pytest.raises(QuickdraftError, match="max_new_tokens"):
        generate(target, [[1]], method="ar", max_new_tokens=0)
    with pytest.raises(QuickdraftError, match="draft length"):
        Constant(0)


def test_nan_logits_are_reported(tiny_target):
    broken = tiny_lm(seed=3)
    with torch.no_grad():
        broken.lm_head.weight.fill_(float("nan"))
    with pytest.raises(QuickdraftError, match="NaN logits"):
        generate(ModelRunner(broken, "target"), [[1, 2]], method="ar", max_new_tokens=2)


def test_check_finite_finds_a_nan_in_the_rows_it_checks_only():
    """One NaN among finite, +inf and -inf logits is found in a checked row and ignored in a row the
    mask leaves out (padding); +inf and -inf alone (their sum is NaN) are not reported."""
    from quickdraft.verification.sampling import check_finite

    logits = torch.zeros(2, 3, 50)
    logits[0, 1, 7] = float("inf")
    logits[0, 2, 9] = float("-inf")
    check_finite(logits, "m")  # no NaN, though the sum is NaN
    logits[1, 2, 4] = float("nan")
    with pytest.raises(QuickdraftError, match="m produced NaN logits"):
        check_finite(logits, "m")
    with pytest.raises(QuickdraftError, match="NaN logits"):
        check_finite(logits, "m", rows=torch.tensor([False, True]))
    check_finite(logits, "m", rows=torch.tensor([True, False]))
    check_finite(logits, "m", rows=torch.tensor([[True, True, True], [True, True, False]]))
    with pytest.raises(QuickdraftError, match="NaN logits"):
        check_finite(logits, "m", rows=torch.tensor([[False, False, False], [False, False, True]]))


def test_draft_length_is_capped_by_the_tokens_left(tiny_target, tiny_draft):
    """A draft of 50 tokens for a 4-token budget drafts at most 3 per step (the 4th is the bonus),
    and the greedy text is that of plain decoding."""
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=4)
    drafter = ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB)
    out = generate(target, PROMPTS, method="sd", drafter=drafter, policy=Constant(50), max_new_tokens=4)
    assert out.sequences == plain.sequences
    m = out.batch_metrics
    assert m.draft_forwards <= 3 * m.target_forwards
    assert m.draft_forwards <= 3 + 2 + 1  # 3 drafts, then at most 2, then 1, then a plain step
    # a one-token budget is one plain step: no draft forward at all
    one = generate(target, PROMPTS, method="sd", drafter=drafter, policy=Constant(8), max_new_tokens=1)
    assert one.sequences == [s[:1] for s in plain.sequences] and one.batch_metrics.draft_forwards == 0


def test_lookup_drafts_are_capped_by_the_tokens_left(tiny_target, tiny_draft):
    target = ModelRunner(tiny_target)
    prompt = [list(range(TINY_VOCAB)) + [5, 6, 7]]  # the first new token t is in it: the lookup copies t+1, t+2, …
    plain = generate(target, prompt, method="ar", max_new_tokens=4)
    drafter = NGramModelDrafter(NGramDrafter(TINY_VOCAB, 4, 1), ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB),
                                lookup_k=8)
    out = generate(target, prompt, method="ngram_sd", drafter=drafter, max_new_tokens=4)
    assert out.sequences == plain.sequences
    assert drafter.lookup_steps >= 1 and out.batch_metrics.drafted_tokens <= 2 * out.batch_metrics.steps


def test_draft_length_above_the_maximum_is_rejected(tiny_target, tiny_draft):
    from quickdraft.decoding.policies import MAX_DRAFT_LENGTH, Heuristic, Policy

    with pytest.raises(QuickdraftError, match=f"at most {MAX_DRAFT_LENGTH}"):
        Constant(MAX_DRAFT_LENGTH + 1)
    with pytest.raises(QuickdraftError, match=f"at most {MAX_DRAFT_LENGTH}"):
        Heuristic(max_k=10_000)
    Constant(MAX_DRAFT_LENGTH)  # the maximum itself is allowed

    class Greedy10k(Policy):
        name = "greedy10k"

        def begin_step(self) -> int:
            return 10_000

    drafter = ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB)
    with pytest.raises(QuickdraftError, match=rf"10000 tokens.*\[1, {MAX_DRAFT_LENGTH}\]"):
        generate(ModelRunner(tiny_target), [[1, 2]], method="sd", drafter=drafter, policy=Greedy10k(),
                 max_new_tokens=4)


def test_runner_forwards_emit_no_deprecation_warning(tiny_target):
    """Plain, hidden-state and tree forwards pass the KV cache the way the installed transformers
    expects: no FutureWarning / DeprecationWarning on any of them."""
    import warnings

    from quickdraft.backends.runner import cache_argument
    from quickdraft.decoding.tree import ancestor_mask

    runner = ModelRunner(tiny_target, "target")
    assert runner.cache_arg == cache_argument(tiny_target)
    runner.reset(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.forward(torch.tensor([[1, 2, 3]]), logits_to_keep=1)
        runner.forward(torch.tensor([[4]]), output_hidden=True)
        runner.begin_tree()
        runner.forward_tree(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 1]]),
                            ancestor_mask(torch.tensor([[-1, 0, 0]])))
        runner.commit_tree(torch.tensor([[0, 1]]), torch.tensor([2]))
    deprecations = [w for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert not deprecations, [str(w.message) for w in deprecations]
    assert int(runner.lengths[0]) == 6 and runner.cache.get_seq_length() == runner.num_slots == 6
