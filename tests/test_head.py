"""The acceptance head: save/load, mismatch errors, training data construction, training, prompts."""

from __future__ import annotations

import math
import types

import pytest
import torch

from quickdraft.errors import QuickdraftError
from quickdraft.decoding.head import AcceptanceHead, HeadMetadata, load_head, model_fingerprint, save_head
from quickdraft.adaptive.headtrain import (
    Examples,
    TrainConfig,
    acceptance_labels,
    baseline_design,
    build_dataset,
    confidence_features,
    drawing_states,
    expected_new_tokens,
    fit_logistic,
    head_path_for,
    lockstep_batch,
    mix_tokens,
    predict_logistic,
    simulate_policies,
    specdecpp_lengths,
    split_groups,
    train_head,
    unweight,
    weighted_bce,
)
from quickdraft.decoding.engine import generate
from quickdraft.backends.runner import ModelRunner
from quickdraft.verification.sampling import SamplingParams
from quickdraft.adaptive.trainprompts import overlap_report, training_prompts

from conftest import TINY_VOCAB, tiny_lm, word_tokenizer


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


def _stats_head(seed: int = 0) -> AcceptanceHead:
    """A head with confidence inputs, its weights rounded to float16 (what a head file stores)."""
    torch.manual_seed(seed)
    head = AcceptanceHead(32, num_layers=1, num_stats=4)
    gen = torch.Generator().manual_seed(seed)
    head.set_normalisation(torch.randn(100, 32, generator=gen) * 3 + 1,
                           baseline_design(confidence_features(torch.softmax(torch.randn(100, 8, generator=gen), -1),
                                                               torch.randint(0, 8, (100,), generator=gen))))
    with torch.no_grad():
        head.stats_out.weight.copy_(torch.tensor([[1.5, -0.7, 0.4, 0.9]]))
        for name, param in head.named_parameters():
            if not name.startswith("stats_"):  # stats_out is stored in float32, the rest in float16
                param.copy_(param.half().float())
    return head.eval()


def test_stats_head_save_load_round_trip_is_exact(tmp_path):
    head = _stats_head()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 32, generator=gen)
    stats = baseline_design(confidence_features(torch.softmax(3 * torch.randn(6, 8, generator=gen), -1),
                                                torch.randint(0, 8, (6,), generator=gen)))
    path = save_head(head, tmp_path / "stats.pt")
    payload = torch.load(path, weights_only=True)
    assert payload["num_stats"] == 4 and payload["version"] == 1
    for key in ("stats_mean", "stats_std", "feature_mean", "stats_out.weight"):
        assert payload["state_dict"][key].dtype == torch.float32, key
    assert payload["state_dict"]["out.weight"].dtype == torch.float16
    loaded = load_head(path)
    assert loaded.num_stats == 4
    assert torch.equal(loaded.stats_mean, head.stats_mean) and torch.equal(loaded.stats_std, head.stats_std)
    assert torch.equal(loaded.accept_prob(x, stats), head.accept_prob(x, stats))
    # the confidence inputs really enter the prediction (the round trip above is not vacuous)
    assert not torch.allclose(loaded.accept_prob(x, stats), loaded.accept_prob(x, stats.flip(0)), atol=1e-3)


