"""The command line: clear one-line errors with exit code 2, JSON output, every method end to end
on the real default pair (the ``real_models`` fixture skips only when the models are not installed)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from quickdraft.cli import app

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5", "--temperature", "1"], "top_p"),
        (["--method", "beam"], "unknown method"),
        (["--k", "0"], "draft length"),
        (["--k", "10000", "--max-new-tokens", "4"], "at most 64"),
        (["--k", "100", "--policy", "heuristic"], "at most 64"),
        (["--method", "tree", "--depth", "100"], "tree depth must be at most 64"),
        (["--policy", "magic"], "unknown policy"),
        (["--target", "/nonexistent/model/dir"], "/nonexistent/model/dir"),
        (["--method", "fsd", "--threshold", "-0.1"], "threshold"),
        (["--method", "fsd", "--divergence", "hellinger"], "unknown divergence"),
        (["--method", "typical", "--epsilon", "0"], "epsilon"),
        (["--method", "typical", "--delta", "-1"], "delta"),
        (["--method", "ersd", "--candidates", "0"], "candidates"),
        (["--method", "ersd", "--candidates", "2", "--policy", "heuristic"], "policy constant"),
        (["--method", "tree", "--rule", "race"], "unknown tree rule"),
        (["--method", "fsd", "--drafts", "beam"], "unknown drafts"),
        (["--method", "sd", "--drafts", "greedy"], "applies to fsd and typical"),
        (["--method", "fsd", "--hybrid", "--drafts", "greedy"], "sampled drafts"),
        (["--method", "fsd", "--divergence", "topk_js", "--divergence-top-k", "0"], "top_k"),
        (["--method", "fsd", "--divergence", "topp_js", "--divergence-top-p", "1.5"], "top_p"),
    ],
)
def test_bad_arguments_give_one_clear_line_and_exit_code_2(args, needle):
    result = _run("generate", "hello", *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_deprecated_divergence_name_is_said_on_stderr():
    result = _run("generate", "hello", "--method", "fsd", "--divergence", "js_fsd", "--threshold", "-1")
    assert result.exit_code == 2, result.output
    assert "warning: divergence 'js_fsd' is deprecated; use 'js'" in result.output
    assert "threshold" in [line for line in result.output.splitlines() if line.startswith("error:")][0]


def test_empty_prompt_is_rejected(real_models):
    result = _run("generate", "   ", "--method", "ar")
    assert result.exit_code == 2 and "empty prompt" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["constant", None])  # every method on the real pair: test_real_models.py
def test_generate_json_on_the_default_pair(real_models, policy):
    """``sd`` with a constant draft length drafts; without ``--policy`` the cost policy chooses
    (it may draft nothing where no draft pays on this machine)."""
    result = _run("generate", "Write a Python function that adds two numbers.", "--method", "sd",
                  "--max-new-tokens", "12", "--json", *(["--policy", policy] if policy else []))
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output[result.output.index("{"):])
    metrics = payload["metrics"]
    assert payload["method"] == "sd" and payload["policy"] == (policy or "cost")
    assert 1 <= metrics["new_tokens"] <= 12 and payload["text"].strip()
    assert metrics["tokens_per_second"] > 0 and metrics["mean_acceptance_length"] >= 1.0
    if policy == "constant":
        assert metrics["draft_forwards"] > 0



@pytest.fixture
def tiny_pipeline(monkeypatch, tiny_target, tiny_draft):
    """``Pipeline.from_specs`` patched to return the conftest tiny pair with a word-level tokenizer."""

    from conftest import word_tokenizer
    from quickdraft.pipeline import Pipeline

    pipe = Pipeline(tiny_target, word_tokenizer(), tiny_draft)
    monkeypatch.setattr(Pipeline, "from_specs", classmethod(lambda cls, *args, **kwargs: pipe))
    return pipe


def test_ersd_candidates_and_race_trees_from_the_command_line(tiny_pipeline):
    """``--method ersd --candidates n`` and ``--method tree --rule ersd`` run end to end and, being
    the target's own race sample for the seed, print the same text as chain ERSD."""
    common = ["generate", "w1 w2 w3 w4", "--no-chat", "--temperature", "0.9", "--max-new-tokens", "16", "--json",
              "--policy", "constant"]
    texts = {}
    for extra in (["--method", "ersd"], ["--method", "ersd", "--candidates", "3"],
                  ["--method", "tree", "--rule", "ersd", "--topk", "2", "--depth", "3", "--tree-budget", "6"]):
        result = _run(*common, "--seed", "5", *extra)
        assert result.exit_code == 0, result.output
        payload = json.loads(result.output[result.output.index("{"):])
        assert payload["metrics"]["new_tokens"] >= 1 and payload["metrics"]["draft_forwards"] > 0
        texts[" ".join(extra)] = payload["text"]
    assert len(set(texts.values())) == 1 and len(texts["--method ersd"].split()) >= 8, texts
    other = _run(*common, "--seed", "6", "--method", "ersd")
    assert json.loads(other.output[other.output.index("{"):])["text"] != next(iter(texts.values()))


