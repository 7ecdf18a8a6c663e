"""quickdraft: speculative decoding for Hugging Face causal language models.

The public names load lazily (``quickdraft.Pipeline`` imports torch and transformers only when
used): :class:`Pipeline`, :func:`verify_chain`, and the packages :mod:`quickdraft.verification`
(acceptance rules, sampling), :mod:`quickdraft.decoding` (the engine), :mod:`quickdraft.theory`.
"""

import importlib

from quickdraft.errors import QuickdraftError
from quickdraft.verification.sampling import SamplingParams
from quickdraft import _compat

__version__ = "0.1.0"

#: public name -> the module that defines it
_LAZY = {
    "Pipeline": "quickdraft.pipeline",
    "verify_chain": "quickdraft.verification.verify",
}

__all__ = ["Pipeline", "QuickdraftError", "SamplingParams", "verify_chain", "__version__"]

# the old module names (quickdraft.rules, quickdraft.engine, ...) as deprecated aliases
_compat.install()


def __getattr__(name: str):
    """The lazy public names; the old module names (``quickdraft.rules`` …) as deprecated aliases."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    return _compat.moved_module(name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
