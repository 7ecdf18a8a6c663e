"""The measured step costs of the cost policy: the machine's identity, each runner's, the cache
that keeps them across processes, and ``--policy auto``."""

from __future__ import annotations

import json

import pytest

from quickdraft.backends import costs as costs_module
from quickdraft.backends.costs import CostCache, RowsCost, StepCost, batch_grid, cost_key, machine_identity
from quickdraft.backends.runner import ModelRunner
from quickdraft.decoding.policies import Constant, CostAware
from quickdraft.errors import QuickdraftError
from quickdraft.methods import build_method
from quickdraft.pipeline import Pipeline

from conftest import tiny_lm, word_tokenizer

AVX2 = "processor : 0\nmodel name : AMD EPYC\nflags : fpu sse2 avx fma f16c avx2\n\nprocessor : 1\n"
AVX512 = "model name : Intel Xeon\nflags : avx avx2 fma avx512f avx512_vnni avx512_bf16 amx_tile\n"


def test_the_machine_is_its_cpu_and_the_isa_the_kernels_dispatch_on():
    amd, intel = machine_identity(AVX2), machine_identity(AVX512)
    assert amd["cpu"] == "AMD EPYC" and amd["isa"] == ["avx", "avx2", "f16c", "fma"]
    assert intel["isa"] == ["amx_tile", "avx", "avx2", "avx512_bf16", "avx512_vnni", "avx512f", "fma"]
    assert amd["cores"] >= 1 and machine_identity("")["isa"] == []


def saved_runner(tmp_path, name: str, seed: int) -> ModelRunner:
    """A tiny model saved to (once) and loaded from ``tmp_path / name``: a runner with files."""
    from transformers import AutoModelForCausalLM

    if not (tmp_path / name).is_dir():
        tiny_lm(seed=seed).save_pretrained(tmp_path / name)
    return ModelRunner(AutoModelForCausalLM.from_pretrained(tmp_path / name).eval(), name)


def test_a_runner_says_what_decides_its_speed(tmp_path, monkeypatch):
    runner = saved_runner(tmp_path, "target", 0)
    identity = runner.cost_identity()
    assert identity["weights"]["path"] == str((tmp_path / "target").resolve())
    assert "model.safetensors" in [name for name, _, _ in identity["weights"]["files"]]
    assert identity["dtypes"] == ["torch.float32"] and identity["runtime"].startswith("torch ")
    assert ModelRunner(tiny_lm(seed=0)).cost_identity() is None  # built in memory: no files to name
    monkeypatch.setattr(costs_module.torch, "get_num_threads", lambda: 97)
    assert runner.cost_identity()["threads"] == 97  # another thread count is another key
    assert cost_key(runner, None)["draft"] is None
    assert cost_key(runner, ModelRunner(tiny_lm(seed=1))) is None


def test_the_cache_keeps_costs_per_key(tmp_path):
    store = CostCache(tmp_path / "cache" / "step_costs.json")
    key = {"machine": machine_identity(AVX2), "target": {"weights": {"path": str(tmp_path)}}, "draft": None}
    cost = StepCost(target=(0.05, 0.06, 0.08), draft=0.02)
    assert store.get(key, 2) is None
    store.put(key, cost)
    assert store.get(key, 2) == cost and store.get(key, 1) == cost
    assert store.get(key, 3) is None  # does not cover a 4-token verification
    other = {**key, "machine": machine_identity(AVX512)}
    assert store.get(other, 1) is None
    store.put(other, StepCost(target=(0.03, 0.031, 0.032), draft=0.01))
    assert store.get(key, 2) == cost and len(store.entries()) == 2
    entry = store.entries()[CostCache.digest(key)]
    assert entry["measured_at"] and entry["key"] == key
    # an entry whose model is gone is dropped at the next write
    gone = {**key, "target": {"weights": {"path": str(tmp_path / "deleted")}}}
    store.put(gone, cost)
    store.put(key, cost)
    assert CostCache.digest(gone) not in store.entries() and len(store.entries()) == 2
    # a damaged file reads as empty, and is rewritten by the next measurement
    store.path.write_text("{not json")
    assert store.entries() == {} and store.get(key, 1) is None
    store.put(key, cost)
    assert json.loads(store.path.read_text())[CostCache.digest(key)]["draft"] == 0.02
    # costs over batches: kept with the entry, and an entry covers the batches it was measured at
    served = StepCost(target=(0.05, 0.06, 0.08), draft=0.02,
                      batched=(RowsCost(2, (0.07, 0.1, 0.14), 0.03), RowsCost(4, (0.1, 0.18, 0.26), 0.04)))
    assert store.get(key, 2, max_rows=2) is None  # measured at one row only
    store.put(key, served)
    assert store.get(key, 2, max_rows=4) == served and store.get(key, 2, max_rows=3) == served
    assert store.get(key, 2) == served and store.get(key, 2, max_rows=5) is None
    assert store.clear() == 1 and not store.path.exists()


