"""Program extraction from realistic chat answers to HumanEval/0 (has_close_elements).

Each answer style is checked for its parse status, that example usage was dropped, and — for the
answers that contain a correct solution — that the extracted program passes the real HumanEval
tests in the sandbox (one batch, 2 workers).
"""

from __future__ import annotations

import ast

import pytest

from quickdraft.evaluation.datasets import load_humaneval_problems
from quickdraft.evaluation.extract import UNPARSEABLE, extract_program
from quickdraft.evaluation.sandbox import run_humaneval_checks

PROBLEMS = {p["task_id"]: p for p in load_humaneval_problems()}
P0 = PROBLEMS["HumanEval/0"]
P10 = PROBLEMS["HumanEval/10"]  # the prompt defines a helper, is_palindrome, before the stub

FULL = '''from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    """ Check if in given list of numbers, are any two numbers closer to each other than
    given threshold.
    """
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False
'''

NO_DOC = '''def has_close_elements(numbers: List[float], threshold: float) -> bool:
    ordered = sorted(numbers)
    return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))
'''

BODY = '''    ordered = sorted(numbers)
    for a, b in zip(ordered, ordered[1:]):
        if b - a < threshold:
            return True
    return False
'''

# (name, answer, problem, expected status, contains a correct solution)
ANSWERS = [
    (
        "python fence with prose around",
        f"Here is the implementation:\n\n```python\n{FULL}```\n\nThe function compares every pair.",
        P0, "fence/function", True,
    ),
    (
        "bare fence, signature without docstring, imports omitted",
        f"```\n{NO_DOC}```",
        P0, "fence/function", True,
    ),
    (
        "unclosed fence cut off in the middle of example usage",
        f"Sure!\n```python\n{FULL}\n\nprint(has_close_elements([1.0, 2.0, 3.0],",
        P0, "unclosed_fence/function", True,
    ),
    (
        "imports, a helper function and a __main__ block",
        "```python\nimport math\nfrom typing import List\n\n\ndef _gap(a: float, b: float) -> float:\n"
        "    return math.fabs(a - b)\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
        "    return any(_gap(a, b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n\n\n"
        "if __name__ == \"__main__\":\n    import doctest\n    doctest.testmod()\n    print(has_close_elements([1.0, 2.8], 0.3))\n```",
        P0, "fence/function", True,
    ),
    (
        "example usage with assignments, prints and asserts",
        f"```python\n{NO_DOC}\n# Example usage\nresult = has_close_elements([1.0, 2.0, 3.0], 0.5)\nprint(result)\n"
        "assert has_close_elements([1.0, 2.8, 3.0], 0.3) == True\nhas_close_elements([], 1.0)\n```",
        P0, "fence/function", True,
    ),
    (
        "body only, indented, in a fence",
        f"```python\n{BODY}```",
        P0, "fence/body", True,
    ),
    (
        "body only, dedented",
        "You can do it like this:\n```python\nordered = sorted(numbers)\n"
        "return any(b - a < threshold for a, b in zip(ordered, ordered[1:]))\n```",
        P0, "fence/body", True,
    ),
    (
        "no fence: prose, code, prose",
        f"To solve this, sort the list first.\n\n{NO_DOC}\nThis runs in O(n log n) time because of the sort.",
        P0, "plain/function", True,
    ),
    (
        "solution block then a usage block",
        f"```python\n{NO_DOC}```\n\nYou can call it like so:\n\n```python\nprint(has_close_elements([1.0, 2.0], 0.5))\n```",
        P0, "fence/function", True,
    ),
    (
        "a wrong first attempt, then the corrected version",
        "First attempt:\n```python\ndef has_close_elements(numbers, threshold):\n    return False\n```\n"
        f"Wait, that ignores the input. Corrected:\n```python\n{NO_DOC}```",
        P0, "fence/function", True,
    ),
    (
        "a shell block first, capitalised language tag, leftover end-of-turn token",
        f"Install nothing:\n```bash\npip list\n```\n```Python\n{NO_DOC}```<|im_end|>\ntrailing junk ```",
        P0, "fence/function", True,
    ),
    (
        "raw continuation of the prompt (base-model style)",
        BODY,
        P0, "plain/body", True,
    ),
    (
        "body relies on the helper defined in the prompt",
        "```python\n    if not string:\n        return ''\n    for i in range(len(string)):\n"
        "        if is_palindrome(string[i:]):\n            return string + string[:i][::-1]\n```",
        P10, "fence/body", True,
    ),
    (
        "tilde fence",
        f"~~~python\n{NO_DOC}~~~",
        P0, "fence/function", True,
    ),
    (
        "a refusal in prose",
        "I'm sorry, but I can't complete that function without more information.",
        P0, UNPARSEABLE, False,
    ),
    (
        "code that defines a differently named function",
        "```python\ndef close_elements(xs, t):\n    return True\n```",
        P0, "fence/no_entry_point", False,
    ),
    (
        "a one-word answer",
        "Sure",
        P0, UNPARSEABLE, False,
    ),
]


@pytest.fixture(scope="module")
def extractions():
    return [extract_program(answer, problem["prompt"], problem["entry_point"]) for _, answer, problem, _, _ in ANSWERS]


@pytest.mark.parametrize("index", range(len(ANSWERS)), ids=[a[0] for a in ANSWERS])
def test_status_and_program_parses(index, extractions):
    name, answer, problem, expected, _ = ANSWERS[index]
    program, status = extractions[index]
    assert status == expected, f"{name}: got {status}"
    tree = ast.parse(program)  # every returned program parses, even the unparseable fallback
    top_calls = [
        node for node in tree.body
        if isinstance(node, (ast.Expr, ast.Assert, ast.If)) and not isinstance(getattr(node, "value", None), ast.Constant)
    ]
    assert top_calls == [], f"{name}: example usage survived: {[ast.unparse(n) for n in top_calls]}"
    assert program.startswith(problem["prompt"]), "the prompt (with its imports and helpers) comes first"


def test_extracted_programs_pass_or_fail_as_expected(extractions):
    jobs = [(problem, program) for (_, _, problem, _, _), (program, _) in zip(ANSWERS, extractions)]
    outcomes = run_humaneval_checks(jobs, workers=2, timeout=10.0)
    for (name, _, _, _, correct), outcome in zip(ANSWERS, outcomes):
        assert outcome.passed == correct, f"{name}: {outcome}"


def test_last_defining_block_wins():
    answer = "```python\ndef f(x):\n    return 1\n```\n```python\ndef f(x):\n    return 2\n```"
    program, status = extract_program(answer, "def f(x):\n    '''doc'''\n", "f")
    assert status == "fence/function"
    assert "return 2" in program and "return 1" not in program


def test_comments_and_decorators_inside_kept_definitions_survive():
    answer = "```python\nimport functools\n\n@functools.lru_cache(None)\ndef f(n):\n    # memoised\n    return n\n```"
    program, _ = extract_program(answer, "def f(n):\n    '''doc'''\n", "f")
    assert "@functools.lru_cache(None)" in program and "# memoised" in program


def test_unparseable_program_is_the_bare_prompt():
    prompt = "def f(x):\n    '''doc'''\n"
    result = extract_program("```python\ndef f(x) return x\n```", prompt, "f")
    assert not result.parsed and result.program == prompt
