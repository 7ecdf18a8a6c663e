"""The OpenAI-compatible HTTP API: routes, request schemas, responses and errors.

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``"stream": true``
streams server-sent events as the OpenAI API does: ``data: {chunk}\\n\\n`` lines, then
``data: [DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus).

Beyond the OpenAI fields a request may carry ``"speculative": {...}``
(:class:`~quickdraft.serve.settings.SpeculativeSettings`) and ``top_k``; every response (and the last
chunk of a stream) carries ``"quickdraft": {...}``, see :func:`quickdraft_field`.

Errors use the OpenAI format ``{"error": {"message", "type", "param", "code"}}``: 400 for a
malformed or invalid request (bad JSON, unknown method, bad threshold, prompt over the context,
empty messages, ...), 404 for an unknown model, 413 for a body over the size limit, 503 while
shutting down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from quickdraft.decoding.policies import CostAware
from quickdraft.errors import QuickdraftError
from quickdraft.verification.sampling import SamplingParams
from quickdraft.serve.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from quickdraft.serve.scheduler import Draining, Job, Scheduler
from quickdraft.serve.settings import ServeDefaults, SpeculativeSettings, build_spec

log = logging.getLogger("quickdraft.serve")


# -- errors ----------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered in the OpenAI format."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_error(err: ValidationError) -> APIError:
    parts, param = [], None
    for e in err.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if not str(x).startswith("function-"))
        param = param or (loc or None)
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return APIError(400, "; ".join(parts), param=param)


# -- request schemas -------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names and defaults)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    speculative: SpeculativeSettings | None = None

    def unsupported(self) -> list[str]:
        bad = []
        if self.presence_penalty:
            bad.append("presence_penalty")
        if self.frequency_penalty:
            bad.append("frequency_penalty")
        if self.logit_bias:
            bad.append("logit_bias")
        return bad


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [name for name, on in (("echo", self.echo), ("suffix", self.suffix), ("logprobs", self.logprobs is not None),
                                      ("best_of", self.best_of not in (None, self.n))) if on]
        return bad


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["logprobs"] if self.logprobs else [])


# -- the server ------------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    """What ``quickdraft serve`` sets besides the speculation defaults.

    Attributes
    ----------
    model_name: the id in ``/v1/models``; requests must name it.
    temperature, top_p, top_k: sampling defaults for requests that omit them.
    max_tokens: default ``max_tokens`` (cut to the room left in the context).
    max_context: most tokens a row may hold (prompt + max_tokens + draft); ``None``: the target's limit.
    max_rows: most rows decoded at once.
    max_body_bytes: request size limit.
    drain_seconds: at shutdown, how long to wait for running requests.
    """

    model_name: str = "quickdraft"
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    max_context: int | None = None
    max_rows: int = 16
    max_body_bytes: int = 1 << 20
    drain_seconds: float = 60.0
    defaults: ServeDefaults = field(default_factory=ServeDefaults)


def quickdraft_field(job: Job) -> dict:
    """The ``"quickdraft"`` object of a response: the speculation settings used and the acceptance
    metrics summed over the request's choices.

    Keys: ``settings`` (method, k, policy, threshold, ...), ``mean_acceptance_length`` (tokens per
    target verification, bonus token included), ``acceptance_rate``, ``drafted_tokens``,
    ``accepted_tokens``, ``lossy_accepted_tokens``, ``steps`` (verifications), ``target_forwards``
    (prefill included), ``draft_forwards``, ``queue_seconds``, ``prefill_seconds``, ``decode_seconds``,
    ``time_to_first_token_seconds``, ``tokens_per_second``, ``choices`` (the per-choice counts).
    """
    m = job.metrics()
    per_choice = []
    for c in job.choices:
        cm = c.metrics
        if cm is None:
            continue
        per_choice.append({
            "index": c.index, "mean_acceptance_length": cm.mean_acceptance_length, "drafted_tokens": cm.drafted_tokens,
            "accepted_tokens": cm.accepted_tokens, "steps": cm.steps, "target_forwards": cm.target_forwards,
        })
    t0 = job.arrival
    return {
        "settings": job.settings.public(),
        "mean_acceptance_length": m.mean_acceptance_length,
        "acceptance_rate": m.acceptance_rate,
        "drafted_tokens": m.drafted_tokens,
        "accepted_tokens": m.accepted_tokens,
        "lossy_accepted_tokens": m.lossy_accepted_tokens,
        "steps": m.steps,
        "target_forwards": m.target_forwards,
        "draft_forwards": m.draft_forwards,
        "queue_seconds": (job.admitted_at - job.prefill_seconds - t0) if job.admitted_at else None,
        "prefill_seconds": job.prefill_seconds,
        "decode_seconds": m.decode_seconds,
        "time_to_first_token_seconds": (job.first_token_at - t0) if job.first_token_at else None,
        "tokens_per_second": m.tokens_per_second,
        "choices": per_choice,
    }


def _usage(job: Job) -> dict:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": job.completion_tokens,
            "total_tokens": job.prompt_tokens + job.completion_tokens}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def measure_costs(pipe, config: ServerConfig, max_rows: int) -> None:
    """Where the server's default policy is the cost policy (``cost``, or ``auto`` for a method whose
    step may be plain), its step costs over batches of up to ``max_rows`` are read from the cost
    cache or measured before the server takes requests, not in the first request's time."""
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k or None)
    spec = build_spec(config.defaults, sampling, None)
    if not isinstance(spec.policy, CostAware):
        return
    pipe.step_costs(spec.policy.max_k, max_rows=max_rows, on_measure=lambda store: log.info(
        "measuring the cost policy's step costs", extra={"fields": {"max_rows": max_rows,
                                                                    "kept_in": str(store.path) if store else None}}))


