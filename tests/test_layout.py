"""The package layout: imports only point down the layers, no cycles, old module names deprecated.

Every import of a quickdraft module — at module level, inside a function or under
``TYPE_CHECKING`` — goes to a module in the same layer or one below. Runtime imports (not
``TYPE_CHECKING``) form no cycle. Every old module name imports, with a DeprecationWarning naming
its new place, as the same module object.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from quickdraft import _compat

SRC = Path(__file__).resolve().parents[1] / "src" / "quickdraft"

#: bottom to top: (layer, dotted prefixes under quickdraft; "" is the package's __init__)
LAYERS = [
    ('base', ['errors', '_compat']),  # errors and the deprecation path
    ('verification', ['verification']),  # distributions and acceptance rules: pure, batched functions of probabilities
    ('theory', ['theory']),  # closed forms of acceptance rates and speed-ups
    ('models', ['models']),  # the model registry: install, cache, resolve, load, CPU facts
    ('backends', ['backends']),  # runners that own a model's KV cache (torch, OpenVINO, llama.cpp), kernels, the vLLM plugin
    ('decoding', ['decoding']),  # the decoding loop and everything it drives: proposers, drafters, trees, policies
    ('front', ['methods', 'pipeline']),  # named methods and the text-in/text-out pipeline
    ('adaptive', ['adaptive', 'training']),  # training drafters and draft-length policies, replaying them offline
    ('evaluation', ['evaluation']),  # benchmark data, execution, statistics, the harness and its reports
    ('serve', ['serve']),  # the OpenAI-compatible server
    ('cli', ['cli', 'models_cli', '']),  # the quickdraft command
]


def _layer_of(module: str) -> int:
    rel = module[len("quickdraft."):] if module.startswith("quickdraft.") else ""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if rel == prefix or (prefix and rel.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layout.py")
    return best[0]


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported quickdraft module, line, under TYPE_CHECKING) for every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node, typing_only):
        for child in ast.iter_child_nodes(node):
            tc = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (child.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in child.names]
            else:
                names = []
            for name in names:
                if name.split(".")[0] == "quickdraft":
                    target = _resolve(name)
                    if target and target != module:
                        found.append((target, child.lineno, tc))
            visit(child, tc)

    visit(tree, False)
    return found


def test_every_module_is_in_a_layer():
    for module in MODULES:
        _layer_of(module)


def test_imports_only_point_down():
    upward = []
    for module in sorted(MODULES):
        for target, line, _ in _imports(module):
            if _layer_of(target) > _layer_of(module):
                upward.append(f"{MODULES[module].relative_to(SRC.parent)}:{line}: {module} "
                              f"({LAYERS[_layer_of(module)][0]}) imports {target} ({LAYERS[_layer_of(target)][0]})")
    assert not upward, "imports pointing up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, tc in _imports(m) if not tc}) for m in MODULES}
    cycles, state = [], {}

    def walk(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                walk(nxt, stack)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            walk(module, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("old,new", sorted(_compat.MOVED_MODULES.items()))
def test_old_module_names_are_deprecated_aliases(old, new):
    try:
        module = importlib.import_module(new)
    except ImportError as err:  # an optional dependency of the module itself
        pytest.skip(f"{new}: {err}")
    sys.modules.pop(old, None)
    parent, _, leaf = old.rpartition(".")
    if parent in sys.modules and leaf in vars(sys.modules[parent]):
        delattr(sys.modules[parent], leaf)
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        aliased = importlib.import_module(old)
    assert aliased is module
    assert sys.modules[old] is sys.modules[new]
    assert module.__spec__.name == new  # the alias leaves the module's own spec in place
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # the attribute form, as in `from quickdraft import rules`
        assert getattr(importlib.import_module(parent), leaf) is module


def test_monkeypatching_an_old_name_reaches_the_new_module(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("quickdraft.rules")
    new = importlib.import_module("quickdraft.verification.rules")
    monkeypatch.setattr("quickdraft.rules.Lossless", "patched")
    assert new.Lossless == "patched" and old is new


def test_an_old_module_name_runs_with_python_m():
    done = subprocess.run([sys.executable, "-m", "quickdraft.report", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_moved_attributes_are_deprecated_aliases():
    for module, names in _compat.MOVED_ATTRIBUTES.items():
        for name, new in names.items():
            with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
                value = getattr(importlib.import_module(module), name)
            assert value is getattr(importlib.import_module(new), name)


def test_public_names_at_the_top_level_without_warnings():
    """``from quickdraft import Pipeline, verify_chain`` works, warns nothing, and loads torch only
    when asked for (a fresh interpreter, so the modules are not already imported)."""
    code = ("import sys, warnings; warnings.simplefilter('error'); import quickdraft; "
            "assert 'quickdraft.pipeline' not in sys.modules; "
            "from quickdraft import Pipeline, SamplingParams, verify_chain; "
            "from quickdraft.pipeline import Pipeline as P; from quickdraft.verification.verify import verify_chain as v; "
            "assert Pipeline is P and verify_chain is v; "
            "assert {'Pipeline', 'verify_chain'} <= set(dir(quickdraft))")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        quickdraft_module = importlib.import_module("quickdraft")
        quickdraft_module.not_a_name
