"""The HTTP app: `create_app(client, settings)` wires routes, edge checks and errors around one EngineClient.

Handlers only translate: protocol models in, engine requests out, engine deltas back to OpenAI (or
/generate) frames. What every route shares lives here too: the inflight gate (429 past the cap,
optional max_tokens downscale under load), the edge middleware (API key, body size, per-route counts),
OpenAI-style error bodies for every failure, and `EngineRun`, which merges n engine streams and
aborts whatever is unfinished when the HTTP side goes away.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl_cli.client import EngineClient
from minisgl_cli.server import protocol as p
from minisgl_cli.server.media import MediaSettings, build_media_router
from minisgl_cli.server.metrics import ServerMetrics
from minisgl_cli.types import Delta, GenerateRequest, RequestStats, new_request_id

log = logging.getLogger("minisgl.server")

DOWNSCALE_HEADER = "X-Minisgl-Max-Tokens-Downscaled"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/generate", "/metrics", "/health")
T = TypeVar("T")


@dataclass
class ServerSettings:
    """What the HTTP front adds on top of the engine (flags/env vars of `minisgl serve`)."""

    api_key: str | None = None
    max_inflight_total: int | None = None  # engine requests at once; None or 0: no cap
    adaptive_max_new_tokens: bool = False
    adaptive_min_tokens: int = 16  # the downscale never cuts below this
    max_body_bytes: int = 4 * 1024 * 1024
    served_model_name: str | None = None  # default: the engine's model name
    retry_after_s: int = 1
    media: MediaSettings | None = None
    extra_model_aliases: tuple[str, ...] = field(default=("default",))


class InputError(Exception):
    """A request the engine cannot serve as given: becomes a 4xx with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers


class Disconnected(Exception):
    pass


# --- admission ---------------------------------------------------------------------------------------
class InflightGate:
    """Counts engine requests in flight (one per choice) and sheds load past the cap.

    Lives on the event loop only, so plain integers suffice.
    """

    def __init__(self, settings: ServerSettings, capacity_hint: int, metrics: ServerMetrics):
        self.cap = settings.max_inflight_total or None
        self.capacity = self.cap or capacity_hint  # what "load" is measured against
        self.adaptive = settings.adaptive_max_new_tokens
        self.min_tokens = settings.adaptive_min_tokens
        self.inflight = 0
        self.metrics = metrics

    def try_acquire(self, n: int) -> bool:
        if self.cap is not None and self.inflight + n > self.cap:
            return False
        self.inflight += n
        self.metrics.add_inflight(n)
        return True

    def release(self, n: int) -> None:
        self.inflight -= n
        self.metrics.add_inflight(-n)

    def downscale(self, requested: int) -> int:
        """Adaptive max_new_tokens: half the budget past 50% load, a quarter past 75%."""
        if not self.adaptive or requested <= self.min_tokens:
            return requested
        load = self.inflight / max(self.capacity, 1)
        factor = 1.0 if load < 0.5 else 0.5 if load < 0.75 else 0.25
        return max(self.min_tokens, int(requested * factor))


