"""Run the server with uvicorn (``quickdraft serve``)."""

from __future__ import annotations

import uvicorn

from quickdraft.serve.app import ServerConfig, create_app
from quickdraft.serve.logs import configure_logging


def run_server(pipe, config: ServerConfig, *, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "info") -> None:
    """Serve ``pipe`` on ``host:port`` until SIGINT / SIGTERM.

    On the signal uvicorn stops accepting connections and waits for the requests in flight; the
    application's shutdown then drains the scheduler (up to ``config.drain_seconds``).
    """
    configure_logging(log_level)
    app = create_app(pipe, config)
    uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_config=None, access_log=False, log_level=log_level,
        timeout_graceful_shutdown=config.drain_seconds,
    )).run()
