"""Prometheus metrics of the server, on a registry of its own (served at ``/metrics``).

=============================================  =========  ===================================================
name                                           type       meaning
=============================================  =========  ===================================================
``quickdraft_requests_total{endpoint,status}``  counter    finished HTTP requests by endpoint and status code
``quickdraft_prompt_tokens_total``             counter    prompt tokens of admitted requests
``quickdraft_completion_tokens_total``         counter    tokens generated
``quickdraft_drafted_tokens_total``            counter    draft tokens proposed to the verifier
``quickdraft_accepted_tokens_total``           counter    draft tokens accepted
``quickdraft_verify_steps_total``              counter    row-steps (one row in one target forward)
``quickdraft_tokens_per_second``               gauge      tokens generated per second over the last 10 s
``quickdraft_mean_acceptance_length``          gauge      emitted tokens per row-step since start (bonus incl.)
``quickdraft_queue_depth``                     gauge      requests waiting for a batch slot
``quickdraft_running_rows``                    gauge      rows being decoded
``quickdraft_batches``                         gauge      batches (one per speculation setting) being stepped
``quickdraft_time_to_first_token_seconds``     histogram  from arrival to the first generated token
``quickdraft_request_duration_seconds``        histogram  from arrival to the last token
=============================================  =========  ===================================================
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from quickdraft.decoding.metrics import GenerationMetrics

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The server's counters and gauges; thread-safe (the scheduler thread and the HTTP handlers
    both record).

    Parameters
    ----------
    window:
        Seconds over which ``quickdraft_tokens_per_second`` counts tokens.
    """

    def __init__(self, window: float = 10.0) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("quickdraft_requests", "Finished HTTP requests.", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("quickdraft_prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.completion_tokens = Counter("quickdraft_completion_tokens", "Tokens generated.", registry=r)
        self.drafted_tokens = Counter("quickdraft_drafted_tokens", "Draft tokens proposed.", registry=r)
        self.accepted_tokens = Counter("quickdraft_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.steps = Counter("quickdraft_verify_steps", "Row-steps (one row in one target forward).", registry=r)
        self.tokens_per_second = Gauge(
            "quickdraft_tokens_per_second", f"Tokens generated per second over the last {window:g} s.", registry=r)
        self.mean_acceptance_length = Gauge(
            "quickdraft_mean_acceptance_length", "Emitted tokens per row-step since start (bonus token included).",
            registry=r)
        self.queue_depth = Gauge("quickdraft_queue_depth", "Requests waiting for a batch slot.", registry=r)
        self.running_rows = Gauge("quickdraft_running_rows", "Rows being decoded.", registry=r)
        self.batches = Gauge("quickdraft_batches", "Batches (speculation settings) being stepped.", registry=r)
        self.ttft = Histogram("quickdraft_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("quickdraft_request_duration_seconds", "Arrival to last token.",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.tokens_per_second.set_function(self._rate)
        self._window = window
        self._recent: deque[tuple[float, int]] = deque()
        self._emitted = 0
        self._steps = 0
        self._lock = threading.Lock()

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - self._window:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / self._window

    def record_tokens(self, n: int) -> None:
        """``n`` tokens were generated just now."""
        if n <= 0:
            return
        self.completion_tokens.inc(n)
        with self._lock:
            self._recent.append((time.monotonic(), n))

    def record_finished_row(self, m: GenerationMetrics) -> None:
        """Add a finished (or cancelled) row's speculation counts."""
        self.drafted_tokens.inc(m.drafted_tokens)
        self.accepted_tokens.inc(m.accepted_tokens)
        self.steps.inc(m.steps)
        with self._lock:
            self._emitted += m.emitted_tokens
            self._steps += m.steps
            if self._steps:
                self.mean_acceptance_length.set(self._emitted / self._steps)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)
