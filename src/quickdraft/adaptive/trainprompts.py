"""Training prompts for the acceptance head, made from the Python standard library's docstrings.

Source
------
The docstrings of public functions and classes of pure-Python standard-library modules (the list
:data:`MODULES`), read with :mod:`inspect` from the running interpreter -- text that ships with
Python itself (PSF licence), needs no download and is the same on every machine with the same
Python version. Each becomes an "implement this" task::

    Implement the Python function `textwrap.dedent(text)`:

    Remove any common leading whitespace from every line in `text`. ...

Every third function becomes an "explain to a beginner" task instead (prose answers, closer to
chat benchmarks than code), and classes become "implement a class with these methods" tasks. Only the docstring's first paragraphs
(at most 600 characters) are used, and docstrings shorter than 60 characters are skipped.

No overlap with the benchmarks
------------------------------
HumanEval's 164 problems are hand-written functions (``has_close_elements``, ``separate_paren_groups``,
...) and MT-Bench's 80 questions are open-ended chat questions; neither is built from standard-library
docstrings. :func:`overlap_report` checks it: no training prompt shares a function name with a
HumanEval entry point, nor any 12-word window with a HumanEval prompt or an MT-Bench turn
(``tests/test_head.py`` runs it when the benchmark packages are installed).
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import warnings

#: Pure-Python standard-library modules whose docstrings become prompts (sorted, deterministic).
MODULES: tuple[str, ...] = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "configparser", "csv", "dataclasses",
    "datetime", "difflib", "email.utils", "filecmp", "fnmatch", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html", "http.cookies", "imaplib",
    "ipaddress", "json", "keyword", "linecache", "locale", "mimetypes", "netrc", "ntpath", "numbers",
    "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "posixpath",
    "pprint", "quopri", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil", "smtplib",
    "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "tokenize",
    "traceback", "types", "typing", "urllib.parse", "uuid", "warnings", "wave", "weakref", "zipfile",
)

#: Function names that are also HumanEval entry points (found by :func:`overlap_report`); skipped.
EXCLUDED_NAMES: frozenset[str] = frozenset({"encode", "search", "median"})

MAX_DOC_CHARS = 600
MIN_DOC_CHARS = 60


def _clean_doc(doc: str) -> str:
    doc = inspect.cleandoc(doc)
    paragraphs = [p.strip() for p in doc.split("\n\n") if p.strip()]
    out = ""
    for p in paragraphs:
        if ">>>" in p:  # keep tasks free of doctest transcripts
            break
        if len(out) + len(p) > MAX_DOC_CHARS and out:
            break
        out = f"{out}\n\n{p}" if out else p
    return out[:MAX_DOC_CHARS].strip()


def _signature(obj) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


MAX_ANSWER_CHARS = 1500


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _pairs_of_module(name: str) -> list[tuple[str, str]]:
    """(task, answer) for every documented public function and class of module ``name``; the
    answer is the standard library's own: the source (implement tasks) or the whole docstring
    (explain tasks), at most :data:`MAX_ANSWER_CHARS` characters."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module missing on this platform is simply skipped
            return []
    pairs: list[tuple[str, str]] = []
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        obj = getattr(module, attr)
        if getattr(obj, "__module__", None) != module.__name__:
            continue  # re-exports appear once, under their home module
        full_doc = inspect.getdoc(obj) if (inspect.isfunction(obj) or inspect.isclass(obj)) else None
        if not full_doc:
            continue
        doc = _clean_doc(full_doc)
        if len(doc) < MIN_DOC_CHARS:
            continue
        if attr in EXCLUDED_NAMES:
            continue
        code = f"```python\n{_source(obj)[:MAX_ANSWER_CHARS]}```"
        if inspect.isfunction(obj) and len(pairs) % 3 == 2:
            pairs.append((
                f"Explain to a beginner, in a short paragraph and one small example, what the Python "
                f"function `{name}.{attr}` does and when to use it. Its documentation says:\n\n{doc}",
                full_doc[:MAX_ANSWER_CHARS]))
        elif inspect.isfunction(obj):
            pairs.append((f"Implement the Python function `{name}.{attr}{_signature(obj)}`:\n\n{doc}", code))
        else:
            methods = [m for m in sorted(vars(obj)) if not m.startswith("_") and inspect.isfunction(getattr(obj, m))][:6]
            listed = f" with the methods {', '.join(f'`{m}`' for m in methods)}" if methods else ""
            pairs.append((f"Write the Python class `{name}.{attr}`{listed}:\n\n{doc}", code))
    return pairs


def task_answer_pairs() -> list[tuple[str, str]]:
    """Every task of :func:`all_tasks` with the standard library's own answer (its source code, or
    for explain tasks its whole docstring): a chat corpus with no generation (the feature drafter's
    training text, :mod:`quickdraft.training.feature_drafter`)."""
    pairs: list[tuple[str, str]] = []
    with warnings.catch_warnings():  # reading deprecated attributes (typing.io, ...) warns
        warnings.simplefilter("ignore")
        for name in MODULES:
            pairs.extend(_pairs_of_module(name))
    return pairs


def all_tasks() -> list[str]:
    """Every task, in module order (491 on CPython 3.11)."""
    return [task for task, _ in task_answer_pairs()]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct tasks, a seeded random sample of :func:`all_tasks` (deterministic)."""
    tasks = all_tasks()
    rng = random.Random(seed)
    rng.shuffle(tasks)
    return tasks[:n]


def _windows(text: str, width: int = 12) -> set[str]:
    words = re.findall(r"\w+", text.lower())
    return {" ".join(words[i:i + width]) for i in range(max(0, len(words) - width + 1))}


def overlap_report(prompts: list[str], benchmark_texts: list[str], entry_points: list[str]) -> list[str]:
    """Descriptions of every overlap between training prompts and benchmark texts (empty = none):
    a shared 12-word window, or a benchmark function name used as a task's function name."""
    bench = set().union(*(_windows(t) for t in benchmark_texts)) if benchmark_texts else set()
    names = set(entry_points)
    problems = []
    for i, p in enumerate(prompts):
        shared = _windows(p) & bench
        if shared:
            problems.append(f"prompt {i} shares {sorted(shared)[0]!r}")
        m = re.search(r"`[\w.]*?\.(\w+)[(`]", p)
        if m and m.group(1) in names:
            problems.append(f"prompt {i} asks for {m.group(1)!r}, a HumanEval entry point")
    return problems