def test_shared_block_head_is_one_block_applied_l_times_and_round_trips(tmp_path):
    """The paper's head (its code's ``[ResBlock(H)] * L``): one residual block applied L times, its
    logit ``w^T f^L(z) + c`` with ``f(z) = z + SiLU(W z + b)``, with a third of the block weights of
    a head with a block per layer; saved and loaded exactly; ``train-head``'s default (L = 3)."""
    torch.manual_seed(0)
    head = AcceptanceHead(16, 3, HeadMetadata(draft="draft"), shared_blocks=True)
    own = AcceptanceHead(16, 3)
    assert sum(p.numel() for p in head.parameters()) == 16 * 16 + 16 + 16 + 1
    assert sum(p.numel() for p in own.parameters()) == 3 * (16 * 16 + 16) + 16 + 1
    h = torch.randn(5, 16)
    z = (h - head.feature_mean) / head.feature_std
    for _ in range(3):
        z = z + torch.nn.functional.silu(z @ head.block.linear.weight.T + head.block.linear.bias)
    expected = (z @ head.out.weight.T).squeeze(-1) + head.out.bias
    assert torch.allclose(head(h), expected, atol=1e-6)
    with torch.no_grad():  # float16 weights on disk: the loaded head is that head, exactly
        for p in head.parameters():
            p.copy_(p.half().float())
    loaded = load_head(save_head(head, tmp_path / "shared.pt"))
    assert loaded.shared_blocks and loaded.num_layers == 3 and torch.equal(loaded(h), head(h))
    assert not AcceptanceHead(16, 0, shared_blocks=True).shared_blocks  # no layer: nothing to share
    assert TrainConfig().num_layers == 3 and TrainConfig().shared_blocks and not TrainConfig().confidence_inputs


def test_stats_head_needs_its_confidence_inputs():
    head = _stats_head()
    x = torch.zeros(2, 32)
    with pytest.raises(QuickdraftError, match="num_stats = 4"):
        head.accept_prob(x)
    with pytest.raises(QuickdraftError, match="num_stats = 4"):
        head(x)
    with pytest.raises(QuickdraftError, match=r"need \[\.\.\., 4\]"):
        head.accept_prob(x, torch.zeros(2, 3))
    with pytest.raises(QuickdraftError, match="leading shape"):
        head.accept_prob(x, torch.zeros(3, 4))
    with pytest.raises(QuickdraftError, match="no confidence inputs"):
        AcceptanceHead(32, 1).accept_prob(x, torch.zeros(2, 4))
    assert head.accept_prob(x, torch.zeros(2, 4)).shape == (2,)


def test_heads_saved_before_confidence_inputs_still_load(tmp_path):
    """A head file written before ``num_stats`` existed (no such key) loads as a hidden-state-only
    head with the same outputs; the committed heads load and give probabilities."""
    from pathlib import Path

    old = AcceptanceHead(32, 1)
    path = save_head(old, tmp_path / "old.pt")
    payload = torch.load(path, map_location="cpu", weights_only=True)
    payload.pop("num_stats", None)
    torch.save(payload, path)
    loaded = load_head(path)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    assert loaded.num_stats == 0
    torch.testing.assert_close(loaded.accept_prob(x), old.half().float().accept_prob(x), atol=2e-3, rtol=0)

    for committed in sorted((Path(__file__).resolve().parents[1] / "models" / "heads").glob("*.pt")):
        head = load_head(committed)
        stats = torch.zeros(2, head.num_stats) if head.num_stats else None
        prob = head.accept_prob(torch.zeros(2, head.hidden_size), stats)
        assert prob.shape == (2,) and bool(((prob > 0) & (prob < 1)).all())

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
    cfg = TrainConfig(num_layers=1, epochs=30, batch_size=256, lr=3e-3, reject_weight=2.0, holdout=0.2)
    head, report = train_head(ex, cfg, log=lambda m: None)
    hist = report["history"]
    assert hist[-1]["train_loss"] < 0.9 * hist[0]["train_loss"]
    assert min(r["heldout_loss"] for r in hist) < hist[0]["heldout_loss"]
    assert report["brier_unweighted"] < 0.75 * report["brier_constant_baseline"]
    assert report["brier_base_rate"] <= report["brier_constant_baseline"] + 1e-9  # the best constant
    assert report["heldout_positions"] + report["validation_positions"] + report["train_positions"] == n


