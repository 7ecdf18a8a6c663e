"""The deprecation path for modules that moved into the layered packages.

``import quickdraft.rules`` (and every other old name in :data:`MOVED_MODULES`) still works: the
import system hands back the module at its new place, ``quickdraft.verification.rules`` — the same
module object, so ``isinstance`` checks and monkeypatching through either name agree — and warns
with a :class:`DeprecationWarning` naming the new path. Attributes that moved out of a module that
stayed are in :data:`MOVED_ATTRIBUTES`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings

#: old module name -> new module name
MOVED_MODULES: dict[str, str] = {
    "quickdraft.sampling": "quickdraft.verification.sampling",
    "quickdraft.divergences": "quickdraft.verification.divergences",
    "quickdraft.race": "quickdraft.verification.race",
    "quickdraft.rules": "quickdraft.verification.rules",
    "quickdraft.verify": "quickdraft.verification.verify",
    "quickdraft.multidraft": "quickdraft.verification.multidraft",
    "quickdraft.multidraft_proposals": "quickdraft.verification.multidraft_proposals",
    "quickdraft.multidraft_verifiers": "quickdraft.verification.multidraft_verifiers",
    "quickdraft.runner": "quickdraft.backends.runner",
    "quickdraft.packed": "quickdraft.backends.packed",
    "quickdraft.quant": "quickdraft.backends.quant",
    "quickdraft.int8kernel": "quickdraft.backends.int8kernel",
    "quickdraft.integrations.vllm_plugin": "quickdraft.backends.vllm_plugin",
    "quickdraft.integrations": "quickdraft.backends",
    "quickdraft.engine": "quickdraft.decoding.engine",
    "quickdraft.proposals": "quickdraft.decoding.proposals",
    "quickdraft.drafters": "quickdraft.decoding.drafters",
    "quickdraft.policies": "quickdraft.decoding.policies",
    "quickdraft.head": "quickdraft.decoding.head",
    "quickdraft.metrics": "quickdraft.decoding.metrics",
    "quickdraft.tree": "quickdraft.decoding.tree",
    "quickdraft.tree_decoding": "quickdraft.decoding.tree_decoding",
    "quickdraft.tree_shapes": "quickdraft.decoding.tree_shapes",
    "quickdraft.phrase": "quickdraft.decoding.phrase",
    "quickdraft.retrieval": "quickdraft.decoding.retrieval",
    "quickdraft.contrastive": "quickdraft.decoding.contrastive",
    "quickdraft.amusd": "quickdraft.decoding.amusd",
    "quickdraft.headtrain": "quickdraft.adaptive.headtrain",
    "quickdraft.trainprompts": "quickdraft.adaptive.trainprompts",
    "quickdraft.replay": "quickdraft.adaptive.replay",
    "quickdraft.datasets": "quickdraft.evaluation.datasets",
    "quickdraft.extract": "quickdraft.evaluation.extract",
    "quickdraft.sandbox": "quickdraft.evaluation.sandbox",
    "quickdraft.quality": "quickdraft.evaluation.quality",
    "quickdraft.bench": "quickdraft.evaluation.bench",
    "quickdraft.report": "quickdraft.evaluation.report",
    "quickdraft.anchors": "quickdraft.evaluation.anchors",
    "quickdraft.analyze": "quickdraft.evaluation.analyze",
}

#: module -> {attribute: module that now defines it}
MOVED_ATTRIBUTES: dict[str, dict[str, str]] = {
    "quickdraft.models": {"models_app": "quickdraft.models_cli"},
}


def _stacklevel() -> int:
    """The stack level of the code that used the old name: the first frame outside the import
    system, this module and the ``__getattr__`` hooks that call it."""
    frame, level = sys._getframe(2), 2
    while frame is not None:
        filename = frame.f_code.co_filename
        internal = "importlib" in filename and "_bootstrap" in filename  # warnings.warn skips these
        ours = (frame.f_globals.get("__name__") == __name__ or filename == importlib.__file__
                or (frame.f_code.co_name == "__getattr__" and frame.f_globals.get("__name__", "").startswith("quickdraft")))
        if not (internal or ours):
            break
        level += 0 if internal else 1
        frame = frame.f_back
    return level


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: import {new}", DeprecationWarning, stacklevel=_stacklevel())


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new place."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec):
        _warn(spec.name, self.new)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # the import system set the alias's spec on the shared module: give it back its own
        module.__spec__ = self.spec

    def get_code(self, fullname):
        """The new module's code, for ``python -m quickdraft.<old name>``."""
        _warn(fullname, self.new)
        return importlib.util.find_spec(self.new).loader.get_code(self.new)


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        new = MOVED_MODULES.get(fullname)
        if new is None:
            return None
        # the new module's file as origin (``python -m`` takes it for argv[0]); has_location stays
        # False, so the import system does not write it over the module's __file__
        spec = importlib.util.find_spec(new)
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new), origin=spec.origin)


def install() -> None:
    """Put the alias finder first on ``sys.meta_path`` (once)."""
    if not any(type(f).__name__ == "_AliasFinder" and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


def moved_module(name: str):
    """``quickdraft.<name>`` for a moved module name (the package's ``__getattr__``)."""
    if f"quickdraft.{name}" in MOVED_MODULES:
        return importlib.import_module(f"quickdraft.{name}")
    raise AttributeError(f"module 'quickdraft' has no attribute {name!r}")


def moved_attribute(module: str, name: str):
    """An attribute that moved out of ``module`` (that module's ``__getattr__``)."""
    new = MOVED_ATTRIBUTES.get(module, {}).get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{new}.{name}")
    return getattr(importlib.import_module(new), name)
