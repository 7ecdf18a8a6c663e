"""The benchmark harness end to end on tiny models: entries and configs, results schema, resume after
an interruption, interleaving order, quality (sandbox) and fidelity fields."""

from __future__ import annotations

import json

import pytest
import torch

from quickdraft.evaluation.bench import (
    prompt_seed,
    BenchConfig,
    Entry,
    cell_path,
    expand_sweep,
    load_config_file,
    load_records,
    parse_entries,
    parse_entry,
    run_bench,
    schedule,
    target_fidelity,
)
from quickdraft.evaluation.datasets import Prompt
from quickdraft.errors import QuickdraftError
from quickdraft.pipeline import Pipeline
from quickdraft.evaluation.sandbox import isolation_mode

from conftest import TINY_VOCAB, RecodedPipe, word_tokenizer


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pipe(tiny_target, tiny_draft):
    return Pipeline(tiny_target, word_tokenizer(), tiny_draft)


def _prompts(n: int) -> list[Prompt]:
    """HumanEval-shaped prompts with the stub ``def f(): pass``. The tiny model's words never parse
    as Python, so the extraction falls back to the stub (returns None): odd problems' tests accept
    that and must *pass*, even ones must *fail* — both sandbox outcomes are exercised."""
    out = []
    for i in range(n):
        test = "def check(f):\n    assert f() is None\n" if i % 2 else "def check(f):\n    assert f() == 1\n"
        out.append(Prompt(
            id=f"Tiny/{i}", dataset="humaneval", messages=({"role": "user", "content": "x"},),
            raw=f"# problem {i}\ndef f():\n    pass\n", metadata={"entry_point": "f", "test": test, "canonical_solution": ""},
        ))
    return out


def _raw_ids_pipe(pipe) -> RecodedPipe:
    """The tiny pipeline with prompts encoding to word ids, whatever their raw text."""
    return RecodedPipe(pipe, lambda prompt: [1 + (sum(map(ord, prompt)) + i) % 50 for i in range(5)])


# ------------------------------------------------------------------------------------------------
# entries, sweeps, configs, schedule
# ------------------------------------------------------------------------------------------------
def test_entries_parse_to_canonical_labels():
    assert parse_entry("fsd:threshold=0.4,divergence=js").label == "fsd:divergence=js,threshold=0.4"
    assert parse_entry("sd:k=6").params == (("k", 6),)
    assert parse_entry("fsd:hybrid=true").params == (("hybrid", True),)
    labels = [e.label for e in parse_entries("ar,sd:k=6,fsd:divergence=js,threshold=0.4,typical")]
    assert labels == ["ar", "sd:k=6", "fsd:divergence=js,threshold=0.4", "typical"]
    assert parse_entry("hf-prompt-lookup:k=3").is_anchor


@pytest.mark.parametrize("text, message", [
    ("nope", "unknown method"),
    ("sd:kk=3", "unknown parameter 'kk'"),
    ("sd:k=x", "must be an integer"),
    ("fsd:hybrid=maybe", "true or false"),
    ("sd:k", "write key=value"),
    ("hf-ar:k=3", "unknown parameter"),
])
def test_bad_entries_name_the_problem(text, message):
    with pytest.raises(QuickdraftError, match=message):
        parse_entry(text)


def test_sweep_is_a_cartesian_product_and_config_file_expands(tmp_path):
    entries = expand_sweep({"method": "fsd", "divergence": ["js", "kl"], "threshold": [0.2, 0.4], "hybrid": False})
    assert len(entries) == 4 and len({e.label for e in entries}) == 4
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'title = "t"\ndataset = "mtbench"\ntemperature = 0.7\nmethods = ["ar", "sd:k=4"]\nanchors = ["hf-ar"]\n'
        '[[sweep]]\nmethod = "fsd"\nthreshold = [0.1, 0.9]\n'
    )
    fields = load_config_file(cfg)
    assert fields["temperatures"] == [0.7] and fields["dataset"] == "mtbench"
    assert [e.label for e in fields["entries"]] == ["ar", "sd:k=4", "fsd:threshold=0.1", "fsd:threshold=0.9", "hf-ar"]
    store = tmp_path / "store.toml"
    store.write_text('methods = ["sd", "rest_sd"]\ndatastore = "{stdlib}/*.py"\ndatastore_field = "text"\n')
    assert load_config_file(store)["datastore"] == "{stdlib}/*.py"
    bad = tmp_path / "bad.toml"
    bad.write_text("metods = ['ar']\n")
    with pytest.raises(QuickdraftError, match="unknown field"):
        load_config_file(bad)


