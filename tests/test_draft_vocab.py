"""A draft vocabulary on the OpenVINO backend: the draft's head keeps a subset of the token ids.

The subset's ids and the scatter back into the full vocabulary; an export of a tiny draft whose
logits equal the torch model's on the subset and are ``-inf`` elsewhere; greedy speculative output
equal to plain greedy output; and the goodness-of-fit test of the lossless rule with a draft that
can propose only the subset, beside the realistic wrong implementation (verification restricted to
the subset) that must fail it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from quickdraft.backends.openvino import is_available

if not is_available():  # pragma: no cover - depends on the environment
    if os.environ.get("CI"):
        raise RuntimeError("CI must run the OpenVINO backend's tests: openvino/nncf are not importable")
    pytest.skip("openvino and nncf are not installed (pip install 'quickdraft[openvino]')", allow_module_level=True)

from quickdraft.backends.openvino import OpenVINORunner  # noqa: E402
from quickdraft.backends.openvino.export import EXPORT_MANIFEST, draft_vocab_ids, export, export_dir_name  # noqa: E402
from quickdraft.backends.openvino.runner import HeadLayout, _scatter_vocab  # noqa: E402
from quickdraft.decoding.drafters import ModelDrafter  # noqa: E402
from quickdraft.decoding.engine import generate  # noqa: E402
from quickdraft.errors import QuickdraftError  # noqa: E402

from conftest import runner_law_after_first  # noqa: E402
from quickdraft.decoding.policies import Constant  # noqa: E402
from quickdraft.verification.rules import Lossless  # noqa: E402
from quickdraft.backends.runner import ModelRunner  # noqa: E402
from quickdraft.verification.sampling import SamplingParams  # noqa: E402

SUBSET = 48  # of the tiny models' 64 ids


def _runner(path, name):
    return OpenVINORunner(path, name, n_threads=1, kv_cache_precision="f32", inference_precision="f32")


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_target, tiny_draft):
    """Float32 exports of the tiny target (full head) and draft (head over the ``SUBSET`` lowest ids)."""
    root = tmp_path_factory.mktemp("ov_vocab")
    for model, name in ((tiny_target, "target"), (tiny_draft, "draft")):
        model.config._attn_implementation = "sdpa"
        model.save_pretrained(root / f"{name}_hf")
    target = export(root / "target_hf", root / "target_ov", "none", progress=False)
    draft = export(root / "draft_hf", root / "draft_ov", "none", draft_vocab=SUBSET, progress=False)
    return target, draft


def test_draft_vocab_ids_are_the_lowest_ids_and_the_end_of_sequence_ids():
    assert draft_vocab_ids(4, 10, eos_ids=(9, 2, 9)) == [0, 1, 2, 3, 9]
    assert draft_vocab_ids(10, 10) == list(range(10))
    for bad in (0, -1, 11):
        with pytest.raises(QuickdraftError, match="draft vocabulary size"):
            draft_vocab_ids(bad, 10)
    assert export_dir_name("int4", draft_vocab=49152) == "openvino-int4-vocab49152"
    assert export_dir_name("int8") == "openvino-int8"
    with pytest.raises(QuickdraftError, match="engine layout"):
        export_dir_name("int8", "genai", 1000)


def test_scatter_puts_each_logit_at_its_id():
    inf = float("-inf")
    logits = torch.tensor([[[1.0, 2.0, 3.0]]])  # [B=1, n=1, V'=3]
    full = _scatter_vocab(logits, HeadLayout.of(torch.tensor([0, 1, 4]), 6), 6)
    assert full.tolist() == [[[1.0, 2.0, inf, inf, 3.0, inf]]]
    # no leading run, an id out of order, one outside the vocabulary (dropped with its row)
    four = torch.tensor([[[1.0, 2.0, 3.0, 4.0]], [[5.0, 6.0, 7.0, 8.0]]])  # [B=2, n=1, V'=4]
    full = _scatter_vocab(four, HeadLayout.of(torch.tensor([3, 9, 0, 5]), 6), 6)
    assert full.tolist() == [[[3.0, inf, inf, 1.0, inf, 4.0]], [[7.0, inf, inf, 5.0, inf, 8.0]]]
    # a head longer than the vocabulary keeps the ids inside it
    assert _scatter_vocab(four, HeadLayout.of(torch.arange(4), 3), 3).tolist() == [[[1.0, 2.0, 3.0]], [[5.0, 6.0, 7.0]]]
    with pytest.raises(QuickdraftError, match="3 rows"):
        _scatter_vocab(logits, HeadLayout.of(torch.tensor([0, 1]), 6), 6)


def test_export_keeps_the_subset_rows_of_the_head(exports, tiny_draft):
    info = json.loads((exports[1] / EXPORT_MANIFEST).read_text())
    assert info["draft_vocab"] == SUBSET
    draft = _runner(exports[1], "draft")
    assert draft.head_ids.tolist() == list(range(SUBSET)) + info["head_extra_ids"]
    reference = ModelRunner(tiny_draft, "draft")
    tokens = torch.tensor([[3, 9, 27, 50, 1]])
    for runner in (draft, reference):
        runner.reset(1)
    ours, theirs = draft.forward(tokens).logits, reference.forward(tokens).logits  # [1, 5, 64]
    kept = torch.zeros(64, dtype=torch.bool)
    kept[draft.head_ids] = True
    assert torch.allclose(ours[..., kept], theirs[..., kept], atol=1e-4)
    assert torch.isneginf(ours[..., ~kept]).all()


def test_greedy_speculative_equals_plain_greedy_with_a_draft_vocabulary(exports):
    target, draft = _runner(exports[0], "target"), _runner(exports[1], "draft")
    prompts = [[1, 5, 9, 2, 7], [3, 3, 3, 8], [11, 4, 6, 1, 2, 9, 30, 31]]
    plain = generate(target, prompts, method="ar", max_new_tokens=40, seed=0).sequences
    out = generate(target, prompts, method="sd", drafter=ModelDrafter(draft, 64), policy=Constant(4),
                   max_new_tokens=40, seed=0)
    assert out.sequences == plain
    assert out.batch_metrics.target_forwards < 3 * 40  # it did speculate
    # the target does emit tokens outside the draft's subset, so the test covers their recovery
    assert any(t >= SUBSET for seq in plain for t in seq)


def test_lossless_sampling_with_a_draft_vocabulary_matches_the_target(exports):
    """The two tokens after the prefill's first one, sampled by `sd` (lossless rule, T = 1) with the
    subset draft, against the target's exact law of new tokens 2 and 3. The control is the mistake a
    subset draft invites: verifying against the target restricted (renormalised) to the subset —
    its samples never hold the tokens outside it, and the same test must reject them."""
    from scipy import stats

    target, draft = _runner(exports[0], "target"), _runner(exports[1], "draft")
    prompt = [4, 17, 9]

    def two_token_probs(runner, keep=None):  # P(t2, t3), t1 marginalised out, [V * V]
        return runner_law_after_first(runner, prompt, keep=keep)

    exact = two_token_probs(target)
    outside = 1 - exact.view(64, 64)[:SUBSET, :SUBSET].sum()
    assert outside > 0.05  # the subset misses enough mass for the control to be visible
    n, prompts = 3000, [prompt] * 300
    counts = torch.zeros(64 * 64)
    for seed in range(n // len(prompts)):
        out = generate(target, prompts, method="sd", drafter=ModelDrafter(draft, 64), rule=Lossless(),
                       policy=Constant(3), sampling=SamplingParams(temperature=1.0), max_new_tokens=3, seed=seed)
        for seq in out.sequences:
            counts[seq[1] * 64 + seq[2]] += 1

    def pvalue(observed, probs):
        expected = probs * n
        big = expected >= 5  # cells expected below 5 are merged into one
        obs = torch.cat([observed[big], observed[~big].sum().unsqueeze(0)]).numpy()
        exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)]).numpy()
        return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue

    assert pvalue(counts, exact) > 1e-3
    keep = torch.zeros(64, dtype=torch.bool)
    keep[:SUBSET] = True
    wrong = two_token_probs(target, keep).double().numpy()
    rng = np.random.default_rng(0)
    control = np.bincount(rng.choice(64 * 64, size=n, p=wrong / wrong.sum()), minlength=64 * 64)
    assert pvalue(torch.from_numpy(control).float(), exact) < 1e-3


def test_a_draft_vocabulary_is_an_openvino_setting():
    from quickdraft.pipeline import Pipeline

    with pytest.raises(QuickdraftError, match="openvino backend"):
        Pipeline.from_specs("target", "draft", backend="torch", draft_vocab=1000)


def test_cli_rejects_a_draft_vocabulary_off_openvino():
    from typer.testing import CliRunner

    from quickdraft.cli import app

    result = CliRunner().invoke(app, ["generate", "hi", "--backend", "torch", "--draft-vocab", "1000"])
    assert result.exit_code != 0
    assert "openvino backend" in result.output
