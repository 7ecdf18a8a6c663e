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
        (["--policy", "magic"], "unknown policy"),
        (["--target", "/nonexistent/model/dir"], "/nonexistent/model/dir"),
        (["--method", "fsd", "--threshold", "-0.1"], "threshold"),
        (["--method", "fsd", "--divergence", "hellinger"], "unknown divergence"),
        (["--method", "typical", "--epsilon", "0"], "epsilon"),
        (["--method", "typical", "--delta", "-1"], "delta"),
        (["--method", "ersd", "--candidates", "0"], "candidates"),
    ],
)
def test_bad_arguments_give_one_clear_line_and_exit_code_2(args, needle):
    result = _run("generate", "hello", *args)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], result.output


def test_empty_prompt_is_rejected(real_models):
    result = _run("generate", "   ", "--method", "ar")
    assert result.exit_code == 2 and "empty prompt" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sd"])  # every method on the real pair: test_real_models.py
def test_generate_json_on_the_default_pair(real_models, method):
    result = _run("generate", "Write a Python function that adds two numbers.", "--method", method,
                  "--max-new-tokens", "12", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output[result.output.index("{"):])
    metrics = payload["metrics"]
    assert payload["method"] == method
    assert 1 <= metrics["new_tokens"] <= 12 and payload["text"].strip()
    assert metrics["tokens_per_second"] > 0
    if method == "sd":
        assert metrics["draft_forwards"] > 0 and metrics["mean_acceptance_length"] >= 1.0
    if method == "ar":
        assert metrics["draft_forwards"] == 0 and metrics["mean_acceptance_length"] == 1.0