def test_confidence_inputs_let_the_head_learn_what_the_hidden_state_does_not_know():
    """Labels that depend only on the draft's confidence, hidden states that are pure noise: the head
    with confidence inputs beats the hidden-state-only head by far on the test prompts."""
    gen = torch.Generator().manual_seed(0)
    n, h = 3000, 16
    x = torch.randn(n, h, generator=gen)  # no information
    top = torch.rand(n, generator=gen) * 0.9 + 0.1
    chosen = top * (torch.rand(n, generator=gen) < 0.8)  + 0.05 * top  # mostly the top token
    stats = torch.stack([top, -(top * top.log()) - (1 - top) * (1 - top).clamp_min(1e-6).log(), chosen], dim=1)
    labels = torch.sigmoid(8 * (top - 0.55)) * (chosen > 0.5 * top)
    ex = Examples(features=x.to(torch.bfloat16), labels=labels, loss_mask=torch.ones(n, dtype=torch.bool),
                  groups=torch.arange(n) // 30, data_hash="synthetic", draft_stats=stats)
    reports = {}
    for flag in (True, False):
        cfg = TrainConfig(num_layers=1, epochs=6, batch_size=256, lr=3e-3, reject_weight=2.0, confidence_inputs=flag)
        head, reports[flag] = train_head(ex, cfg, log=lambda m: None, draft_cost=0.3, thresholds=(0.5,))
        assert head.num_stats == (4 if flag else 0) and reports[flag]["confidence_inputs"] is flag
        assert "specdecpp_h0.5" in reports[flag]["simulated_tokens_per_target_time"]
    with_stats, without = reports[True]["brier_unweighted"], reports[False]["brier_unweighted"]
    assert without > 0.8 * reports[False]["brier_base_rate"]  # noise features: no better than a constant
    assert with_stats < 0.5 * without
    assert with_stats <= reports[True]["brier_logistic_baseline"] + 0.01  # at least as good as the baseline
    # no draft statistics in the data: the flag is ignored and the head reads the hidden state only
    no_stats = Examples(features=ex.features, labels=labels, loss_mask=ex.loss_mask, groups=ex.groups, data_hash="x")
    head, report = train_head(no_stats, TrainConfig(epochs=1), log=lambda m: None)
    assert head.num_stats == 0 and report["confidence_inputs"] is False


def test_split_groups_separates_validation_and_test_prompts():
    groups = torch.arange(100).repeat_interleave(7)
    val, test = split_groups(groups, 0.2, seed=0)
    assert not (val & test).any()
    assert groups[val].unique().numel() == 10 and groups[test].unique().numel() == 10
    # whole prompts: a prompt is never split between sets
    for g in groups.unique():
        sel = groups == g
        assert val[sel].all() or not val[sel].any()
    assert torch.equal(split_groups(groups, 0.2, seed=0)[1], test) and not torch.equal(split_groups(groups, 0.2, seed=1)[1], test)
    with pytest.raises(QuickdraftError, match="too few prompts"):
        split_groups(torch.tensor([0, 0, 1]), 0.9, seed=0)


def test_confidence_features_and_logistic_baseline():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.5, 0.0]])
    feats = confidence_features(probs, torch.tensor([1, 0]))
    assert feats[:, 0].tolist() == pytest.approx([0.7, 0.5])
    assert feats[:, 1].tolist() == pytest.approx([-(0.7 * math.log(0.7) + 0.2 * math.log(0.2) + 0.1 * math.log(0.1)),
                                                   math.log(2)], abs=1e-6)
    assert feats[:, 2].tolist() == pytest.approx([0.2, 0.5])
    # acceptance that rises with the draft's top probability: the baseline finds it
    gen = torch.Generator().manual_seed(0)
    top = torch.rand(4000, generator=gen) * 0.9 + 0.1
    stats = torch.stack([top, -top.log(), top], dim=1)
    labels = torch.sigmoid(6 * (top - 0.5))
    weights, pred = fit_logistic(baseline_design(stats), labels)
    assert torch.allclose(pred, predict_logistic(weights, baseline_design(stats)))
    assert ((pred - labels) ** 2).mean() < 0.1 * labels.var()