def test_batch_costs_interpolate_between_the_measured_rows():
    """A step's cost at ``rows`` is one row's without batch costs, the measured one at a measured
    row count, linear in between and beyond; batch costs must cover one row's sizes, rows ascending."""
    one = StepCost(target=(1.0, 1.2, 1.4), draft=0.2, overhead=0.01)
    assert one.step(2, rows=16) == one.step(2) == pytest.approx(1.81) and one.max_rows == 1
    served = StepCost(target=one.target, draft=0.2, overhead=0.01,
                      batched=(RowsCost(2, (1.5, 2.5, 3.5), 0.3), RowsCost(4, (2.5, 4.5, 6.5), 0.5)))
    assert served.step(0, rows=2) == pytest.approx(1.51) and served.step(2, rows=4) == pytest.approx(7.51)
    assert served.step(1, rows=3) == pytest.approx((2.8 + 5.0) / 2 + 0.01)
    assert served.step(1, rows=6) == pytest.approx(5.0 + (5.0 - 2.8) + 0.01)  # the last two rows' slope
    assert served.without_draft().step(2, rows=4) == pytest.approx(6.51)
    noisy = StepCost(target=one.target, draft=0.2, batched=(RowsCost(2, (1.5, 2.5, 3.5), 0.3),
                                                             RowsCost(4, (1.4, 2.4, 3.4), 0.3)))
    assert noisy.step(1, rows=8) == pytest.approx(noisy.step(1, rows=4))  # a falling last slope is not followed
    with pytest.raises(QuickdraftError, match="ascending"):
        StepCost(target=one.target, draft=0.2, batched=served.batched[::-1])
    with pytest.raises(QuickdraftError, match="as many target sizes"):
        StepCost(target=one.target, draft=0.2, batched=(RowsCost(2, (1.5, 2.5), 0.3),))
    with pytest.raises(QuickdraftError, match="rows >= 2"):
        RowsCost(1, (1.0,), 0.1)
    with pytest.raises(QuickdraftError, match="at least one row"):
        served.step(1, rows=0)
    assert batch_grid(1) == () and batch_grid(2) == (2,) and batch_grid(5) == (2, 4, 8) and batch_grid(16)[-1] == 16


def test_the_cost_policy_drafts_for_one_row_and_not_for_a_full_batch(tiny_target, tiny_draft):
    """Under costs where a draft pays in one row and no draft pays in four (a verification's extra
    tokens cost little in one row and much in a batch), the engine's cost policy drafts for one
    prompt and makes plain steps for four, with plain decoding's greedy text either way; the
    policy hears the rows of every step, fewer as rows finish."""
    from quickdraft.decoding.drafters import ModelDrafter
    from quickdraft.decoding.engine import generate

    from conftest import TINY_VOCAB

    flat = tuple(1.0 + 0.0125 * m for m in range(5))
    costs = StepCost(target=flat, draft=0.05, batched=(RowsCost(4, tuple(4.0 * (1 + m) for m in range(5)), 0.2),))
    target = ModelRunner(tiny_target)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12, 13, 14]]
    heard = []

    class Listening(CostAware):
        def observe_rows(self, rows: int) -> None:
            heard.append(rows)
            super().observe_rows(rows)

    for rows in (1, 4):
        drafter = ModelDrafter(ModelRunner(tiny_draft), TINY_VOCAB)
        out = generate(target, prompts[:rows], method="sd", drafter=drafter, max_new_tokens=20,
                       policy=Listening(max_k=4, costs=costs), eos_token_ids=[5])
        assert out.sequences == generate(target, prompts[:rows], method="ar", max_new_tokens=20,
                                         eos_token_ids=[5]).sequences
        assert (out.batch_metrics.drafted_tokens > 0) == (rows == 1)
    one_row, four_rows = heard[:heard.index(4)], heard[heard.index(4):]
    assert set(one_row) == {1} and four_rows[0] == 4 and four_rows == sorted(four_rows, reverse=True)
    assert min(four_rows) < 4  # a row finished (EOS) and the later steps decoded fewer