def create_app(pipe, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI application serving ``pipe`` (a loaded :class:`quickdraft.pipeline.Pipeline`).

    The scheduler thread starts with the application (lifespan) and, at shutdown, finishes the
    requests still running before the process exits.
    """
    config = config or ServerConfig()
    metrics = ServerMetrics()
    scheduler = Scheduler(pipe, max_rows=config.max_rows, metrics=metrics)
    max_context = int(config.max_context or pipe.target.max_positions)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(measure_costs, pipe, config, scheduler.max_rows)
        scheduler.start()
        log.info("server ready", extra={"fields": {"model": config.model_name, "max_rows": scheduler.max_rows,
                                                   "max_context": max_context}})
        yield
        log.info("draining", extra={"fields": scheduler.stats()})
        finished = await asyncio.to_thread(scheduler.drain, config.drain_seconds)
        log.info("stopped", extra={"fields": {"drained": finished}})

    app = FastAPI(title="quickdraft", lifespan=lifespan)
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.state.config = config

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):  # unknown route, wrong method
        kind = "not_found" if err.status_code == 404 else None
        return APIError(err.status_code, str(err.detail), code=kind).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, err: Exception):  # pragma: no cover - a bug
        log.exception("unhandled error")
        return APIError(500, f"internal error: {err}", type="server_error").response()

    app.add_middleware(_AccessLog, metrics=metrics)

    # -- routes ------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        stats = scheduler.stats()
        if stats["draining"]:
            return JSONResponse({"status": "draining", **stats}, status_code=503)
        return {"status": "ok", **stats}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": config.model_name, "object": "model", "created": created, "owned_by": "quickdraft"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await _body(request, config.max_body_bytes))
        prompts = _completion_prompts(pipe, scheduler, req.prompt)
        job = _job(req, prompts, req.max_tokens)
        return await _serve(request, job, req, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _parse(ChatCompletionRequest, await _body(request, config.max_body_bytes))
        messages = []
        for m in req.messages:
            content = m.content if isinstance(m.content, str) or m.content is None else \
                "".join(part.text for part in m.content)
            messages.append({"role": m.role, "content": content or ""})
        try:
            with scheduler.tokenizer_lock:
                ids = pipe.encode_messages(messages)
        except QuickdraftError as err:
            raise APIError(400, str(err), param="messages") from None
        except Exception as err:  # a chat template that rejects the conversation
            raise APIError(400, f"the chat template could not format the messages: {err}", param="messages") from None
        job = _job(req, [ids], req.max_completion_tokens or req.max_tokens)
        return await _serve(request, job, req, chat=True)

    # -- helpers -----------------------------------------------------------------------------------
    def _job(req: _Request, prompts: list[list[int]], max_tokens: int | None) -> Job:
        if req.model != config.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")
        bad = req.unsupported()
        if bad:
            raise APIError(400, f"not supported by this server: {', '.join(bad)}", param=bad[0])
        if any(len(p) == 0 for p in prompts):
            raise APIError(400, "empty prompt: give some text to continue", param="prompt")
        try:
            sampling = SamplingParams(
                temperature=config.temperature if req.temperature is None else req.temperature,
                top_p=config.top_p if req.top_p is None else req.top_p,
                top_k=(config.top_k if req.top_k is None else req.top_k) or None,
            )
            settings = config.defaults.merged(req.speculative)
            spec = build_spec(settings, sampling, req.seed or 0)
        except QuickdraftError as err:
            raise APIError(400, str(err), param="speculative") from None
        if spec.needs_draft and pipe.draft_model is None:
            raise APIError(400, f"method {settings.method!r} needs a draft model; this server has none "
                           "(start it with --draft)", param="speculative.method")
        rows = len(prompts) * req.n
        if rows > scheduler.max_rows:
            raise APIError(400, f"the request needs {rows} rows (prompts x n); this server decodes at most "
                           f"{scheduler.max_rows} at once", param="n")
        if spec.needs_datastore and pipe.datastore is None:
            raise APIError(400, f"method {settings.method!r} retrieves from a datastore; this server has none "
                           "(start it with --datastore PATH)", param="speculative.method")
        try:  # what the rule needs of the models, checked before queueing: cd, scd and FSD's js the
            pipe.ready_rule(spec.rule)  # draft's whole head, lantern the target's token embeddings
        except QuickdraftError as err:
            raise APIError(400, str(err), param="speculative.method") from None
        lookup = scheduler.lookup_k if spec.engine_method in ("ngram_sd", "rest_sd") else 0
        longest_draft = spec.phrase.max_draft if spec.phrase is not None else settings.k
        draft_room = 0 if spec.engine_method == "ar" else max(longest_draft, lookup) + 1
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = min(config.max_tokens, max_context - longest - draft_room)
        if longest + max_tokens + draft_room > max_context or max_tokens < 1:
            raise APIError(
                400, f"this model's maximum context length is {max_context} tokens; the prompt has {longest} "
                f"tokens and the completion asks for {max_tokens} (plus {draft_room} for the draft). Shorten "
                "the prompt or max_tokens.", param="max_tokens" if longest < max_context else "prompt",
                code="context_length_exceeded")
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        if len(stop) > 4 or any(not s for s in stop):
            raise APIError(400, "stop: at most 4 non-empty strings", param="stop")
        return Job(prompts, max_tokens, settings, sampling, n=req.n, stop=stop, seed=req.seed)

    async def _serve(request: Request, job: Job, req: _Request, chat: bool):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job.on_event = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
        try:
            scheduler.submit(job)
        except Draining as err:
            raise APIError(503, str(err), type="server_error", code="shutting_down") from None
        except QuickdraftError as err:
            raise APIError(400, str(err)) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + job.id
        obj = "chat.completion" if chat else "text_completion"
        now = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(job, events, rid, now, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        scheduler.cancel(job)
                        return Response(status_code=499)
                    continue
                if ev[0] == "error":
                    raise APIError(500, ev[1], type="server_error")
                if ev[0] == "done":
                    break
        finally:
            if not job.done.is_set():
                scheduler.cancel(job)
        choices = []
        for c in job.choices:
            if chat:
                choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": None, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason})
        return {"id": rid, "object": obj, "created": now, "model": config.model_name, "system_fingerprint": None,
                "choices": choices, "usage": _usage(job), "quickdraft": quickdraft_field(job)}

    async def _stream(job: Job, events: asyncio.Queue, rid: str, now: int, chat: bool, include_usage: bool):
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": obj, "created": now, "model": config.model_name,
                    "system_fingerprint": None, "choices": [choice]}

        try:
            if chat:
                for c in job.choices:
                    yield _sse(chunk(c.index, None, None, role=True))
            while True:
                ev = await events.get()
                if ev[0] == "delta":
                    yield _sse(chunk(ev[1], ev[2], None))
                elif ev[0] == "finish":
                    yield _sse(chunk(ev[1], None if chat else "", ev[2]))
                elif ev[0] == "error":
                    yield _sse(APIError(500, ev[1], type="server_error").body())
                    return
                elif ev[0] == "done":
                    yield _sse({"id": rid, "object": obj, "created": now, "model": config.model_name,
                                "system_fingerprint": None, "choices": [],
                                "usage": _usage(job) if include_usage else None, "quickdraft": quickdraft_field(job)})
                    yield _sse("[DONE]")
                    return
        finally:  # the client went away (or the stream ended): free the rows
            if not job.done.is_set():
                scheduler.cancel(job)

    return app


def _parse(model: type[BaseModel], body: object):
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise _validation_error(err) from None


async def _body(request: Request, limit: int) -> object:
    """The request's JSON body, within ``limit`` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the limit of {limit} bytes", code="request_too_large")
    data = bytearray()
    async for part in request.stream():
        data += part
        if len(data) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    try:
        body = json.loads(bytes(data))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"malformed JSON body: {err}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _completion_prompts(pipe, scheduler: Scheduler, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "empty prompt: give some text to continue", param="prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p.strip():
                raise APIError(400, "empty prompt: give some text to continue", param="prompt")
            with scheduler.tokenizer_lock:
                out.append(list(pipe.tokenizer(p, add_special_tokens=True)["input_ids"]))
        else:
            if any(t < 0 or t >= pipe.vocab_size for t in p):
                raise APIError(400, f"prompt token ids must be in [0, {pipe.vocab_size})", param="prompt")
            out.append(list(p))
    return out


class _AccessLog:
    """ASGI middleware: one structured log line and one ``quickdraft_requests_total`` count per
    HTTP request (streams are counted when they end)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                        "/metrics") else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
            if endpoint != "/metrics":
                log.info("http", extra={"fields": {"method": scope.get("method"), "path": path,
                                                   "status": status["code"],
                                                   "seconds": round(time.perf_counter() - t0, 4)}})