def test_head_path_for_several_temperatures():
    assert str(head_path_for("m/h.pt", 0.0, False)) == "m/h.pt"
    assert [str(head_path_for("m/h.pt", t, True)) for t in (0.0, 0.7)] == ["m/h-t0.pt", "m/h-t0.7.pt"]


def _tiny_pipe(tiny_target, tiny_draft):
    return types.SimpleNamespace(target=ModelRunner(tiny_target), draft=ModelRunner(tiny_draft), vocab_size=TINY_VOCAB)


def test_lockstep_labels_and_features_equal_fresh_forwards(tiny_target, tiny_draft):
    """Batched (left-padded) lockstep decoding gives, row by row, the target's greedy response, the
    exact labels of fresh forwards over prompt + response, and the draft's hidden states of a fresh
    forward over prompt + mixed tokens."""
    pipe = _tiny_pipe(tiny_target, tiny_draft)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    cfg = TrainConfig(max_new_tokens=9, response_temperature=0.0, mix_ratio=0.3)
    data = lockstep_batch(pipe, prompts, cfg, (0.0, 1.0), seed=3)
    plain = generate(ModelRunner(tiny_target), prompts, method="ar", sampling=SamplingParams(temperature=0.0),
                     max_new_tokens=9)
    assert data["responses"] == plain.sequences
    assert data["rows"].tolist() == [0] * 9 + [1] * 9 + [2] * 9
    for t, d in data["by_temperature"].items():
        assert d["features"].shape == (27, 32) and d["labels"].shape == (27,)
        for row, (prompt, resp) in enumerate(zip(prompts, data["responses"])):
            sel = data["rows"] == row
            with torch.no_grad():
                seq = torch.tensor([prompt + resp])
                p_logits = tiny_target(seq).logits[0, len(prompt) - 1:-1]  # [n, V] given X_<j
                q_logits = tiny_draft(seq).logits[0, len(prompt) - 1:-1]
                fresh = tiny_draft(torch.tensor([prompt + d["mixed_ids"][sel].tolist()]),
                                   output_hidden_states=True).hidden_states[-1][0, len(prompt):]
            y = d["draft_ids"][sel]
            if t == 0.0:
                assert torch.equal(y, q_logits.argmax(-1))
                assert d["labels"][sel].tolist() == (y == p_logits.argmax(-1)).float().tolist()
            else:
                p = p_logits.softmax(-1).gather(1, y[:, None]).squeeze(1)
                q = q_logits.softmax(-1).gather(1, y[:, None]).squeeze(1)
                assert torch.allclose(d["labels"][sel], (p / q).clamp_max(1.0), atol=1e-5)
            assert torch.allclose(d["features"][sel].float(), fresh.to(torch.bfloat16).float(), atol=2e-2)
            kept = ~d["loss_mask"][sel]  # the target's token is the context there
            assert torch.equal(d["mixed_ids"][sel][kept], torch.tensor(resp)[kept])
            assert torch.equal(d["mixed_ids"][sel][~kept], y[~kept])
        assert 0 < int((~d["loss_mask"]).sum()) < 27


def test_drawing_states_are_the_states_that_drew_the_lockstep_draft_tokens(tiny_target, tiny_draft):
    """The draft's output layer on :func:`drawing_states` gives back the distributions the lockstep
    draft tokens were drawn from (their confidence features as recorded), position by position; the
    states one position later (the fed states) do not."""
    pipe = _tiny_pipe(tiny_target, tiny_draft)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    cfg = TrainConfig(max_new_tokens=9, response_temperature=1.0)
    data = lockstep_batch(pipe, prompts, cfg, (1.0,), seed=5)
    d = data["by_temperature"][1.0]
    states = drawing_states(pipe.draft, prompts, data["responses"])
    assert states.shape == (27, 32) and states.dtype == torch.bfloat16

    def stats_of(h):
        with torch.no_grad():
            probs = tiny_draft.lm_head(h.float()).softmax(-1)
        return confidence_features(probs, d["draft_ids"])

    assert torch.allclose(stats_of(states), d["draft_stats"], atol=3e-2)
    shifted = torch.cat([states[1:], states[-1:]])
    assert not torch.allclose(stats_of(shifted), d["draft_stats"], atol=3e-2)