def test_a_pipeline_measures_once_per_machine_and_pair(tmp_path, monkeypatch):
    """The first pipeline measures and stores; a second one on the same files reads the cache; a
    refresh measures again; ``cache=False`` neither reads nor writes."""
    calls = []
    real = costs_module.measure_step_cost

    def counting(*args, **kwargs):
        calls.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr("quickdraft.pipeline.measure_step_cost", counting)
    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path / "cache"))

    def pipeline() -> Pipeline:
        target, draft = saved_runner(tmp_path, "t", 0), saved_runner(tmp_path, "d", 1)
        return Pipeline(target.model, word_tokenizer(), draft.model, target_runner=target, draft_runner=draft)

    heard = []
    first = pipeline().step_costs(3, on_measure=heard.append)
    assert calls == [3] and (tmp_path / "cache" / "step_costs.json").is_file()
    assert [store.path for store in heard] == [tmp_path / "cache" / "step_costs.json"]  # told before measuring
    second = pipeline()
    assert second.step_costs(3, on_measure=heard.append) == first and second.step_costs(2) == first and calls == [3]
    assert len(heard) == 1  # read from the cache: nothing to say
    assert second.step_costs(5) != first and calls == [3, 5]  # a longer draft: measured again
    assert len(pipeline().step_costs(5).target) == 6 and calls == [3, 5]
    pipeline().step_costs(3, refresh=True)
    assert calls == [3, 5, 3]
    pipeline().step_costs(3, cache=False, on_measure=heard.append)
    assert calls == [3, 5, 3, 3] and heard[-1] is None  # measured, kept nowhere
    policy = pipeline().ready_policy(CostAware(max_k=3), "sd")
    assert policy.costs is not None and len(policy.costs.target) >= 4 and calls == [3, 5, 3, 3]
    # a server's batches: measured over them once, then read for any batch up to the largest
    batched = pipeline().ready_policy(CostAware(max_k=3), "sd", max_rows=4).costs
    assert calls == [3, 5, 3, 3, 3] and [r.rows for r in batched.batched] == [2, 4]
    assert pipeline().step_costs(3, max_rows=3) == batched and pipeline().step_costs(2) == batched
    assert calls == [3, 5, 3, 3, 3]


def test_auto_is_the_cost_policy_where_a_step_may_be_plain():
    for name in ("sd", "ngram", "ngram_sd", "rest", "rest_sd", "phrase_sd", "fsd", "typical", "lantern", "ersd"):
        spec = build_method(name, k=6, policy="auto")
        assert isinstance(spec.policy, CostAware) and spec.policy.max_k == 6, name
    for name, options in (("ar", {}), ("amusd", {}), ("cd", {}), ("scd", {}), ("tree", {}),
                          ("ersd", {"candidates": 2})):
        spec = build_method(name, k=3, policy="auto", **options)
        assert isinstance(spec.policy, Constant) and spec.policy.k == 3, name
    with pytest.raises(QuickdraftError, match="policy cost chooses"):
        build_method("ersd", policy="cost", candidates=2)