@pytest.mark.parametrize(
    "args, needle",
    [
        (["w1", "--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
        (["w1", "--stop", ""], "empty stop string"),
        (["w1 \udcff"], "prompt is not valid UTF-8"),
        (["w1", "--stop", "\udcff"], "stop string is not valid UTF-8"),
        (["w1", "--drafter", "eagle"], "unknown drafter 'eagle'"),
        (["w1", "--drafter", "feature", "--backend", "openvino"], "use --backend torch"),
    ],
)
def test_bad_generation_arguments_are_rejected_before_the_models_load(args, needle):
    """The target does not exist: the error names the argument, so nothing was loaded first."""
    result = _run("generate", *args, "--target", "/nonexistent/model/dir")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_a_tiny_temperature_runs_as_greedy(tiny_pipeline):
    common = ["generate", "w1 w2 w3", "--no-chat", "--max-new-tokens", "8", "--json"]
    texts = []
    for temperature in ("0", "1e-40"):
        result = _run(*common, "--temperature", temperature)
        assert result.exit_code == 0, result.output
        texts.append(json.JSONDecoder().raw_decode(result.output[result.output.index("{"):])[0]["text"])
    assert texts[0] == texts[1] and texts[0].strip()


def test_prompt_bytes_that_are_not_utf8_give_a_clear_error():
    """Real argv bytes (not UTF-8) reach the CLI as lone surrogates; it names the problem."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "quickdraft.cli", "generate", b"w1 \xff w2", "--target", "/nonexistent/model/dir"],
        capture_output=True, timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert b"error: prompt is not valid UTF-8" in result.stderr and b"Traceback" not in result.stderr


def test_auto_backend_picks_llamacpp_only_on_an_avx2_cpu_for_a_request_it_runs(monkeypatch, tmp_path):
    """``--backend auto``: llama.cpp where the CPU has AVX2 but no AVX-512, llama-cpp-python imports and
    the request runs on it (GGUF files, one prompt, a chain method reading no hidden states);
    otherwise what it was (openvino where installed, else torch)."""
    import quickdraft.backends.llamacpp as llamacpp
    import quickdraft.models as models
    from quickdraft.backends import resolve_backend
    from quickdraft.backends.openvino import runner as ov_runner
    from quickdraft.backends.llamacpp import runs_on_llamacpp

    monkeypatch.setattr(llamacpp, "is_available", lambda: True)
    monkeypatch.setattr(ov_runner, "is_available", lambda: True)
    for flags, expected in (({"avx2", "fma"}, "llamacpp"), ({"avx2", "avx512f"}, "openvino"), (set(), "openvino")):
        monkeypatch.setattr(models, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert resolve_backend("auto", llamacpp_runs=True) == expected
        assert resolve_backend("auto") == "openvino"  # the caller did not say the request runs there
        assert resolve_backend("torch", llamacpp_runs=True) == "torch"  # a named backend stays
    monkeypatch.setattr(llamacpp, "is_available", lambda: False)
    assert resolve_backend("auto", llamacpp_runs=True) == "openvino"
    monkeypatch.setattr(ov_runner, "is_available", lambda: False)
    assert resolve_backend("auto", llamacpp_runs=True) == "torch"

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    ok = dict(prompts=1, target=str(gguf), draft=str(gguf))
    assert runs_on_llamacpp("sd", "sd", **ok) and runs_on_llamacpp("ar", "ar", prompts=1, target=str(gguf), draft=None)
    assert not runs_on_llamacpp("sd", "sd", **{**ok, "prompts": 2})  # a batch
    assert not runs_on_llamacpp("tree", "tree", **ok) and not runs_on_llamacpp("ersd", "tree", **ok)  # trees
    assert not runs_on_llamacpp("lantern", "sd", **ok)  # not among the methods auto may send there
    assert not runs_on_llamacpp("sd", "sd", **ok, needs_hidden=True)  # a SpecDec++ head, the feature drafter
    assert not runs_on_llamacpp("sd", "sd", **ok, backend_options=True)  # --quantize, --draft-vocab ...
    assert not runs_on_llamacpp("sd", "sd", prompts=1, target=str(hf), draft=str(gguf))  # no GGUF
    assert not runs_on_llamacpp("sd", "sd", prompts=1, target=str(gguf), draft="/nonexistent/draft")


def test_generate_on_auto_tells_which_backend_it_chose(tiny_pipeline, monkeypatch):
    """The backend ``auto`` resolved to reaches the pipeline, for a request llama.cpp runs and one it does not."""
    import quickdraft.backends.llamacpp as llamacpp
    import quickdraft.models as models
    from quickdraft.pipeline import Pipeline

    seen = []
    monkeypatch.setattr(Pipeline, "from_specs", classmethod(lambda cls, *a, **kw: seen.append(kw["backend"]) or tiny_pipeline))
    monkeypatch.setattr(llamacpp, "is_available", lambda: True)
    monkeypatch.setattr(llamacpp, "has_gguf", lambda spec: True)
    monkeypatch.setattr(models, "cpu_flags", lambda: frozenset({"avx2"}))
    common = ["generate", "w1 w2 w3", "--no-chat", "--max-new-tokens", "4", "--json"]
    results = [_run(*common, "--method", "sd"), _run(*common, "--method", "tree"),
               _run(*common, "--method", "sd", "--backend", "torch")]
    assert all(r.exit_code == 0 for r in results), [r.output for r in results]
    assert seen[0] == "llamacpp" and seen[1] != "llamacpp" and seen[2] == "torch"
    said = [json.loads(r.output[r.output.index("{"):])["backend"] for r in results]
    assert said == seen  # the JSON says which backend ran
