"""``quickdraft serve``: an OpenAI-compatible HTTP server with continuous batching.

Modules: :mod:`~quickdraft.serve.app` (routes, schemas, errors), :mod:`~quickdraft.serve.scheduler`
(continuous batching over :class:`quickdraft.decoding.engine.Decoder`), :mod:`~quickdraft.serve.settings`
(per-request speculation settings), :mod:`~quickdraft.serve.metrics` (Prometheus),
:mod:`~quickdraft.serve.logs` (JSON logs), :mod:`~quickdraft.serve.server` (uvicorn). Needs the
``serve`` extra: ``pip install -e ".[serve]"``.
"""

from quickdraft.serve.app import ServerConfig, create_app
from quickdraft.serve.settings import ServeDefaults, SpeculativeSettings

__all__ = ["ServerConfig", "ServeDefaults", "SpeculativeSettings", "create_app"]
