"""The acceptance head: save/load, mismatch errors, training data construction, training, prompts."""

from __future__ import annotations

import types

import pytest
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.head import AcceptanceHead, HeadMetadata, load_head, model_fingerprint, save_head
from quickdraft.headtrain import (
    Examples,
    TrainConfig,
    acceptance_labels,
    build_examples,
    mix_tokens,
    train_head,
    unweight,
    weighted_bce,
)
from quickdraft.runner import ModelRunner
from quickdraft.trainprompts import overlap_report, training_prompts

from conftest import TINY_VOCAB, tiny_lm


def test_save_load_round_trip_and_metadata(tmp_path, tiny_draft):
    torch.manual_seed(0)
    meta = HeadMetadata(draft="qwen2.5-coder-0.5b-instruct", target="qwen2.5-coder-1.5b-instruct",
                        draft_fingerprint=model_fingerprint(tiny_draft), data_hash="abc", temperature=0.7,
                        extra={"brier_raw": 0.1})
    head = AcceptanceHead(32, num_layers=2, metadata=meta)
    head.set_normalisation(torch.randn(100, 32) * 3 + 1)
    x = torch.randn(5, 32)
    path = save_head(head, tmp_path / "head.pt")
    loaded = load_head(path)
    assert loaded.num_layers == 2 and loaded.hidden_size == 32
    assert loaded.metadata == meta
    assert torch.allclose(loaded.accept_prob(x), head.accept_prob(x), atol=2e-3)  # float16 weights
    again = load_head(save_head(loaded, tmp_path / "again.pt"))
    assert torch.equal(again.accept_prob(x), loaded.accept_prob(x))  # a second round trip is exact
    assert len(set(id(b.linear.weight) for b in loaded.blocks)) == 2  # layers have their own weights
    assert path.stat().st_size < 50_000


def test_mismatched_draft_and_bad_files_give_clear_errors(tmp_path, tiny_draft):
    head = AcceptanceHead(32, 1, HeadMetadata(draft="qwen2.5-coder-0.5b-instruct",
                                              draft_fingerprint=model_fingerprint(tiny_draft)))
    path = save_head(head, tmp_path / "head.pt")
    assert load_head(path, draft_name="draft").metadata.draft == "qwen2.5-coder-0.5b-instruct"  # alias
    with pytest.raises(QuickdraftError, match="trained for draft 'qwen2.5-coder-0.5b-instruct', not 'other-model'"):
        load_head(path, draft_name="other-model")
    head.check_draft(tiny_draft)  # the right model passes
    with pytest.raises(QuickdraftError, match="weights of .* differ"):
        head.check_draft(tiny_lm(seed=42))
    with pytest.raises(QuickdraftError, match="hidden size 32"):
        head.accept_prob(torch.zeros(1, 64))
    with pytest.raises(QuickdraftError, match="not found"):
        load_head(tmp_path / "missing.pt")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a head")
    with pytest.raises(QuickdraftError, match="not a quickdraft acceptance head"):
        load_head(junk)
    torch.save({"format": "something-else"}, tmp_path / "other.pt")
    with pytest.raises(QuickdraftError, match="not a quickdraft acceptance head"):
        load_head(tmp_path / "other.pt")


def test_fingerprint_ignores_dtype_but_not_weights(tiny_draft):
    assert model_fingerprint(tiny_draft) == model_fingerprint(tiny_draft.to(torch.bfloat16).float())
    assert model_fingerprint(tiny_draft) != model_fingerprint(tiny_lm(seed=5))


def test_acceptance_labels_are_min_one_p_over_q():
    target = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    draft = torch.tensor([[0.35, 0.6, 0.05], [0.5, 0.25, 0.25]])
    ids, labels = acceptance_labels(target, draft, torch.Generator().manual_seed(0), greedy=True)
    assert ids.tolist() == [1, 0] and labels.tolist() == pytest.approx([0.2 / 0.6, 0.1 / 0.5])
    gen = torch.Generator().manual_seed(1)
    ids, labels = acceptance_labels(target.repeat(500, 1), draft.repeat(500, 1), gen)
    expected = (target.repeat(500, 1).gather(1, ids[:, None]) / draft.repeat(500, 1).gather(1, ids[:, None])).clamp_max(1)
    assert torch.allclose(labels, expected.squeeze(1))
    # the mean label estimates the acceptance rate sum_x min(p, q): 0.35+0.2+0.05 = 0.6 and 0.1+0.1+0.25 = 0.45
    assert labels[0::2].mean().item() == pytest.approx(0.6, abs=0.05)
    assert labels[1::2].mean().item() == pytest.approx(0.45, abs=0.05)