def test_a_drawing_state_head_trains_saves_and_loads(tmp_path):
    """``reads="drawing"`` trains on the drawing features at every position (loss mask ignored) and
    the file keeps what the head reads; the fed-state head trains on the masked positions."""
    gen = torch.Generator().manual_seed(0)
    n = 2400
    drawing = torch.randn(n, 16, generator=gen)
    labels = torch.sigmoid(3 * drawing[:, 0])  # acceptance lives in the drawing state
    ex = Examples(features=torch.randn(n, 16, generator=gen), labels=labels,
                  loss_mask=torch.rand(n, generator=gen) > 0.5, groups=torch.arange(n) // 40, data_hash="x",
                  draft_stats=torch.rand(n, 3, generator=gen), temperature=0.0, drawing_features=drawing)
    cfg = TrainConfig(num_layers=1, epochs=30, lr=3e-3, reject_weight=2.0, reads="drawing", holdout=0.3)
    head, report = train_head(ex, cfg, log=lambda m: None)
    assert head.reads == "drawing" and report["reads"] == "drawing"
    assert report["train_positions"] + report["validation_positions"] + report["heldout_positions"] == n
    assert report["brier_unweighted"] < 0.8 * report["brier_constant_baseline"]
    loaded = load_head(save_head(head, tmp_path / "d.pt"))
    assert loaded.reads == "drawing"
    fed, fed_report = train_head(ex, TrainConfig(num_layers=1, epochs=2, holdout=0.3), log=lambda m: None)
    assert fed.reads == "fed" and fed_report["train_positions"] < int(ex.loss_mask.sum())
    no_drawing = Examples(ex.features, ex.labels, ex.loss_mask, ex.groups, "x")
    with pytest.raises(QuickdraftError, match="drawing_features"):
        train_head(no_drawing, cfg, log=lambda m: None)
    with pytest.raises(QuickdraftError, match="reads must be one of"):
        TrainConfig(reads="next")


def test_lockstep_rows_stop_after_eos(tiny_target, tiny_draft):
    pipe = _tiny_pipe(tiny_target, tiny_draft)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    cfg = TrainConfig(max_new_tokens=8, response_temperature=0.0, mix_ratio=0.0)
    full = lockstep_batch(pipe, prompts, cfg, (0.0,), seed=0)["responses"]
    eos = full[0][2]  # row 0 stops at its third token
    data = lockstep_batch(pipe, prompts, cfg, (0.0,), seed=0, eos_ids={eos})
    assert data["responses"][0] == full[0][:3]
    cut = full[1].index(eos) + 1 if eos in full[1] else 8
    assert data["responses"][1] == full[1][:cut]
    assert len(data["rows"]) == 3 + cut == len(data["by_temperature"][0.0]["labels"])


