"""The EAGLE-style feature drafter: its state after every step equals a drafter fed from scratch,
greedy chains and trees equal plain greedy decoding, sampling follows the target's law (with a
control that must fail), training improves it, files round-trip, and bad uses fail clearly."""

from __future__ import annotations

import pytest
import torch

from quickdraft.backends.runner import ModelRunner
from quickdraft.decoding.engine import generate
from quickdraft.decoding.feature_drafter import FeatureDrafter, FeatureState, FeatureTreeDrafter
from quickdraft.decoding.feature_model import FeatureDraftModel, FeatureDrafterMeta
from quickdraft.decoding.policies import Constant
from quickdraft.decoding.tree import TreeConfig
from quickdraft.errors import QuickdraftError
from quickdraft.models import model_fingerprint
from quickdraft.pipeline import Pipeline
from quickdraft.training.feature_drafter import FeatureTrainConfig, init_from_target, train_feature_drafter
from quickdraft.verification.rules import Lossless
from quickdraft.verification.sampling import SamplingParams

from conftest import chi_square_pvalue, counts_after_first, exact_after_first, tiny_lm, word_tokenizer

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 10], [3]]


def sampled_texts(model, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` texts the model itself writes at T = 1 (the training data of the tiny drafters)."""
    out = generate(ModelRunner(model), [[1 + i % 50, 2 + i % 7] for i in range(n)], method="ar",
                   sampling=SamplingParams(temperature=1.0), max_new_tokens=length, seed=seed)
    return [[1 + i % 50, 2 + i % 7] + s for i, s in enumerate(out.sequences)]


@pytest.fixture(scope="module")
def trained(tiny_target):
    """A feature drafter of the tiny target trained on 72 of its own texts, 24 held out (and its report)."""
    texts = sampled_texts(tiny_target, 96, 40, seed=3)
    cfg = FeatureTrainConfig(texts=96, epochs=10, lr=1e-2, ce_vocab=64, ce_weight=1.0, noise=0.0, holdout=0.25)
    return train_feature_drafter(tiny_target, texts, cfg, progress=False)


def test_training_raises_agreement_with_the_target(trained):
    _, report = trained
    history = report["history"]
    assert history[-1]["agree"] > history[0]["agree"] + 0.2
    assert history[-1]["reg"] < history[0]["reg"] / 2
    assert report["train_texts"] == 72 and report["heldout_texts"] == 24


def test_init_passes_the_feature_through(tiny_target):
    model = FeatureDraftModel(tiny_target).float()
    init_from_target(model, tiny_target)
    h = model.fc.out_features
    assert torch.equal(model.fc.weight[:, h:], torch.eye(h))
    last = tiny_target.model.layers[-1].state_dict()
    for name, value in model.layers.layers[0].state_dict().items():
        assert torch.equal(value, last[name].float())


def from_scratch_logits(model: FeatureDraftModel, target, seq: list[int]) -> torch.Tensor:
    """The first draft's logits after ``seq``: every pair (f_i, x_{i+1}) fed at once with the
    target's true features."""
    with torch.no_grad():
        f = target.model(input_ids=torch.tensor([seq[:-1]])).last_hidden_state  # f_0 .. f_{L-2}
        g, _ = model.step(torch.tensor([seq[1:]]), f, use_cache=False)
        return model.head(g[:, -1])[0].float()


@pytest.mark.parametrize("tree", [False, True])
def test_state_after_every_step_equals_a_drafter_fed_from_scratch(tiny_target, trained, tree, monkeypatch):
    """Whatever was accepted or rejected, the first draft distribution of every step equals the
    one of a drafter that reads every true pair of the sequence at once (three rows of different
    lengths, one a single token; rows still running)."""
    model = trained[0]
    target = ModelRunner(tiny_target)
    runner = ModelRunner(model)
    drafter = (FeatureTreeDrafter(runner, target, 64, TreeConfig(depth=3, topk=2, budget=5)) if tree
               else FeatureDrafter(runner, target, 64))
    seen = []
    feed = FeatureState.feed_pending

    def recording(state, sequences):
        out = feed(state, sequences)
        seen.append(([list(s) for s in sequences], out.logits[:, -1].float().clone()))
        return out

    monkeypatch.setattr(FeatureState, "feed_pending", recording)
    out = generate(target, PROMPTS, method="tree" if tree else "sd", drafter=drafter, policy=Constant(3),
                   max_new_tokens=16)
    assert len(seen) > 3 and out.batch_metrics.accepted_tokens > 0
    for sequences, logits in seen:
        for row, seq in enumerate(sequences):
            if len(seq) < 2 or len(seq) - len(PROMPTS[row]) >= 16:  # a finished row drafts nothing
                continue
            torch.testing.assert_close(logits[row], from_scratch_logits(model, tiny_target, seq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_chains_equal_plain_greedy(tiny_target, trained, k):
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=24)
    drafter = FeatureDrafter(ModelRunner(trained[0]), target, 64)
    out = generate(target, PROMPTS, method="sd", drafter=drafter, policy=Constant(k), max_new_tokens=24)
    assert out.sequences == plain.sequences
    assert out.batch_metrics.accepted_tokens > 0


def test_greedy_trees_equal_plain_greedy_and_accept_more_than_chains(tiny_target, trained):
    target = ModelRunner(tiny_target)
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=24)
    tree = FeatureTreeDrafter(ModelRunner(trained[0]), target, 64, TreeConfig(depth=4, topk=3, budget=10))
    out = generate(target, PROMPTS, method="tree", drafter=tree, max_new_tokens=24)
    assert out.sequences == plain.sequences
    chain = generate(target, PROMPTS, method="sd", drafter=FeatureDrafter(ModelRunner(trained[0]), target, 64),
                     policy=Constant(4), max_new_tokens=24)
    assert out.batch_metrics.target_forwards <= chain.batch_metrics.target_forwards


def test_trained_drafter_beats_an_untrained_one(tiny_target, trained):
    target = ModelRunner(tiny_target)
    prompts = [[5, 6, 7, 8], [11, 3]]
    fresh = FeatureDraftModel(tiny_target).eval()
    init_from_target(fresh, tiny_target)
    rates = []
    for model in (fresh, trained[0]):
        out = generate(target, prompts, method="sd", drafter=FeatureDrafter(ModelRunner(model), target, 64),
                       policy=Constant(4), max_new_tokens=32)
        rates.append(out.batch_metrics.accepted_tokens / out.batch_metrics.drafted_tokens)
    assert rates[1] > rates[0]


class AcceptAll(Lossless):
    """A broken rule: every drafted token accepted."""

    def accept(self, draft_ids, draft_probs, target_probs, ctx):
        return torch.ones_like(draft_ids, dtype=torch.bool), None


def test_sampling_follows_the_target(one_thread):
    """At T = 1 on a vocabulary-8 target, 6,000 rows draft chains of 3 with a feature drafter; the
    three tokens after the prefill's follow the target's exact law (512 cells, chi-square p > 1e-4). Accepting
    every draft fails the same test (p < 1e-6)."""
    v, n = 8, 6_000
    model = tiny_lm(seed=31, vocab=v, max_positions=64)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    params = SamplingParams(temperature=1.0)
    prompt = [5, 4, 7, 5]
    exact = exact_after_first(model, prompt, params, 3)
    target = ModelRunner(model)
    drafter_model = FeatureDraftModel(model).eval()

    def run(rule):
        drafter = FeatureDrafter(ModelRunner(drafter_model), target, v)
        out = generate(target, [prompt] * n, method="sd", drafter=drafter, rule=rule, policy=Constant(3),
                       sampling=params, max_new_tokens=4, seed=11)
        counts = counts_after_first(out.sequences, v, 3)
        return counts, out.batch_metrics

    counts, metrics = run(Lossless())
    assert n // 10 < metrics.accepted_tokens < metrics.drafted_tokens
    assert chi_square_pvalue(counts, exact) > 1e-4
    assert chi_square_pvalue(run(AcceptAll())[0], exact) < 1e-6


def test_a_cut_head_drafts_only_its_ids_and_stays_exact(tiny_target, trained):
    target = ModelRunner(tiny_target)
    cut = FeatureDraftModel(tiny_target, head_vocab=16, eos_ids=(63,)).eval()
    cut.load_state_dict(trained[0].state_dict())
    logits = cut(torch.tensor([[3, 4]]), features=torch.zeros(1, 2, 32), use_cache=False).logits
    assert torch.isinf(logits[0, :, 16:63]).all() and torch.isfinite(logits[0, :, :16]).all()
    assert torch.isfinite(logits[0, :, 63]).all()
    plain = generate(target, PROMPTS, method="ar", max_new_tokens=16)
    out = generate(target, PROMPTS, method="sd", drafter=FeatureDrafter(ModelRunner(cut), target, 64),
                   policy=Constant(3), max_new_tokens=16)
    assert out.sequences == plain.sequences


def test_save_and_load_round_trip(tiny_target, trained, tmp_path):
    model, report = trained
    meta = FeatureDrafterMeta(target_fingerprint=model_fingerprint(tiny_target), hidden_size=32,
                              intermediate_size=64, training={"texts": report["texts"]})
    model.save(tmp_path / "fd", meta)
    loaded, got = FeatureDraftModel.load(tmp_path / "fd", tiny_target)
    assert got.training == {"texts": report["texts"]}
    ids, feats = torch.tensor([[3, 4, 5]]), torch.randn(1, 3, 32)
    with torch.no_grad():
        a = model.to(torch.bfloat16).float()(ids, features=feats, use_cache=False).logits
        b = loaded.float()(ids, features=feats, use_cache=False).logits
    # the weights are saved in bf16; the cast of ``model`` also rounds its rotary buffer, which the
    # loaded model recomputes in fp32, hence a tolerance above fp32 rounding (a wrong load is off by O(1))
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)
    other = tiny_lm(seed=5)
    with pytest.raises(QuickdraftError, match="trained on another target"):
        FeatureDraftModel.load(tmp_path / "fd", other)
    with pytest.raises(QuickdraftError, match="holds no feature drafter"):
        FeatureDraftModel.load(tmp_path / "nothing", tiny_target)


def test_bad_uses_fail_clearly(tiny_target, trained):
    model = trained[0]
    with pytest.raises(QuickdraftError, match="without them"):
        model(torch.tensor([[1, 2]]), use_cache=False)

    class NotTorch:
        pass

    with pytest.raises(QuickdraftError, match="hidden states"):
        FeatureDrafter(ModelRunner(model), NotTorch(), 64)
    pipe = Pipeline(tiny_target, word_tokenizer())
    with pytest.raises(QuickdraftError, match="needs a feature drafter"):
        pipe.generate("w1 w2", method="sd", drafter="feature", max_new_tokens=4)
    pipe.feature_draft = ModelRunner(model)
    with pytest.raises(QuickdraftError, match="not method 'ngram_sd'"):
        pipe.drafter_for("ngram_sd", drafter="feature")
    with pytest.raises(QuickdraftError, match="unknown drafter"):
        pipe.drafter_for("sd", drafter="eagle")
    with pytest.raises(QuickdraftError, match="at least 2 texts"):
        train_feature_drafter(tiny_target, [[1, 2, 3]], FeatureTrainConfig(texts=2), progress=False)


def test_pipeline_drafts_with_features(tiny_target, trained):
    pipe = Pipeline(tiny_target, word_tokenizer())
    pipe.feature_draft = ModelRunner(trained[0])
    plain = pipe.generate("w1 w2 w3", method="ar", max_new_tokens=12, chat=False)
    for method in ("sd", "tree"):
        out = pipe.generate("w1 w2 w3", method=method, drafter="feature", max_new_tokens=12, chat=False)
        assert out.completions[0].token_ids == plain.completions[0].token_ids
        assert not pipe.target.record_hidden  # plain runs after it do not pay for the hidden states


@pytest.mark.parametrize("args, needle", [(["--texts", "1"], "texts must be at least 2"),
                                          (["--max-tokens", "4"], "max_tokens must be at least 8")])
def test_train_drafter_rejects_bad_options_before_loading(args, needle):
    from typer.testing import CliRunner

    from quickdraft.cli import app

    result = CliRunner().invoke(app, ["train-drafter", "--target", "/nonexistent/model/dir", *args])
    assert result.exit_code == 2 and needle in result.output, result.output