def test_mix_tokens_keeps_target_tokens_at_the_given_share():
    gen = torch.Generator().manual_seed(0)
    target, draft = torch.zeros(20_000, dtype=torch.long), torch.ones(20_000, dtype=torch.long)
    mixed, mask = mix_tokens(target, draft, 0.15, gen)
    assert torch.equal(mask, mixed == 1)  # loss exactly where the draft token is the context
    assert (mixed == 0).float().mean().item() == pytest.approx(0.15, abs=0.01)


def test_weighted_bce_minimiser_is_the_weighted_probability():
    a, w = 0.7, 6.0
    logit = torch.zeros(1, requires_grad=True)
    opt = torch.optim.LBFGS([logit], max_iter=100)

    def closure():
        opt.zero_grad()
        loss = weighted_bce(logit, torch.tensor([a]), w)
        loss.backward()
        return loss

    opt.step(closure)
    pred = torch.sigmoid(logit).item()
    assert pred == pytest.approx(a / (a + w * (1 - a)), abs=1e-4)
    assert unweight(torch.tensor(pred), w).item() == pytest.approx(a, abs=1e-4)


def test_training_loss_falls_on_a_synthetic_task():
    gen = torch.Generator().manual_seed(0)
    n, h = 2000, 16
    x = torch.randn(n, h, generator=gen)
    labels = torch.sigmoid(2.0 * x[:, 0] - 1.5 * x[:, 1])  # acceptance depends on two directions
    ex = Examples(features=x.to(torch.bfloat16), labels=labels, loss_mask=torch.ones(n, dtype=torch.bool),
                  groups=torch.arange(n) // 30, data_hash="synthetic")
    cfg = TrainConfig(num_layers=1, epochs=8, batch_size=256, lr=3e-3, reject_weight=2.0, holdout=0.2)
    head, report = train_head(ex, cfg, log=lambda m: None)
    hist = report["history"]
    assert hist[-1]["train_loss"] < 0.9 * hist[0]["train_loss"]
    assert min(r["heldout_loss"] for r in hist) < hist[0]["heldout_loss"]
    assert report["brier_unweighted"] < 0.75 * report["brier_constant_baseline"]


def test_build_examples_on_tiny_models(tiny_target, tiny_draft):
    pipe = types.SimpleNamespace(target=ModelRunner(tiny_target), draft=ModelRunner(tiny_draft), vocab_size=TINY_VOCAB)
    prompts = [[1, 2, 3], [4, 5]]
    responses = [[7, 8, 9, 10, 11], [12, 13, 14]]
    cfg = TrainConfig(mix_ratio=0.3, temperature=1.0)
    ex = build_examples(pipe, prompts, responses, cfg, log=lambda m: None)
    assert ex.features.shape == (8, 32) and ex.labels.shape == (8,)
    assert ex.groups.tolist() == [0] * 5 + [1] * 3
    assert ((ex.labels >= 0) & (ex.labels <= 1)).all()
    # the same seed gives the same data (and hash); another seed draws other draft tokens
    assert build_examples(pipe, prompts, responses, TrainConfig(seed=1), log=lambda m: None).data_hash != ex.data_hash
    again = build_examples(pipe, prompts, responses, cfg, log=lambda m: None)
    assert again.data_hash == ex.data_hash and torch.equal(again.labels, ex.labels)


def test_training_prompts_are_deterministic_and_do_not_overlap_the_benchmarks():
    prompts = training_prompts(200, seed=0)
    assert prompts == training_prompts(200, seed=0) and len(set(prompts)) == 200
    assert any(p.startswith("Implement") for p in prompts) and any(p.startswith("Explain") for p in prompts)
    try:
        from quickdraft.datasets import load_humaneval_problems, load_mtbench

        problems, mtbench = load_humaneval_problems(), load_mtbench()
    except QuickdraftError:
        pytest.skip("benchmark packages not installed")
    texts = [p["prompt"] for p in problems] + [t for q in mtbench for t in q.metadata["turns"]]
    from quickdraft.trainprompts import all_tasks

    assert overlap_report(all_tasks(), texts, [p["entry_point"] for p in problems]) == []
    # the check has teeth: a HumanEval prompt itself is reported
    assert overlap_report([problems[0]["prompt"]], texts, []) != []