def test_build_dataset_groups_cache_and_resume(tmp_path, tiny_target, tiny_draft):
    pipe = _tiny_pipe(tiny_target, tiny_draft)
    prompts = [[1, 2], [3, 4, 5], [6], [7, 8, 9, 10], [11, 12, 13]]
    cfg = TrainConfig(max_new_tokens=6, gen_batch=2, mix_ratio=0.15)
    quiet = lambda m: None  # noqa: E731
    # a spent time budget starts no batch: nothing to train on yet
    with pytest.raises(QuickdraftError, match="no training data"):
        build_dataset(pipe, prompts, cfg, (0.0, 0.7), tmp_path, time_budget=1e-9, log=quiet)
    ex = build_dataset(pipe, prompts, cfg, (0.0, 0.7), tmp_path, log=quiet)
    assert len(list(tmp_path.glob("lockstep-*.pt"))) == 3
    # cached batches are used whatever the budget
    cached = build_dataset(pipe, prompts, cfg, (0.0, 0.7), tmp_path, time_budget=1e-9, log=quiet)
    assert cached[0.0].data_hash == ex[0.0].data_hash
    for t in (0.0, 0.7):
        assert sorted(set(ex[t].groups.tolist())) == [0, 1, 2, 3, 4]
        assert torch.bincount(ex[t].groups).tolist() == [6] * 5  # no EOS: 6 positions per prompt
        assert ex[t].draft_stats.shape == (30, 3) and ex[t].temperature == t
    assert ex[0.0].data_hash != ex[0.7].data_hash
    # a head on the drawing state: the states are computed once and added to the cached batches
    drawing_cfg = TrainConfig(max_new_tokens=6, gen_batch=2, mix_ratio=0.15, reads="drawing")
    drawn = build_dataset(pipe, prompts, drawing_cfg, (0.0, 0.7), tmp_path, time_budget=1e-9, log=quiet)
    assert drawn[0.0].drawing_features.shape == (30, 32) and drawn[0.0].data_hash == ex[0.0].data_hash
    assert all("drawing_features" in torch.load(f, weights_only=True) for f in tmp_path.glob("lockstep-*.pt"))
    assert ex[0.0].drawing_features is None
    again = build_dataset(pipe, prompts, cfg, (0.0, 0.7), tmp_path, log=quiet)  # all from the cache
    assert again[0.7].data_hash == ex[0.7].data_hash and torch.equal(again[0.7].features, ex[0.7].features)
    fresh = build_dataset(pipe, prompts, cfg, (0.0, 0.7), None, log=quiet)  # no cache: same data
    assert fresh[0.7].data_hash == ex[0.7].data_hash
    other = build_dataset(pipe, prompts, TrainConfig(max_new_tokens=6, gen_batch=2, seed=1), (0.7,), None, log=quiet)
    assert other[0.7].data_hash != ex[0.7].data_hash


def test_training_prompts_are_deterministic_and_do_not_overlap_the_benchmarks():
    prompts = training_prompts(200, seed=0)
    assert prompts == training_prompts(200, seed=0) and len(set(prompts)) == 200
    assert any(p.startswith("Implement") for p in prompts) and any(p.startswith("Explain") for p in prompts)
    try:
        from quickdraft.evaluation.datasets import load_humaneval_problems, load_mtbench

        problems, mtbench = load_humaneval_problems(), load_mtbench()
    except QuickdraftError:
        pytest.skip("benchmark packages not installed")
    texts = [p["prompt"] for p in problems] + [t for q in mtbench for t in q.metadata["turns"]]
    from quickdraft.adaptive.trainprompts import all_tasks

    assert overlap_report(all_tasks(), texts, [p["entry_point"] for p in problems]) == []
    # the check has teeth: a HumanEval prompt itself is reported
    assert overlap_report([problems[0]["prompt"]], texts, []) != []


def test_offline_policy_estimate():
    # constant acceptance a: a step of K tokens yields 1 + a + ... + a^K for K c + 1 (end effects aside)
    a, c, n = 0.8, 0.4, 5000
    sim = simulate_policies(torch.full((n,), a), torch.full((n,), a), torch.zeros(n, dtype=torch.long), c,
                            fixed_k=(1, 3), thresholds=())
    for k in (1, 3):
        assert sim[f"fixed_k{k}"] == pytest.approx(sum(a ** i for i in range(k + 1)) / (k * c + 1), rel=1e-2)
    # two regimes (easy stretches, hard stretches): a head that knows them beats every fixed K
    labels = torch.cat([torch.ones(40), torch.full((40,), 0.1)]).repeat(20)
    groups = torch.arange(labels.numel()) // 400
    sim = simulate_policies(labels, labels, groups, 0.3, thresholds=(0.5,))
    best_fixed = max(v for k, v in sim.items() if k.startswith("fixed"))
    assert sim["specdecpp_h0.5"] > 1.2 * best_fixed
    assert specdecpp_lengths(torch.tensor([0.9, 0.9]), 0.5, 1).tolist() == [1, 1]
    # a drawing-state head stops after one token where the draft is unsure; the fed state's cannot
    # (positions past the end predict 0: from the last start the second token is already at risk)
    assert specdecpp_lengths(torch.tensor([0.1, 0.9]), 0.5, 10, reads="drawing").tolist() == [1, 2]
    assert specdecpp_lengths(torch.tensor([0.1, 0.9]), 0.5, 10).tolist() == [2, 3]
    assert expected_new_tokens(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([5, 1, 1])).tolist() == [4.0, 2.0, 2.0]