def test_schedule_rotates_the_order_per_prompt():
    entries = [Entry("ar"), Entry("sd"), Entry("fsd")]
    cells = schedule(entries, 4, [0.0, 0.7])
    assert len(cells) == 4 * 3 * 2
    for t in (0.0, 0.7):
        for i in range(4):
            order = [c.entry.name for c in cells if c.temperature == t and c.prompt_index == i]
            assert order == [e.name for e in entries[i % 3:] + entries[: i % 3]]
    # every entry is first once in three consecutive prompts
    firsts = [[c.entry.name for c in cells if c.temperature == 0.0 and c.prompt_index == i][0] for i in range(3)]
    assert sorted(firsts) == ["ar", "fsd", "sd"]


def test_config_validates():
    with pytest.raises(QuickdraftError, match="no methods"):
        BenchConfig(entries=[])
    with pytest.raises(QuickdraftError, match="baseline"):
        BenchConfig(entries=[Entry("ar")], baseline="sd")
    assert BenchConfig(entries=[Entry("ar"), parse_entry("sd:k=3")]).baseline_label == "sd:k=3"


# ------------------------------------------------------------------------------------------------
# the harness end to end
# ------------------------------------------------------------------------------------------------
ENTRIES = "ar,sd:k=3,fsd:divergence=js,threshold=0.4,hf-ar"


