"""Continuous batching: one thread steps every running batch in turn; requests join and leave
between steps.

A request (:class:`Job`) becomes ``len(prompts) * n`` rows. It waits in a FIFO queue until the
running rows leave room for it (``max_rows`` in all), then joins the batch of its
:class:`~quickdraft.serve.settings.StepKey` at the next engine step: its rows are appended to that
batch's KV caches and prefilled (:meth:`quickdraft.decoding.engine.Decoder.add_rows`), and from then on every
step of the batch drafts, verifies and commits them with the others. Requests with different
speculation or sampling settings cannot share a step (one rule, one policy and one draft length per
step), so each setting has its own batch and the scheduler steps the batches round-robin. A
request with a ``seed`` at temperature > 0 gets a batch of its own, so that its random draws, and
so its text, are those of the same request served alone — except under ERSD, whose draws are keyed
by (seed, row, position) (:func:`~quickdraft.serve.settings.keyed_draws`): there every request joins
the shared batch with its rows keyed by its own seed (a random one where it gave none), and a seeded
text is still that of the request served alone.

A row leaves its batch when it finishes (EOS, a stop string, ``max_tokens``) or when its client
goes away (:meth:`Scheduler.cancel`); its KV-cache rows are freed at once (a seeded request's own
batch frees its rows when the last one finishes, which keeps its draws those of the request served
alone). An exception inside a
step fails the requests of that batch only; the other batches go on.

Every batch has runners of its own over the pipeline's weights (``sibling``: on torch KV caches of
their own, on OpenVINO an infer request of its own over the one compiled model), so the batches of
different settings take turns step by step. A backend without siblings (llama.cpp) runs one batch
at a time, and one without ``add_rows`` serves one row at a time.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from quickdraft.decoding.engine import Decoder
from quickdraft.errors import QuickdraftError
from quickdraft.decoding.metrics import GenerationMetrics
from quickdraft.verification.sampling import SamplingParams
from quickdraft.serve.metrics import ServerMetrics
from quickdraft.serve.settings import ServeDefaults, StepKey, build_spec, keyed_draws

log = logging.getLogger("quickdraft.serve")

#: an event handed to :attr:`Job.on_event`: ``("delta", choice, text)``, ``("finish", choice, reason)``,
#: ``("done",)`` (every choice finished) or ``("error", message)``
Event = tuple


class Draining(QuickdraftError):
    """The server is shutting down and takes no new requests."""


@dataclass
class Choice:
    """One generated continuation of a request (``n`` per prompt).

    Attributes
    ----------
    index: the OpenAI choice index (``prompt_index * n + j``).
    token_ids: generated token ids (EOS included, stop strings cut).
    text: the text delivered so far; at the end, the whole completion.
    finish_reason: ``"stop"`` (EOS or a stop string), ``"length"``, ``"cancelled"``; ``None`` while running.
    metrics: the row's engine metrics once finished.
    """

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    metrics: GenerationMetrics | None = None


@dataclass
class Job:
    """One request: its prompts (token ids), generation limits and settings, and its results.

    ``on_event`` is called from the scheduler thread (see :data:`Event`); it must not block.
    """

    prompts: list[list[int]]
    max_tokens: int
    settings: ServeDefaults
    sampling: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    on_event: Callable[[Event], None] | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    prefill_seconds: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    cancelled: bool = False
    choices: list[Choice] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    _race_seed: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.choices = [Choice(i) for i in range(len(self.prompts) * self.n)]

    @property
    def rows(self) -> int:
        return len(self.prompts) * self.n

    @property
    def key(self) -> StepKey:
        own = self.seed is not None and not self.sampling.greedy and not keyed_draws(self.settings)
        return StepKey(self.settings, self.sampling, int(self.seed) if own else 0, self.id if own else None)

    @property
    def race_seed(self) -> int:
        """The seed that keys this request's rows in a batch under ERSD: its ``seed``, else one
        drawn for it once."""
        if self.seed is not None:
            return int(self.seed)
        if self._race_seed is None:
            self._race_seed = secrets.randbits(63)
        return self._race_seed

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def metrics(self) -> GenerationMetrics:
        """The engine metrics summed over the choices (prompt tokens counted once per prompt)."""
        total = GenerationMetrics.aggregate([c.metrics for c in self.choices if c.metrics is not None])
        total.prompt_tokens = self.prompt_tokens
        if self.choices and all(c.metrics is not None for c in self.choices):
            total.prefill_seconds = max(c.metrics.prefill_seconds for c in self.choices)
            total.decode_seconds = max(c.metrics.decode_seconds for c in self.choices)
        return total

    def _send(self, event: Event) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a closed event loop: the client is gone
                log.debug("event for job %s dropped", self.id)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to the first occurrence of any stop string."""
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string (not yet streamed)."""
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


@dataclass
class _Batch:
    key: StepKey
    decoder: Decoder
    rows: list[tuple[Job, Choice]] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # characters streamed, per row


class Scheduler:
    """Runs every request through the engine, batching requests that share a step.

    Parameters
    ----------
    pipe:
        The loaded :class:`quickdraft.pipeline.Pipeline`.
    max_rows:
        Most rows decoded at once, over all batches (a request takes ``prompts * n`` rows).
    metrics:
        Where to record Prometheus metrics (a new :class:`ServerMetrics` by default).
    lookup_k:
        Tokens an ``ngram_sd`` lookup step copies.
    """

    def __init__(self, pipe, *, max_rows: int = 16, metrics: ServerMetrics | None = None, lookup_k: int = 8) -> None:
        if max_rows < 1:
            raise QuickdraftError(f"max_rows must be >= 1, got {max_rows}")
        self.pipe = pipe
        self.metrics = metrics or ServerMetrics()
        self.lookup_k = lookup_k
        # every batch gets runners of its own over the pipeline's weights (``sibling``), so batches
        # of different settings take turns; a backend without siblings runs one batch at a time
        self.shared_weights = all(hasattr(r, "sibling") for r in (pipe.target, pipe.draft) if r is not None)
        row_ops = self.shared_weights or hasattr(pipe.target, "add_rows")
        self.max_rows = max_rows if row_ops else 1
        self.eos_ids = pipe.eos_ids()
        self.tokenizer_lock = threading.Lock()
        self._cond = threading.Condition()
        self._waiting: list[Job] = []
        self._batches: dict[StepKey, _Batch] = {}
        self._draining = False
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- public, any thread ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the scheduler thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="quickdraft-scheduler", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; it joins a batch at the next step that has room for its rows."""
        if job.rows > self.max_rows:
            raise QuickdraftError(f"the request needs {job.rows} rows (prompts x n); this server decodes at most "
                                  f"{self.max_rows} at once")
        with self._cond:
            if self._draining:
                raise Draining("the server is shutting down")
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (its client went away): its rows leave their batch before the next step."""
        with self._cond:
            if job.done.is_set():
                return
            job.cancelled = True
            self._cond.notify_all()

    def stats(self) -> dict:
        """Waiting requests, running rows and batches."""
        with self._cond:
            return {
                "waiting": len(self._waiting),
                "running_rows": sum(len(b.rows) for b in self._batches.values()),
                "batches": len(self._batches),
                "draining": self._draining,
            }

    def drain(self, timeout: float | None = None) -> bool:
        """Take no new requests, finish the running and waiting ones, then stop the thread.
        Returns whether everything finished within ``timeout`` seconds."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                with self._cond:
                    self._stop = True
                    self._cond.notify_all()
                return False
        return True

    def decode(self, ids: list[int]) -> str:
        with self.tokenizer_lock:
            return self.pipe.tokenizer.decode(ids, skip_special_tokens=True)

    # -- the scheduler thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._waiting and not self._batches and not self._draining:
                    self._cond.wait()
                if self._stop or (self._draining and not self._waiting and not self._batches):
                    break
                admit = self._take_admissible()
            self._admit_all(admit)
            for batch in list(self._batches.values()):
                try:
                    self._drop_cancelled(batch)
                    if batch.rows:
                        self._step(batch)
                    self._retire(batch)
                except Exception as err:  # a bug in this batch's bookkeeping: fail its requests, keep serving
                    log.exception("batch failed")
                    for job in {id(j): j for j, _ in batch.rows}.values():
                        self._fail(job, f"generation failed: {err}")
                    with self._cond:
                        self._batches.pop(batch.key, None)
            self._gauges()
        for job in self._waiting + [j for b in self._batches.values() for j, _ in b.rows]:
            self._fail(job, "the server stopped before the request finished")

    def _take_admissible(self) -> list[Job]:
        """Pop the waiting jobs that fit now, in arrival order (the first that does not fit blocks
        the ones behind it, so a big request is not starved). Cancelled ones are dropped."""
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            job.finished_at = time.monotonic()
            job.done.set()
        used = sum(len(b.rows) for b in self._batches.values())
        keys = set(self._batches)
        admit = []
        while self._waiting:
            job = self._waiting[0]
            if used + job.rows > self.max_rows:
                break
            if not self.shared_weights and keys and job.key not in keys:
                break  # one cache: one batch at a time
            admit.append(self._waiting.pop(0))
            used += job.rows
            keys.add(job.key)
        self.metrics.queue_depth.set(len(self._waiting))
        return admit

    def _new_batch(self, key: StepKey) -> _Batch:
        pipe = self.pipe
        spec = build_spec(key.settings, key.sampling, key.seed)
        if self.shared_weights:
            target = pipe.target.sibling()
            draft = pipe.draft.sibling() if pipe.draft is not None else None
        else:
            target, draft = pipe.target, pipe.draft
        method = spec.engine_method
        if draft is None and spec.needs_draft:
            raise QuickdraftError(f"method {key.settings.method!r} needs a draft model; this server has none")
        drafter = pipe.drafter_for(method, lookup_k=self.lookup_k, draft=draft, phrase=spec.phrase)
        batch = _Batch(key, None)  # type: ignore[arg-type]
        batch.decoder = Decoder(
            target, [], method=method, drafter=drafter, rule=pipe.ready_rule(spec.rule),
            policy=pipe.ready_policy(spec.policy, method, max_rows=self.max_rows), sampling=key.sampling,
            seed=key.seed, eos_token_ids=self.eos_ids, stop=lambda row, ids: self._stop_cut(batch, row, ids),
        )
        return batch

    def _stop_cut(self, batch: _Batch, row: int, tokens: list[int]) -> int | None:
        stop = batch.rows[row][0].stop
        if not stop or not any(s in self.decode(tokens) for s in stop):
            return None
        for j in range(1, len(tokens) + 1):  # fewest tokens whose text holds a stop string
            if any(s in self.decode(tokens[:j]) for s in stop):
                return j
        return len(tokens)

    def _admit_all(self, jobs: list[Job]) -> None:
        """Admit ``jobs``: those of one batch key join it with one prefill forward; if that fails,
        each joins alone, so that only a job that cannot start fails."""
        live = []
        for job in jobs:
            if job.cancelled:
                job.finished_at = time.monotonic()
                job.done.set()
            else:
                live.append(job)
        groups: dict[StepKey, list[Job]] = {}
        for job in live:
            groups.setdefault(job.key, []).append(job)
        for group in groups.values():
            if not self._admit(group) and len(group) > 1:
                for job in group:
                    self._admit([job])

    def _admit(self, jobs: list[Job]) -> bool:
        """Append the rows of ``jobs`` (one batch key) to their batch and prefill them; on an error
        the batch is left as it was, a lone job fails, and ``False`` is returned."""
        key = jobs[0].key
        t0 = time.monotonic()
        batch = self._batches.get(key)
        try:
            if batch is None:
                batch = self._new_batch(key)
            prompts = [p for job in jobs for p in job.prompts for _ in range(job.n)]
            budgets = [job.max_tokens for job in jobs for _ in range(job.rows)]
            rows_before = len(batch.rows)
            batch.rows += [(job, c) for job in jobs for c in job.choices]  # the stop callback reads them
            batch.sent += [0] * len(prompts)
            keyed = {}
            if keyed_draws(key.settings) and not key.sampling.greedy:  # each row keyed by its request
                keyed = dict(seeds=[job.race_seed for job in jobs for _ in range(job.rows)],
                             row_ids=[i for job in jobs for i in range(job.rows)])
            try:
                batch.decoder.add_rows(prompts, budgets, **keyed)
            except Exception:
                del batch.rows[rows_before:], batch.sent[rows_before:]
                raise
        except Exception as err:
            if len(jobs) > 1:
                log.warning("a joint prefill failed (%s); admitting its requests one by one", err)
                return False
            log.exception("request %s could not join a batch", jobs[0].id)
            self._fail(jobs[0], f"could not start the request: {err}")
            return False
        with self._cond:
            self._batches[key] = batch
        now = time.monotonic()
        for job in jobs:
            job.admitted_at = now
            job.prefill_seconds = now - t0
        self._collect(batch, range(rows_before, len(batch.rows)), now)  # the prefill's first tokens
        for job in jobs:
            self.metrics.prompt_tokens.inc(job.prompt_tokens)
            log.info("request admitted", extra={"fields": {
                "request_id": job.id, "rows": job.rows, "prompt_tokens": job.prompt_tokens,
                "queued_s": round(t0 - job.arrival, 4), "batch_rows": len(batch.rows),
                "method": job.settings.method}})
        return True

    def _step(self, batch: _Batch) -> None:
        decoder = batch.decoder
        try:
            decoder.step()
        except Exception as err:
            log.exception("a step failed; failing the %d rows of its batch", len(batch.rows))
            for job in {id(j): j for j, _ in batch.rows}.values():
                self._fail(job, f"generation failed: {err}")
            batch.rows.clear()
            return
        self._collect(batch, range(len(batch.rows)), time.monotonic())

    def _collect(self, batch: _Batch, rows: range, now: float) -> None:
        """Take the new tokens of ``rows`` (after a step, or a prefill that emitted their first
        tokens): stream them and finish the rows that stopped."""
        decoder = batch.decoder
        active = decoder.active.tolist()
        for row in rows:
            job, choice = batch.rows[row]
            if choice.finish_reason is not None:  # finished at its prefill, retired after this step
                continue
            ids = decoder.new_ids[row]
            gained = len(ids) - len(choice.token_ids)
            if gained > 0 and job.first_token_at is None:
                job.first_token_at = now
                self.metrics.ttft.observe(now - job.arrival)
            self.metrics.record_tokens(max(0, gained))
            choice.token_ids = list(ids)
            self._stream(batch, row, final=not active[row])
            if not active[row]:
                choice.finish_reason = "length" if decoder.finish[row] == "length" else "stop"
                self._finish_row(job, choice, decoder.metrics[row], now)

    def _stream(self, batch: _Batch, row: int, final: bool) -> None:
        job, choice = batch.rows[row]
        text = cut_at_stop(self.decode(choice.token_ids), job.stop)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next tokens
                return
            text = text[: len(text) - held_back(text, job.stop)]
        choice.text = text
        if len(text) > batch.sent[row]:
            job._send(("delta", choice.index, text[batch.sent[row]:]))
            batch.sent[row] = len(text)

    def _finish_row(self, job: Job, choice: Choice, m: GenerationMetrics, now: float) -> None:
        m.new_tokens = len(choice.token_ids)
        m.prefill_seconds = job.prefill_seconds
        m.decode_seconds = now - (job.admitted_at or now)
        choice.metrics = m
        self.metrics.record_finished_row(m)
        if choice.finish_reason != "cancelled":
            job._send(("finish", choice.index, choice.finish_reason))
        if all(c.finish_reason is not None for c in job.choices):
            job.finished_at = now
            self.metrics.duration.observe(now - job.arrival)
            jm = job.metrics()
            log.info("request finished", extra={"fields": {
                "request_id": job.id, "finish": [c.finish_reason for c in job.choices],
                "prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
                "seconds": round(now - job.arrival, 4), "method": job.settings.method,
                "mean_acceptance_length": round(jm.mean_acceptance_length, 3)}})
            job.done.set()
            job._send(("done",))

    def _drop_cancelled(self, batch: _Batch) -> None:
        now = time.monotonic()
        for row, (job, choice) in enumerate(batch.rows):
            if job.cancelled and choice.finish_reason is None:
                choice.finish_reason = "cancelled"
                choice.token_ids = list(batch.decoder.new_ids[row])
                self._finish_row(job, choice, batch.decoder.metrics[row], now)
        if any(j.cancelled for j, _ in batch.rows):
            log.info("rows freed", extra={"fields": {
                "request_ids": sorted({j.id for j, _ in batch.rows if j.cancelled}), "reason": "cancelled"}})

    def _retire(self, batch: _Batch) -> None:
        """Remove the finished and cancelled rows; drop the batch once it is empty. A seeded
        request's own batch keeps its finished rows (inactive) until all are done: every step draws
        its random numbers for the whole batch, so removing a row would change the others' draws,
        and the text would no longer be that of the request served alone."""
        gone = [r for r, (_, c) in enumerate(batch.rows) if c.finish_reason is not None]
        if batch.key.owner is not None and len(gone) < len(batch.rows):
            return
        if gone and len(gone) < len(batch.rows):
            batch.decoder.remove_rows(gone)
            batch.decoder.compact()
        if gone:
            keep = [r for r in range(len(batch.rows)) if r not in set(gone)]
            batch.rows = [batch.rows[r] for r in keep]
            batch.sent = [batch.sent[r] for r in keep]
        if not batch.rows:  # its caches go with it (a backend's own runners are reset by the next batch)
            with self._cond:
                self._batches.pop(batch.key, None)

    def _fail(self, job: Job, message: str) -> None:
        if job.done.is_set():
            return
        job.error = message
        job.finished_at = time.monotonic()
        job.done.set()
        job._send(("error", message))

    def _gauges(self) -> None:
        self.metrics.running_rows.set(sum(len(b.rows) for b in self._batches.values()))
        self.metrics.batches.set(len(self._batches))