def test_train_head_command_end_to_end_and_head_mismatch(tmp_path, monkeypatch, tiny_target, tiny_draft):
    """``quickdraft train-head`` on the tiny pair (Pipeline.from_specs patched): one head per
    temperature at ``<stem>-t<T>.pt`` with its report; the head then drives ``generate --policy
    specdecpp`` (greedy output = plain decoding), and a head for another draft is refused."""
    import json

    from typer.testing import CliRunner

    from quickdraft.adaptive import headtrain
    from quickdraft.cli import app
    from quickdraft.pipeline import Pipeline

    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    monkeypatch.setattr(Pipeline, "from_specs", classmethod(lambda cls, *args, **kwargs: pipe))
    monkeypatch.setattr(headtrain, "specdecpp_cache_dir", lambda: tmp_path / "cache")
    words = [" ".join(f"w{(7 * i + j) % 60 + 1}" for j in range(3 + i % 4)) for i in range(10)]
    monkeypatch.setattr("quickdraft.adaptive.trainprompts.training_prompts", lambda n, seed=0: words[:n])
    runner = CliRunner()
    out = tmp_path / "heads" / "h.pt"
    result = runner.invoke(app, ["train-head", "--out", str(out), "--num-prompts", "10", "--max-new-tokens", "6",
                                 "--gen-batch", "5", "--epochs", "2", "--temperature", "0", "--temperature", "0.7",
                                 "--report", str(tmp_path / "report.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == {"T=0", "T=0.7", "total_seconds"}
    assert len(list((tmp_path / "cache").glob("lockstep-*.pt"))) == 2  # two batches cached
    for t, name in ((0.0, "h-t0.pt"), (0.7, "h-t0.7.pt")):
        head = load_head(tmp_path / "heads" / name)
        assert head.metadata.temperature == t and head.metadata.draft_fingerprint == model_fingerprint(tiny_draft)
        assert head.metadata.data_hash == report[f"T={t:g}"]["data_hash"]
        assert report[f"T={t:g}"]["prompts_used"] == 10
    assert not out.exists()  # several temperatures: only the -t<T> files

    common = ["generate", "w1 w2 w3", "--no-chat", "--temperature", "0", "--max-new-tokens", "12", "--json"]
    plain = runner.invoke(app, common + ["--method", "ar"])
    adaptive = runner.invoke(app, common + ["--method", "sd", "--policy", "specdecpp", "--k", "5",
                                            "--head", str(tmp_path / "heads" / "h-t0.pt"), "--stop-threshold", "0.5"])
    assert plain.exit_code == 0 and adaptive.exit_code == 0, adaptive.output
    text = lambda r: json.loads(r.output[r.output.index("{"):])["text"]  # noqa: E731
    assert text(adaptive) == text(plain)
    alien = save_head(AcceptanceHead(32, 1, HeadMetadata(draft="other", draft_fingerprint=model_fingerprint(tiny_lm(seed=9)))),
                      tmp_path / "alien.pt")
    refused = runner.invoke(app, common + ["--method", "sd", "--policy", "specdecpp", "--head", str(alien)])
    assert refused.exit_code == 2 and "acceptance head mismatch" in refused.output