def test_run_writes_schema_interleaves_and_resumes(pipe, tmp_path):
    prompts = _prompts(3)
    wrapped = _raw_ids_pipe(pipe)
    config = BenchConfig(entries=parse_entries(ENTRIES), limit=3, temperatures=[0.0, 1.0], max_new_tokens=12,
                         warmup_tokens=2, sandbox_workers=2)
    out = tmp_path / "run"

    class Stop(Exception):
        pass

    def interrupt(cell, record):
        if record["run_index"] == 4:
            raise Stop

    with pytest.raises(Stop):
        run_bench(wrapped, prompts, config, out, command="test run", progress=False, after_cell=interrupt,
                  log=lambda m: None)
    first = load_records(out)
    assert len(first) == 5  # cells 0..4 were written before the interruption
    stamps = {(r["method"], r["prompt_id"], r["temperature"]): r["started_at"] for r in first}

    logged: list[str] = []
    meta = run_bench(wrapped, prompts, config, out, command="test resume", progress=False, log=logged.append)
    records = load_records(out)
    assert len(records) == 4 * 3 * 2
    assert [s["command"] for s in meta["sessions"]] == ["test run", "test resume"]
    # the sandbox's isolation mode is recorded for the session and for every checked completion, and logged
    mode = isolation_mode()
    assert all(s["sandbox"]["mode"] == mode for s in meta["sessions"])
    assert json.loads((out / "run.json").read_text())["sessions"][-1]["sandbox"]["mode"] == mode
    assert any(line.startswith(f"HumanEval sandbox: isolation {mode}; network ") for line in logged), logged
    assert {(r["quality"]["isolation"], r["quality"]["network"]) for r in records} == {
        (mode, meta["sessions"][-1]["sandbox"]["network"])
    }
    # resumed: the cached cells were not rerun, the rest continued the run index
    for r in records:
        key = (r["method"], r["prompt_id"], r["temperature"])
        if key in stamps:
            assert r["session"] == 0 and r["started_at"] == stamps[key]
        else:
            assert r["session"] == 1
    assert sorted(r["run_index"] for r in records) == list(range(24))

    # interleaving: in run order, each (temperature, prompt) block runs the rotated entry list
    labels = [e.label for e in config.entries]
    for t in (0.0, 1.0):
        for i in range(3):
            block = [r["method"] for r in records if r["temperature"] == t and r["prompt_index"] == i]
            assert block == labels[i % 4:] + labels[: i % 4]

    # schema of one engine record and one anchor record
    sd = json.loads(cell_path(out, 1.0, "sd:k=3", "Tiny/1").read_text())
    for key in ("method", "params", "prompt_id", "temperature", "seed", "token_ids", "text", "new_tokens",
                "seconds", "decode_seconds", "target_forwards", "draft_forwards", "metrics", "quality", "fidelity"):
        assert key in sd, key
    assert sd["params"] == {"k": 3} and sd["seed"] == prompt_seed(0, "Tiny/1") and sd["lossless"] is True
    assert 0 < sd["new_tokens"] <= 12 and sd["draft_forwards"] > 0
    assert len(sd["metrics"]["acceptance_rate_by_position"]) == 3
    fsd = json.loads(cell_path(out, 0.0, "fsd:divergence=js,threshold=0.4", "Tiny/0").read_text())
    assert fsd["lossless"] is False
    hf = json.loads(cell_path(out, 0.0, "hf-ar", "Tiny/2").read_text())
    assert hf["kind"] == "anchor" and hf["metrics"] is None and hf["seconds"] > 0
    # greedy target alone through HF generate and through our engine give the same tokens
    ar = json.loads(cell_path(out, 0.0, "ar", "Tiny/2").read_text())
    assert hf["token_ids"] == ar["token_ids"]

    # quality: the sandbox ran the (fallback) stub: odd problems pass, even ones fail
    for r in records:
        assert r["quality"]["passed"] == (r["prompt_index"] % 2 == 1), r["quality"]
    # fidelity: one finite mean log-likelihood per completion
    assert all(r["fidelity"]["target_mean_logprob"] < 0 for r in records)

    # reports were written
    for name in ("summary.csv", "summary.json", "summary.md", "plots/acceptance_by_position.png"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    ar0 = next(r for r in summary["rows"] if r["method"] == "ar" and r["temperature"] == 0.0)
    assert ar0["speedup_decode"] == pytest.approx(1.0) and ar0["agree_exact"] == 1.0
    assert ar0["passed"] == 1 and ar0["prompts"] == 3


def test_resume_refuses_a_different_setting(pipe, tmp_path):
    wrapped = _raw_ids_pipe(pipe)
    prompts = _prompts(1)
    config = BenchConfig(entries=parse_entries("ar"), max_new_tokens=4, warmup_tokens=0, fidelity=False)
    run_bench(wrapped, prompts, config, tmp_path, progress=False, log=lambda m: None)
    other = BenchConfig(entries=parse_entries("ar"), max_new_tokens=5, warmup_tokens=0, fidelity=False)
    with pytest.raises(QuickdraftError, match="max_new_tokens=4"):
        run_bench(wrapped, prompts, other, tmp_path, progress=False, log=lambda m: None)


def test_top_p_and_top_k_reach_every_sampled_cell(pipe, tmp_path):
    """``top_k = 1`` at T = 1 leaves one token to sample: the cells equal greedy decoding, which they
    do not without it; a run directory refuses to resume with other top-p / top-k settings."""
    wrapped = _raw_ids_pipe(pipe)
    prompts = _prompts(2)
    kw = dict(entries=parse_entries("ar,sd:k=3"), max_new_tokens=10, warmup_tokens=0, fidelity=False)

    def texts(config, out):
        run_bench(wrapped, prompts, config, out, progress=False, log=lambda m: None)
        return {(r["method"], r["prompt_id"], r["temperature"]): r["token_ids"] for r in load_records(out)}

    greedy = texts(BenchConfig(temperatures=[0.0], **kw), tmp_path / "greedy")
    top1 = texts(BenchConfig(temperatures=[1.0], top_k=1, **kw), tmp_path / "top1")
    sampled = texts(BenchConfig(temperatures=[1.0], **kw), tmp_path / "sampled")
    assert {key[:2]: ids for key, ids in top1.items()} == {key[:2]: ids for key, ids in greedy.items()}
    assert {key[:2]: ids for key, ids in sampled.items()} != {key[:2]: ids for key, ids in greedy.items()}
    run = json.loads((tmp_path / "top1" / "run.json").read_text())
    assert run["config"]["top_k"] == 1 and run["config"]["top_p"] == 1.0
    with pytest.raises(QuickdraftError, match="top_k=1"):
        run_bench(wrapped, prompts, BenchConfig(temperatures=[1.0], top_k=2, **kw), tmp_path / "top1",
                  progress=False, log=lambda m: None)
    with pytest.raises(QuickdraftError, match="top_k must be"):
        BenchConfig(temperatures=[1.0], top_k=-1, **kw)
    with pytest.raises(QuickdraftError, match="top_p"):
        BenchConfig(temperatures=[1.0], top_p=1.5, **kw)


def test_fidelity_is_the_target_log_likelihood(tiny_target):
    prompt, new = [1, 2, 3], [4, 5]
    fid = target_fidelity(tiny_target, prompt, new)
    with torch.no_grad():
        logits = tiny_target(torch.tensor([prompt + new])).logits[0]
    expected = torch.log_softmax(logits[2], -1)[4] + torch.log_softmax(logits[3], -1)[5]
    assert fid.scored_tokens == 2
    assert fid.target_logprob_sum == pytest.approx(float(expected), abs=1e-4)
    # the greedy continuation is at least as likely, token by token, as any other
    greedy = int(logits[2].argmax())
    # through a runner (the openvino and llama.cpp backends' way: the head over the answer only)
    from quickdraft.backends.runner import ModelRunner

    by_runner = target_fidelity(ModelRunner(tiny_target), prompt, new)
    assert by_runner.scored_tokens == 2 and by_runner.target_logprob_sum == pytest.approx(float(expected), abs=1e-4)
    assert target_fidelity(tiny_target, prompt, [greedy]).target_mean_logprob >= target_fidelity(
        tiny_target, prompt, [(greedy + 1) % TINY_VOCAB]).target_mean_logprob


def test_unavailable_anchor_is_skipped_with_one_line(pipe, tmp_path):
    from quickdraft.evaluation.bench import CellRunner

    why = CellRunner(pipe, 4).available(Entry("llamacpp"))  # a tiny model has no GGUF file
    assert why is not None and why.startswith("llamacpp: skipped (") and "\n" not in why
    lines = []
    config = BenchConfig(entries=parse_entries("ar,llamacpp"), max_new_tokens=3, warmup_tokens=0, fidelity=False)
    meta = run_bench(_raw_ids_pipe(pipe), _prompts(1), config, tmp_path, progress=False, log=lines.append)
    assert meta["entries"] == ["ar"] and lines[0] == why
    assert meta["sessions"][0]["skipped"] == [why]


def test_models_meta_records_an_openvino_draft_as_loaded():
    """The draft's weights and head as loaded (the openvino preset: int4 with a cut head), not as asked."""
    from types import SimpleNamespace

    from quickdraft.evaluation.bench import _draft_head, _models_meta

    cut = SimpleNamespace(draft=SimpleNamespace(export_info={"weight_format": "int4"}, head_ids=torch.arange(7)))
    full = SimpleNamespace(draft=SimpleNamespace(export_info={"weight_format": "int4"}, head_ids=None))
    assert _draft_head(cut) == 7 and _draft_head(full) == "full"
    assert _draft_head(SimpleNamespace(draft=SimpleNamespace())) is None  # torch: no export
    meta = _models_meta("target", "draft", "auto", "int8", "int4", backend="openvino", draft_head=_draft_head(cut))
    assert meta == {"target": "target", "draft": "draft", "dtype": "auto", "backend": "openvino", "quantize": "int8",
                    "quantize_draft": "int4", "draft_head": 7}


def test_a_speculative_anchor_call_that_drafted_nothing_is_flagged():
    """GenAI's speculative pipeline, after a call that failed, decodes without drafting: such a call
    must not count as speculative decoding (bench_perf records it as an error)."""
    from quickdraft.evaluation.anchors import AnchorResult

    counts = {"drafted_tokens": 0, "accepted_tokens": 0, "target_infer_seconds": 1.0, "draft_infer_seconds": 0.5}
    assert AnchorResult(new_ids=[5, 6, 7], seconds=1.0, speculative=counts).drafted_nothing
    assert not AnchorResult(new_ids=[5], seconds=1.0, speculative=counts).drafted_nothing  # one token: no step to draft
    assert not AnchorResult(new_ids=[5, 6, 7], seconds=1.0,
                            speculative={**counts, "drafted_tokens": 4, "accepted_tokens": 1}).drafted_nothing
    assert not AnchorResult(new_ids=[5, 6, 7], seconds=1.0).drafted_nothing  # plain decoding reports no counts
