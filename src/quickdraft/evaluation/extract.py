"""Turn a chat model's answer to a HumanEval prompt into a runnable program.

Instruct models rarely answer with just the function body. They wrap code in fences (```` ```python ````,
bare ```` ``` ````, or a fence the token budget cut off), restate the signature with or without the
docstring, repeat the imports, add helper functions, and append example usage, ``print`` calls,
``assert`` lines or an ``if __name__ == "__main__":`` block. Some answer with the body alone, some
continue the prompt the way a base model does. :func:`extract_program` handles all of these and
says which way it parsed the answer, so a benchmark can report how many answers were unusable.

The program is always the HumanEval prompt (imports, helper functions, the stub) followed by the
model's code, so the prompt's imports are defined and a restated function replaces the stub (the
later ``def`` wins). Nothing is executed here; parsing uses :func:`ast.parse` only.

Statuses
--------
``"<source>/<shape>"`` with *source* one of ``fence`` (a closed code fence), ``unclosed_fence`` (an
opening fence with no closing one, e.g. cut off by the token limit) or ``plain`` (no fence), and
*shape* one of

``function``
    the code defines the entry point; top-level test code was dropped;
``body``
    the code is the function body only; it was indented under the prompt's stub;
``completion``
    the code continues the prompt verbatim (base-model style: prompt + answer parses);
``no_entry_point``
    the code defines functions, but not the entry point, and does not read as a body (it will fail
    its test, but it was code).

Trailing lines that do not parse (prose after unfenced code, a statement cut off by the token
limit) are dropped before giving up. Among several fenced blocks, the *last* one that defines the
entry point is used (models often show a first attempt, then a corrected one); blocks tagged with
another language (```` ```bash ````) are ignored.

``"unparseable"`` when nothing parses; the program is then the bare prompt (whose stub returns
``None``), so executing it fails its test rather than crashing the harness.
"""

from __future__ import annotations

import ast
import re
import textwrap
from typing import NamedTuple

UNPARSEABLE = "unparseable"

# An opening fence (optionally indented, optional language tag) up to the closing fence or the end.
_FENCE = re.compile(
    r"^[ \t]*(?P<tick>```+|~~~+)[ \t]*(?P<lang>[\w+.-]*)[^\n]*\n(?P<code>.*?)"
    r"(?:^[ \t]*(?P=tick)[ \t]*$(?P<closed>)|\Z)",
    re.DOTALL | re.MULTILINE,
)
_PY_LANGS = {"", "python", "py", "python3", "py3", "ipython", "pycon"}
# Chat special tokens that sometimes survive decoding; everything from the first one on is dropped.
_STOP_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>", "<|end|>")
_CODE_START = re.compile(r"^(\s*)(def |async def |class |import |from \S+ import |@|return\b|if |for |while |\w+\s*=)")
# Calls that mark a top-level statement as example usage rather than part of the solution.
_USAGE_CALLS = {"print", "input", "exit", "quit"}
# How many trailing lines may be dropped to make a snippet parse.
_MAX_TRIMMED_LINES = 200


class Extraction(NamedTuple):
    """Result of :func:`extract_program`: ``(program, status)``."""

    program: str
    status: str

    @property
    def parsed(self) -> bool:
        return self.status != UNPARSEABLE


def extract_program(answer: str, prompt: str, entry_point: str) -> Extraction:
    """Extract a runnable program from a chat answer to a HumanEval prompt.

    Parameters
    ----------
    answer:
        The model's decoded answer (chat style or a raw continuation).
    prompt:
        The HumanEval prompt: imports, any helper functions, and the stub of ``entry_point``.
    entry_point:
        Name of the function the tests call.

    Returns
    -------
    Extraction
        ``(program, status)``; see the module docstring for the statuses. ``program`` always
        parses with :func:`ast.parse` (for ``"unparseable"`` it is the bare prompt).

    Examples
    --------
    >>> answer = "Sure!\\n```python\\ndef inc(x):\\n    return x + 1\\n\\nprint(inc(1))\\n```\\nDone."
    >>> program, status = extract_program(answer, "def inc(x):\\n    '''x + 1'''\\n", "inc")
    >>> status
    'fence/function'
    >>> "print(" in program
    False
    """
    answer = _strip_stop_markers(answer)
    prompt = prompt if prompt.endswith("\n") else prompt + "\n"
    for source, code in _candidates(answer, entry_point):
        result = _assemble(code, prompt, entry_point)
        if result is not None:
            program, shape = result
            return Extraction(program, f"{source}/{shape}")
    return Extraction(prompt, UNPARSEABLE)