def test_a_methods_engine_method_is_the_one_build_method_runs():
    """``may_skip_drafting`` asks ``engine_method_of`` against the engine's ``SKIPPABLE``: both must
    name what ``build_method`` builds, for every method."""
    from quickdraft.decoding.engine import METHODS, SKIPPABLE
    from quickdraft.methods import METHOD_NAMES, engine_method_of, may_skip_drafting

    for name in METHOD_NAMES:
        for candidates in ((1, 3) if name == "ersd" else (1,)):
            built = build_method(name, candidates=candidates).engine_method
            assert built == engine_method_of(name, candidates) and built in METHODS, (name, candidates)
            assert may_skip_drafting(name, candidates) == (built in SKIPPABLE)
    assert [n for n in METHOD_NAMES if not may_skip_drafting(n)] == ["ar", "amusd", "cd", "scd", "tree"]


def test_the_command_lists_and_forgets_the_measurements(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from quickdraft.cli import app

    monkeypatch.setenv("QUICKDRAFT_CACHE", str(tmp_path))
    (tmp_path / "pair").mkdir()
    (tmp_path / "pair" / "model.gguf").write_bytes(b"")  # an entry is kept while its model's files are
    runner = {"runtime": "llama.cpp 0.3.36", "weights": {"path": str(tmp_path / "pair" / "model.gguf")}}
    key = {"machine": machine_identity(AVX2), "target": runner, "draft": None}
    CostCache.default().put(key, StepCost(target=(0.056, 0.09, 0.125), draft=0.0))
    served = {**key, "target": {**runner, "runtime": "openvino 2026.4"}}
    CostCache.default().put(served, StepCost(target=(0.1, 0.12, 0.13), draft=0.02, batched=(
        RowsCost(2, (0.15, 0.2, 0.25), 0.03), RowsCost(4, (0.2, 0.3, 0.4), 0.04))))
    listed = CliRunner().invoke(app, ["models", "costs"], env={"COLUMNS": "220"})
    assert listed.exit_code == 0, listed.output
    assert "AMD EPYC" in listed.output and "56 90 125" in listed.output and "pair/model.gguf" in listed.output
    assert "100 120 130" in listed.output and "2 4" in listed.output  # the rows it was also measured over
    cleared = CliRunner().invoke(app, ["models", "costs", "--clear"])
    assert cleared.exit_code == 0 and "forgot 2 measurement" in cleared.output
    assert CostCache.default().entries() == {}


def test_generate_drafts_under_the_cost_policy_by_default(monkeypatch, tiny_target, tiny_draft):
    """Without ``--policy``, ``generate`` runs the cost policy: under costs where no draft pays it
    says so, makes plain steps only and prints plain decoding's text."""
    from typer.testing import CliRunner

    from quickdraft.cli import app

    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    steep = StepCost(target=(1.0, 2.0, 3.0, 4.0, 5.0), draft=1.0)
    monkeypatch.setattr("quickdraft.pipeline.measure_step_cost", lambda *args, **kwargs: steep)  # as if measured
    monkeypatch.setattr(Pipeline, "from_specs", classmethod(lambda cls, *args, **kwargs: pipe))
    common = ["generate", "w1 w2 w3", "--no-chat", "--max-new-tokens", "12"]
    result = CliRunner().invoke(app, [*common, "--method", "sd"])
    assert result.exit_code == 0, result.output
    assert "policy=cost" in result.output and "measuring this pair's forward costs" in result.output
    assert "draft forwards 0" in result.output and "nothing drafted (plain steps)" in result.output
    text = result.output.split("\n--- ")[0].splitlines()[-1]
    plain = CliRunner().invoke(app, [*common, "--method", "ar"])
    assert plain.output.split("\n--- ")[0].splitlines()[-1] == text
    drafted = CliRunner().invoke(app, [*common, "--method", "sd", "--policy", "constant"])
    assert "policy=constant" in drafted.output and "acceptance by position" in drafted.output


def test_the_cost_modules_examples_hold():
    """The docstring examples of the costs and the policies (interpolation, the batch grid, the
    length chosen at one row and at sixteen)."""
    import doctest

    import quickdraft.backends.costs
    import quickdraft.decoding.policies

    for module in (quickdraft.backends.costs, quickdraft.decoding.policies):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