# --- engine runs -------------------------------------------------------------------------------------
class EngineRun:
    """n engine requests merged into one stream of (choice index, Delta).

    Each request is pumped by its own task; `close()` cancels the pumps, and a cancelled pump closes
    its `client.submit` stream, which aborts the request and frees its KV. The inflight slots come
    back on close or when the last request ends, whichever is first.
    """

    def __init__(self, client: EngineClient, reqs: list[GenerateRequest], gate: InflightGate,
                 metrics: ServerMetrics, endpoint: str, active: set[EngineRun]):
        self.reqs, self.gate, self.metrics, self.endpoint = reqs, gate, metrics, endpoint
        self.client, self.active = client, active
        active.add(self)
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.open = len(reqs)  # requests not yet finished
        self.chunks = [0] * len(reqs)
        self.finals: list[Delta | None] = [None] * len(reqs)
        self._released = False
        self.closed = False
        self.tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(reqs)]

    async def _pump(self, i: int, req: GenerateRequest) -> None:
        try:
            async for delta in self.client.submit(req):
                self.queue.put_nowait((i, delta))
        except Exception as exc:  # e.g. a tokenizer failure: report it as this choice's error
            self.queue.put_nowait((i, Delta(req.rid, error=str(exc) or type(exc).__name__)))

    async def next(self) -> tuple[int, Delta] | None:
        """The next event, or None once every request has finished."""
        if self.open == 0:
            return None
        i, delta = await self.queue.get()
        if delta.text or delta.token_ids:
            self.chunks[i] += 1
        if delta.finished:
            self.open -= 1
            self.finals[i] = delta
            self._log_finish(i, delta)
            self.metrics.finish(delta.stats, delta.finish_reason if not delta.error else None)
            if self.open == 0:
                self._release()
        return i, delta

    async def collect(self) -> list[tuple[str, Delta]]:
        """Run every request to the end: [(text, final delta)] in choice order."""
        texts = [""] * len(self.reqs)
        while (event := await self.next()) is not None:
            i, delta = event
            texts[i] += delta.text
        return [(texts[i], self.finals[i]) for i in range(len(self.reqs))]

    def close(self) -> None:
        """Abort what is unfinished (client gone, error) and give the inflight slots back."""
        if self.closed:
            return
        self.closed = True
        unfinished = [i for i, f in enumerate(self.finals) if f is None]
        for task in self.tasks:
            task.cancel()
        if unfinished:
            self.metrics.disconnect()
            for i in unfinished:
                self.metrics.finish(None, "abort")
                log.info("rid=%s %s: client gone after %d chunks, aborted (KV freed)",
                         self.reqs[i].rid, self.endpoint, self.chunks[i])
        self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.gate.release(len(self.reqs))
            self.active.discard(self)

    def unfinished_rids(self) -> list[str]:
        return [r.rid for r, f in zip(self.reqs, self.finals) if f is None]

    def _log_finish(self, i: int, d: Delta) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        s = d.stats or RequestStats()
        log.info("rid=%s %s finish=%s prompt_tokens=%d cached_tokens=%d completion_tokens=%d chunks=%d "
                 "ttft=%.0fms latency=%.0fms%s", self.reqs[i].rid, self.endpoint, d.finish_reason,
                 s.prompt_tokens, s.cached_tokens, s.completion_tokens, self.chunks[i], s.ttft_s * 1000,
                 s.latency_s * 1000, f" error={d.error!r}" if d.error else "")


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its EngineRun however the response ends: even when the client
    is gone before the first chunk (the body generator then never starts, so its `finally` never runs)."""

    def __init__(self, run: EngineRun, content: AsyncIterator[str], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def _engine_error(delta: Delta) -> InputError:
    message = delta.error or "unknown engine error"
    if message.startswith("internal error"):
        return InputError(message, status=500, code="engine_error")
    return InputError(message, code="context_length_exceeded" if "context limit" in message else None)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await work, but give up (raise Disconnected) if the client hangs up first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.25)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise Disconnected()
    return task.result()


# --- edge middleware ---------------------------------------------------------------------------------
class EdgeMiddleware:
    """Pure ASGI (streams pass through untouched): API key, body-size cap, per-route status counts."""

    def __init__(self, app: ASGIApp, settings: ServerSettings, metrics: ServerMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ROUTES else "other"
        status_box: list[int] = []

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_box.append(message["status"])
                self.metrics.request(endpoint, message["status"])
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = self.settings.api_key
        if key and path != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                resp = p.error_response(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                                        "authentication_error", None, "invalid_api_key",
                                        headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, counted_send)
                return
        limit = self.settings.max_body_bytes
        too_large = p.error_response(413, f"request body is larger than the limit of {limit} bytes",
                                     "invalid_request_error", None, "request_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await too_large(scope, receive, counted_send)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            # Read the body here (at most limit + 1 bytes) so a chunked upload cannot exceed the cap.
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    await too_large(scope, receive, counted_send)
                    return
                chunks.append(chunk)
                more = message.get("more_body", False)
            body, replayed = b"".join(chunks), False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()  # later reads only ever see the disconnect

            await self.app(scope, replay, counted_send)
            return
        await self.app(scope, receive, counted_send)


# --- errors ------------------------------------------------------------------------------------------
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error"}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts = []
        for e in errors[:3]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return p.error_response(422, f"malformed JSON body: {first.get('msg')}", "invalid_request_error",
                                    None, "json_invalid")
        param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
        return p.error_response(422, "; ".join(parts) or "invalid request", "invalid_request_error", param,
                                first.get("type"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return p.error_response(exc.status_code, str(exc.detail), _ERROR_TYPES.get(exc.status_code, "server_error"),
                                headers=getattr(exc, "headers", None))

    @app.exception_handler(InputError)
    async def input_error(_: Request, exc: InputError) -> JSONResponse:
        kind = _ERROR_TYPES.get(exc.status, "server_error")
        return p.error_response(exc.status, exc.message, kind, exc.param, exc.code, exc.headers)

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return p.error_response(500, f"internal server error: {type(exc).__name__}", "server_error")


# --- the app -----------------------------------------------------------------------------------------
def create_app(client: EngineClient, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    info = client.info
    model_name = settings.served_model_name or info.name
    aliases = {model_name.lower(), info.name.lower(), *(a.lower() for a in settings.extra_model_aliases)}
    metrics = ServerMetrics()
    gate = InflightGate(settings, getattr(client.scheduler, "max_running", 64), metrics)
    vocab = client.engine.model_cfg.vocab_size
    created = p.now()
    active: set[EngineRun] = set()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        # Shutting down with requests in flight: abort them while this loop still takes the scheduler's
        # replies (a reply into a closed loop would break the scheduler thread, which may outlive the app).
        rids = [rid for run in list(active) for rid in run.unfinished_rids()]
        for rid in rids:
            client.abort(rid)
        for run in list(active):
            run.close()
        if rids:
            await run_in_threadpool(client.stats)  # returns once the scheduler has processed the aborts

    app = FastAPI(title="minisgl", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible LLM server over one minisgl engine.")
    app.state.client, app.state.settings, app.state.metrics, app.state.gate = client, settings, metrics, gate
    app.add_middleware(EdgeMiddleware, settings=settings, metrics=metrics)
    _install_error_handlers(app)
    app.include_router(build_media_router(settings.media or MediaSettings.from_env()))

    # --- shared steps of every generation route ---
    def check_model(requested: str | None) -> None:
        if requested and requested.lower() not in aliases:
            raise InputError(f"model {requested!r} does not exist; this server serves {model_name!r}",
                             "model", 404, "model_not_found")

    def tokens_of(prompt: str | list[int] | None = None, messages: list[p.ChatMessage] | None = None,
                  param: str = "prompt") -> list[int]:
        try:
            if messages is not None:
                ids = client.input_ids(GenerateRequest(messages=[m.as_template_dict() for m in messages]))
            elif isinstance(prompt, list):
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise InputError(f"token id {bad[0]} is out of range: the vocabulary has {vocab} tokens", param)
                ids = list(prompt)
            else:
                ids = client.input_ids(GenerateRequest(prompt=prompt or ""))
        except InputError:
            raise
        except Exception as exc:  # template or tokenizer failures are the input's fault here
            raise InputError(f"could not tokenize the {param}: {exc}", param) from exc
        if not ids:
            raise InputError(f"the {param} is empty", param)
        if len(ids) >= info.max_context_len:
            raise InputError(f"the prompt has {len(ids)} tokens; the context limit is {info.max_context_len}",
                             param, code="context_length_exceeded")
        return ids

    def budget(ids_list: list[list[int]], requested: int | None, param: str) -> tuple[int, str | None]:
        """max_new_tokens for the run and the downscale note (None if not applied)."""
        room = info.max_context_len - max(len(ids) for ids in ids_list)
        if requested is None:
            requested = room
        elif requested > room:
            raise InputError(f"{param}={requested} is too large: the prompt has {info.max_context_len - room} "
                             f"tokens and the context limit is {info.max_context_len}, so at most {room} "
                             "new tokens fit", param, code="context_length_exceeded")
        cut = gate.downscale(requested)
        if cut < requested:
            metrics.downscale()
            return cut, f"{requested}->{cut}"
        return requested, None

    def admit(n: int) -> None:
        if not gate.try_acquire(n):
            raise InputError(f"server busy: {gate.inflight} requests in flight (cap {gate.cap}); retry shortly",
                             None, 429, "too_many_requests", {"Retry-After": str(settings.retry_after_s)})

    def start(reqs: list[GenerateRequest], endpoint: str) -> EngineRun:
        admit(len(reqs))
        if log.isEnabledFor(logging.INFO):
            for r in reqs:
                log.info("rid=%s %s admitted: prompt_tokens=%d max_new_tokens=%d temperature=%s inflight=%d",
                         r.rid, endpoint, len(r.input_ids), r.params.max_new_tokens, r.params.temperature,
                         gate.inflight)
        return EngineRun(client, reqs, gate, metrics, endpoint, active)

    async def first_event(run: EngineRun, request: Request) -> tuple[int, Delta] | None:
        """Wait for the first delta before answering, so early engine errors get a real status."""
        try:
            event = await _unless_disconnected(request, run.next())
        except BaseException:
            run.close()
            raise
        if event is not None and event[1].error:
            run.close()
            raise _engine_error(event[1])
        return event

    async def finish_all(run: EngineRun, request: Request) -> list[tuple[str, Delta]]:
        try:
            results = await _unless_disconnected(request, run.collect())
        finally:
            run.close()
        for _, final in results:
            if final is None or final.error:
                raise _engine_error(final or Delta("", error="request ended without a result"))
        return results

    def headers_for(note: str | None) -> dict[str, str]:
        return {DOWNSCALE_HEADER: note} if note else {}

    def stream(run: EngineRun, body: AsyncIterator[str], note: str | None,
               media_type: str = "text/event-stream") -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers_for(note)}
        return EngineStreamingResponse(run, body, media_type=media_type, headers=headers)

    def sse(obj: dict[str, Any] | str) -> str:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"

    def error_frame(delta: Delta) -> dict[str, Any]:
        e = _engine_error(delta)
        return {"error": {"message": e.message, "type": _ERROR_TYPES.get(e.status, "server_error"),
                          "param": e.param, "code": e.code}}

    # --- routes ---
    @app.get("/health", response_model=p.Health, tags=["server"])
    async def health() -> Any:
        thread = getattr(client.scheduler, "_thread", None)
        if thread is not None and not thread.is_alive():
            return p.error_response(503, "the scheduler thread has stopped", "server_error")
        return p.Health()

    @app.get("/v1/models", response_model=p.ModelList, responses=p.ERROR_RESPONSES, tags=["openai"])
    async def models() -> Any:
        return p.ModelList(data=[p.ModelCard(id=model_name, created=created, max_model_len=info.max_context_len)])

    @app.get("/v1/models/{model}", response_model=p.ModelCard, responses=p.ERROR_RESPONSES, tags=["openai"])
    async def model_card(model: str) -> Any:
        check_model(model)
        return p.ModelCard(id=model_name, created=created, max_model_len=info.max_context_len)

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse, responses=p.ERROR_RESPONSES,
              tags=["openai"])
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        ids = tokens_of(messages=body.messages, param="messages")
        max_new, note = budget([ids], body.requested_max_tokens, "max_tokens")
        reqs = [GenerateRequest(input_ids=ids, params=body.sampling_params(max_new, i), rid=new_request_id("chat"))
                for i in range(body.n)]
        run = start(reqs, "/v1/chat/completions")
        cid, ts = p.new_id("chatcmpl"), p.now()
        if not body.stream:
            results = await finish_all(run, request)
            choices = [p.ChatChoice(index=i, message=p.ChatResponseMessage(content=text),
                                    finish_reason=final.finish_reason) for i, (text, final) in enumerate(results)]
            resp = p.ChatCompletionResponse(id=cid, created=ts, model=model_name, choices=choices,
                                            usage=_usage([r[1] for r in results], prompts=1))
            return JSONResponse(resp.model_dump(), headers=headers_for(note))
        first = await first_event(run, request)
        with_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def frames() -> AsyncIterator[str]:
            try:
                for i in range(body.n):
                    yield sse(p.chat_chunk(cid, ts, model_name, i, role=True, content="",
                                           with_usage_field=with_usage))
                event = first
                while event is not None:
                    i, d = event
                    if d.error:
                        yield sse(error_frame(d))
                        break
                    if d.text:
                        yield sse(p.chat_chunk(cid, ts, model_name, i, content=d.text, with_usage_field=with_usage))
                    if d.finish_reason:
                        yield sse(p.chat_chunk(cid, ts, model_name, i, finish_reason=d.finish_reason,
                                               with_usage_field=with_usage))
                    event = await run.next()
                if with_usage:
                    u = _usage([f for f in run.finals if f is not None], prompts=1)
                    yield sse(p.usage_chunk(cid, ts, model_name, "chat.completion.chunk", u))
                yield sse("[DONE]")
            finally:
                run.close()

        return stream(run, frames(), note)

    @app.post("/v1/completions", response_model=p.CompletionResponse, responses=p.ERROR_RESPONSES,
              tags=["openai"])
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise InputError("prompt must not be empty", "prompt")
        ids_list = [tokens_of(prompt=pr, param="prompt") for pr in prompts]
        max_new, note = budget(ids_list, body.max_tokens, "max_tokens")
        # Choice index = prompt index * n + sample index (OpenAI's order).
        reqs = [GenerateRequest(input_ids=ids, params=body.sampling_params(max_new, j), rid=new_request_id("cmpl"))
                for ids in ids_list for j in range(body.n)]
        run = start(reqs, "/v1/completions")
        cid, ts = p.new_id("cmpl"), p.now()
        if not body.stream:
            results = await finish_all(run, request)
            choices = [p.CompletionChoice(index=i, text=text, finish_reason=final.finish_reason)
                       for i, (text, final) in enumerate(results)]
            u = _usage([r[1] for r in results], prompts=len(prompts), n=body.n)
            resp = p.CompletionResponse(id=cid, created=ts, model=model_name, choices=choices, usage=u)
            return JSONResponse(resp.model_dump(), headers=headers_for(note))
        first = await first_event(run, request)
        with_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def frames() -> AsyncIterator[str]:
            try:
                event = first
                while event is not None:
                    i, d = event
                    if d.error:
                        yield sse(error_frame(d))
                        break
                    if d.text or d.finish_reason:
                        yield sse(p.completion_chunk(cid, ts, model_name, i, d.text, d.finish_reason, with_usage))
                    event = await run.next()
                if with_usage:
                    u = _usage([f for f in run.finals if f is not None], prompts=len(prompts), n=body.n)
                    yield sse(p.usage_chunk(cid, ts, model_name, "text_completion", u))
                yield sse("[DONE]")
            finally:
                run.close()

        return stream(run, frames(), note)

    @app.post("/generate", response_model=p.GenerateDone, responses=p.ERROR_RESPONSES, tags=["reference"])
    async def generate(body: p.GenerateBody, request: Request) -> Any:
        given = sum(x is not None for x in (body.prompt, body.messages, body.input_ids))
        if given != 1:
            raise InputError("give exactly one of prompt, messages, input_ids", "prompt")
        if body.messages is not None:
            ids = tokens_of(messages=body.messages, param="messages")
        else:
            ids = tokens_of(prompt=body.prompt if body.prompt is not None else body.input_ids,
                            param="prompt" if body.prompt is not None else "input_ids")
        max_new, note = budget([ids], body.max_new_tokens, "max_new_tokens")
        req = GenerateRequest(input_ids=ids, params=body.sampling_params(max_new), rid=new_request_id("gen"))
        run = start([req], "/generate")
        if not body.stream:
            [(text, final)] = await finish_all(run, request)
            return JSONResponse(_done(final, note, text).model_dump(), headers=headers_for(note))
        first = await first_event(run, request)

        async def lines() -> AsyncIterator[str]:
            try:
                event = first
                while event is not None:
                    _, d = event
                    if d.error:
                        yield json.dumps({"event": "error", **error_frame(d)}) + "\n"
                        break
                    if d.text:
                        yield json.dumps({"text_delta": d.text}, ensure_ascii=False) + "\n"
                    if d.finish_reason:
                        yield _done(d, note).model_dump_json(exclude_none=True) + "\n"
                    event = await run.next()
            finally:
                run.close()

        return stream(run, lines(), note, media_type="application/x-ndjson")

    @app.get("/metrics", tags=["server"], responses={200: {"content": {"text/plain": {}}}})
    async def metrics_route(request: Request, format: str | None = Query(None, pattern="^(json|prometheus)$")) -> Any:
        stats = await run_in_threadpool(client.stats)
        accept = request.headers.get("accept", "")
        prometheus = format == "prometheus" or (
            format is None and "text/plain" in accept and "application/json" not in accept)
        if prometheus:
            return PlainTextResponse(metrics.to_prometheus(stats, model_name),
                                     media_type="text/plain; version=0.0.4; charset=utf-8")
        return metrics.to_json(stats, model_name, gate.cap)

    @app.exception_handler(Disconnected)
    async def disconnected(_: Request, __: Disconnected) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps the logs honest.
        return Response(status_code=499)

    return app


def json_metrics(app: FastAPI) -> dict[str, Any]:
    """The /metrics JSON, from any thread (the ZMQ control channel uses it)."""
    client: EngineClient = app.state.client
    name = app.state.settings.served_model_name or client.info.name
    return app.state.metrics.to_json(client.stats(), name, app.state.gate.cap)


def _usage(finals: list[Delta], prompts: int, n: int = 1) -> p.Usage:
    """Prompt tokens count once per prompt (not per sample); completion tokens sum over choices."""
    stats = [f.stats or RequestStats() for f in finals]
    per_prompt = stats[::n] if n > 1 else stats
    return p.usage(
        prompt_tokens=sum(s.prompt_tokens for s in per_prompt[:prompts]),
        completion_tokens=sum(s.completion_tokens for s in stats),
        cached_tokens=sum(s.cached_tokens for s in per_prompt[:prompts]),
    )


def _done(final: Delta, note: str | None, text: str | None = None) -> p.GenerateDone:
    s = final.stats or RequestStats()
    return p.GenerateDone(
        rid=final.rid, text=text, finish_reason=final.finish_reason, prompt_tokens=s.prompt_tokens,
        cached_tokens=s.cached_tokens, completion_tokens=s.completion_tokens, ttft_ms=round(s.ttft_s * 1000, 3),
        latency_ms=round(s.latency_s * 1000, 3), decode_tok_s=round(s.decode_tok_s, 3),
        max_new_tokens_downscaled=note,
    )