def _strip_stop_markers(answer: str) -> str:
    for marker in _STOP_MARKERS:
        cut = answer.find(marker)
        if cut >= 0:
            answer = answer[:cut]
    return answer


def _candidates(answer: str, entry_point: str) -> list[tuple[str, str]]:
    """Code snippets to try, best first, each tagged with where it came from."""
    blocks: list[tuple[str, str]] = []
    for match in _FENCE.finditer(answer):
        if match.group("lang").lower() not in _PY_LANGS:
            continue
        source = "fence" if match.group("closed") is not None else "unclosed_fence"
        blocks.append((source, match.group("code")))
    if blocks:
        defining = [b for b in blocks if _defines(b[1], entry_point)]
        # The last block that defines the entry point is the final version; then the others.
        return list(reversed(defining)) + [b for b in blocks if b not in defining]
    # No fence: the whole answer, then from each of the first lines that look like code.
    lines = answer.splitlines()
    starts = [i for i, line in enumerate(lines) if _CODE_START.match(line)][:3]
    return [("plain", answer)] + [("plain", "\n".join(lines[i:]) + "\n") for i in starts if i > 0]


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def _assemble(code: str, prompt: str, entry_point: str) -> tuple[str, str] | None:
    """Combine one snippet with the prompt, dropping trailing lines that do not parse (prose after
    the code, or a statement cut off by the token limit); ``None`` if nothing works."""
    lines = code.rstrip().splitlines()
    for end in range(len(lines), max(0, len(lines) - _MAX_TRIMMED_LINES), -1):
        result = _assemble_exact("\n".join(lines[:end]) + "\n", prompt, entry_point)
        if result is not None:
            return result
    return None


def _assemble_exact(code: str, prompt: str, entry_point: str) -> tuple[str, str] | None:
    if not code.strip():
        return None
    dedented = textwrap.dedent(code)
    tree = _parse_or_none(dedented)
    if tree is not None:
        if any(_is_def(node, entry_point) for node in tree.body):
            program = prompt + "\n\n" + _keep_definitions(dedented, tree, entry_point)
            if _parses(program):
                return program, "function"
        elif _reads_as_body(code, tree):
            program = prompt + textwrap.indent(dedented, "    ")
            if _parses(program):
                return program, "body"
    # A continuation of the prompt as a base model writes it: starts indented, inside the stub.
    first = next((line for line in code.splitlines() if line.strip()), "")
    if first[:1] in (" ", "\t"):
        program = prompt + code
        if _parses(program) and not _only_stub(program, prompt):
            return program, "completion"
    if tree is not None and any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in tree.body):
        return prompt + "\n\n" + _keep_definitions(dedented, tree, entry_point), "no_entry_point"
    return None


def _parse_or_none(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def _is_def(node: ast.stmt, name: str) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name


def _reads_as_body(code: str, tree: ast.Module) -> bool:
    """A body: it returns at top level, or it was indented like the inside of a function."""
    if any(isinstance(node, ast.Return) for node in _walk_outside_defs(tree)):
        return True
    first = next((line for line in code.splitlines() if line.strip()), "")
    defines_only = all(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
        for n in tree.body
    )
    return first[:1] in (" ", "\t") and not defines_only


def _walk_outside_defs(node: ast.AST):
    """Like :func:`ast.walk`, without descending into function, lambda or class bodies."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _walk_outside_defs(child)


def _only_stub(program: str, prompt: str) -> bool:
    """True if the answer added no statements to the prompt (so 'completion' would be vacuous)."""
    return ast.dump(ast.parse(program)) == ast.dump(ast.parse(prompt))


def _keep_definitions(code: str, tree: ast.Module, entry_point: str) -> str:
    """The solution part of a module: imports, functions, classes and plain assignments.

    Dropped: expressions (``print(...)``, calls, stray docstrings), ``assert``, ``if __name__``
    blocks and other control flow, and assignments that call the entry point or ``print``/``input``
    (``result = f(...)``), i.e. example usage and tests. Comments inside kept definitions survive
    because the kept nodes are copied as source lines.
    """
    lines = code.splitlines()
    kept: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            pass
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            if _calls_any(node, _USAGE_CALLS | {entry_point}):
                continue
        else:
            continue
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        kept.append("\n".join(lines[first - 1 : node.end_lineno]))
    return "\n\n".join(kept) + "\n"


def _calls_any(node: ast.AST, names: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in names:
            return True
    return False
