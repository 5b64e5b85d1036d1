"""`minisgl router`: one OpenAI-compatible endpoint in front of several `minisgl serve` workers (other hosts).

Each request is routed by its prompt text (rr | fsfs | random | cache_aware, dispatch.py) and proxied as it
came; the worker's response comes back as the worker writes it, so the OpenAI API and /generate are the
same for clients. A request goes to another worker (MAX_TRIES workers at most) only while its worker cannot
have run it: it could not be reached, or it answered 503 / `engine_unavailable` (starting, or its engine gone).
One whose worker took it and then failed (the connection dropped, or nothing came for --request-timeout) is
never replayed: it may be what broke the worker. The client gets a 502 / 504 (a started stream: an error frame in
the stream's own format), the worker a failure; FAILURES_OUT in a row take it out (workers.py). A client that
hangs up closes the worker's request too, so the worker aborts it. Caps answer 429 + Retry-After, like `serve`'s.
/health and /metrics (each worker and the total) are the router's own.

This app is one router process; `minisgl router --processes N` runs N of them on one port (processes.py), each
routing on its own, their figures shared through a `Tally` so that /metrics from any of them is the whole router's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Hashable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Query, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from minisgl_cli.api import protocol as p
from minisgl_cli.api.prometheus import escape_label, prometheus_family
from minisgl_cli.dispatch import Busy, NoReplica
from minisgl_cli.router.connections import KeptConnections
from minisgl_cli.router.tally import ProcessFigures, Tally
from minisgl_cli.router.workers import Worker, Workers

log = logging.getLogger("minisgl.router")

WORKER_HEADER = "X-Minisgl-Worker"  # which worker answered (every proxied response)
KEEPALIVE_S = 4.0  # idle connections to a worker are closed after this (under uvicorn's 5 s)
CONNECT_TIMEOUT_S = 5.0
MAX_TRIES = 3  # workers one request is offered to at most (each once): a bound however many are failing
# On the router's 502 / 504: the request may be what broke its worker, so the OpenAI SDKs (which retry a 5xx by
# default) are told not to replay it either.
NO_REPLAY = {"X-Should-Retry": "false"}
# Hop-by-hop headers, and what the proxy sets itself, are not passed on.
_DROP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer",
                   "upgrade", "accept-encoding", "content-encoding"})


def routing_key(body: bytes) -> Sequence[Hashable] | None:
    """What cache_aware matches a request by: its messages as text, its prompt (the first of a batch), or its
    token ids; None when the body has none of them."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    messages = data.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role', '')}\n{_text(m.get('content'))}\n" for m in messages
                       if isinstance(m, dict)) or None
    for name in ("prompt", "text", "input_ids"):
        value = data.get(name)
        if isinstance(value, list) and value and isinstance(value[0], str | list):
            value = value[0]
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return tuple(value)
    return None


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their text
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _lost_error(w: Worker, exc: httpx.TransportError, timeout_s: float | None) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI error of a request its worker took and then failed: nothing came back for the
    read timeout (504), or the connection dropped (502)."""
    if isinstance(exc, httpx.TimeoutException):
        return 504, {"message": f"worker {w.url} sent nothing for {timeout_s or 0:g} s (--request-timeout); the "
                                "request is not retried on another worker (it may be what hangs this one)",
                     "type": "server_error", "param": None, "code": "worker_timeout"}
    return 502, {"message": f"worker {w.url} failed while handling this request ({type(exc).__name__}); it is not "
                            "retried on another worker (it may be what broke this one)",
                 "type": "server_error", "param": None, "code": "worker_failed"}


def _engine_unavailable(content: bytes) -> bool:
    """Whether a worker's error body says its engine is unavailable (a 5xx a request that never ran gets)."""
    try:
        error = json.loads(content).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == "engine_unavailable"


async def _hang_up(receive: Receive) -> None:
    """Return once the client hangs up (its body already read: the next message is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Relay:
    """One worker response being streamed to the client: whole frames only, and an error frame if the worker
    dies or stalls mid-stream. `close` (however the response ends) frees the worker's slot and the connection."""

    def __init__(self, proxy: Proxy, resp: httpx.Response, worker: Worker):
        self.proxy, self.resp, self.worker = proxy, resp, worker
        self.sse = resp.headers.get("content-type", "").startswith("text/event-stream")
        self._closed = False

    async def frames(self) -> AsyncIterator[bytes]:
        """The worker's bytes as they came (never decoded or re-encoded), cut only at frame ends."""
        sep = b"\n\n" if self.sse else b"\n"
        buf = b""
        try:
            async for chunk in self.resp.aiter_raw():
                if not buf and chunk.endswith(sep):  # the common case: the worker wrote whole frames
                    yield chunk
                    continue
                head, found, buf = (buf + chunk).rpartition(sep)
                if found:
                    yield head + found
            if buf:
                yield buf
        except httpx.TransportError as exc:  # a partial frame in `buf` is dropped: the error frame follows whole
            self.proxy.workers.failed(self.worker, f"failed while streaming: {type(exc).__name__}")
            _, error = _lost_error(self.worker, exc, self.proxy.request_timeout)
            yield (f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n" if self.sse
                   else json.dumps({"event": "error", "error": error}) + "\n").encode()
        finally:
            await self.close()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.proxy.release(self.worker)
            await self.resp.aclose()


class _RelayResponse(StreamingResponse):
    """Closes its relay however the response ends, even when the client left before the first frame."""

    def __init__(self, relay: _Relay, **kwargs: Any):
        super().__init__(relay.frames(), **kwargs)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


class Proxy:
    """Forwards a request to a worker the router picks, retrying on another while the worker cannot have run it."""

    def __init__(self, workers: Workers, total_cap: int | None, tally: Tally, retry_after_s: int = 1,
                 request_timeout: float | None = None):
        self.workers, self.total_cap, self.tally, self.retry_after_s = workers, total_cap, tally, retry_after_s
        self.request_timeout = request_timeout  # seconds the worker may send nothing (None: no limit)
        self.inflight = 0
        self.http: httpx.AsyncClient | None = None  # opened by the app's lifespan

    def release(self, w: Worker) -> None:
        self.inflight -= 1
        self.workers.done(w)
        self._publish()

    def _publish(self) -> None:
        self.tally.write(self.inflight, self.workers.dispatcher.routed, self.workers.dispatcher.load)

    def _busy(self, message: str) -> Response:
        return p.error_response(429, message, "rate_limit_error", None, "too_many_requests",
                                {"Retry-After": str(self.retry_after_s)})

    async def forward(self, request: Request) -> Response:
        """The worker's response, or the router's own error; if the client hangs up first, the request to the worker
        is closed (the worker aborts it) and the answer is a 499 nobody reads."""
        body = await request.body()
        if self.total_cap and self.inflight >= self.total_cap:
            return self._busy(f"server busy: {self.inflight} requests in flight (cap {self.total_cap}); retry shortly")
        exchange = asyncio.ensure_future(self._exchange(request, body))
        gone = asyncio.ensure_future(_hang_up(request.receive))
        try:
            await asyncio.wait({exchange, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not exchange.done():  # cancelled, it closes its connection to the worker: the worker sees the hang-up
                exchange.cancel()
                await asyncio.wait({exchange})
        if exchange.cancelled():
            log.info("minisgl router: %s %s: the client hung up before the answer; closed at the worker",
                     request.method, request.url.path)
            return Response(status_code=499)  # nginx's "client closed request", for the logs
        return exchange.result()

    async def _exchange(self, request: Request, body: bytes) -> Response:
        assert self.http is not None
        # Only cache_aware matches prompts: the other modes never parse the body.
        key = routing_key(body) if body and self.workers.dispatcher.mode == "cache_aware" else None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP]
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: set[int] = set()
        failures: list[str] = []
        while len(tried) < MAX_TRIES:
            try:
                w = self.workers.pick(key, tried)
            except Busy as exc:
                return self._busy(str(exc))
            except NoReplica as exc:
                return self._no_worker(f"{exc}: " + "; ".join(
                    failures or [f"{x.url}: {x.reason}" for x in self.workers.workers]))
            tried.add(w.index)
            self.inflight += 1
            self._publish()
            relayed = False
            try:
                try:
                    resp = await self.http.send(self.http.build_request(
                        request.method, w.url + target, headers=headers, content=body), stream=True)
                except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never sent: another worker takes it
                    failures.append(f"{w.url}: {type(exc).__name__}")
                    self.workers.failed(w, f"unreachable: {type(exc).__name__}")
                    continue
                except httpx.TransportError as exc:  # sent, then dropped or timed out: never replayed
                    return self._lost(w, exc)
                if resp.status_code == 503:  # starting, or its engine is gone: the request did not run there
                    await resp.aclose()
                    failures.append(f"{w.url}: answered 503")
                    self.workers.failed(w, "answered 503")
                    continue
                out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
                out_headers[WORKER_HEADER] = w.url
                kind = resp.headers.get("content-type", "")
                if kind.startswith(("text/event-stream", "application/x-ndjson")):
                    self.workers.answered(w)
                    relayed = True
                    return _RelayResponse(_Relay(self, resp, w), status_code=resp.status_code, headers=out_headers)
                try:
                    content = await resp.aread()
                except httpx.TransportError as exc:  # died or stalled before the whole answer came: never replayed
                    return self._lost(w, exc)
                finally:
                    await resp.aclose()
                if resp.status_code >= 500 and _engine_unavailable(content):  # the engine's 503 under another status
                    failures.append(f"{w.url}: answered {resp.status_code} engine_unavailable")
                    self.workers.failed(w, f"answered {resp.status_code} engine_unavailable")
                    continue
                self.workers.answered(w)
                return Response(content, resp.status_code, headers=out_headers)
            finally:
                if not relayed:
                    self.release(w)
        return self._no_worker(f"{MAX_TRIES} workers tried: " + "; ".join(failures))

    def _no_worker(self, message: str) -> Response:
        return p.error_response(503, message, "server_error", None, "no_worker",
                                {"Retry-After": str(self.retry_after_s)})

    def _lost(self, w: Worker, exc: httpx.TransportError) -> Response:
        self.workers.failed(w, f"failed after taking a request: {type(exc).__name__}")
        status, error = _lost_error(w, exc, self.request_timeout)
        return p.error_response(status, error["message"], error["type"], None, error["code"],
                                {**NO_REPLAY, WORKER_HEADER: w.url})


def create_router_app(urls: Sequence[str], mode: str = "rr", per_worker_cap: int | None = None,
                      total_cap: int | None = None, health_interval: float = 2.0, tally: Tally | None = None,
                      label: str = "", request_timeout: float | None = None) -> FastAPI:
    """The router over these worker base URLs (http://HOST:PORT). One of several processes: `tally` with this
    process's row claimed, and `label` ("router 1: ") before its lines about the workers. `request_timeout`: the
    seconds a worker may send nothing while it has a request (None: no limit)."""
    workers = Workers(urls, mode, per_worker_cap, health_interval, label)
    if tally is None:
        tally = Tally(1, len(urls))
        tally.claim(0)
    proxy = Proxy(workers, total_cap, tally, request_timeout=request_timeout)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One client for every request: its connections to the workers stay open between requests (every one
        # kept, however many streams were in flight at once), and are dropped idle before a worker's uvicorn drops
        # them (its keep-alive is 5 s): a request never meets a connection the worker just closed, which would
        # take the worker out.
        proxy.http = httpx.AsyncClient(transport=KeptConnections(KEEPALIVE_S),
                                       timeout=httpx.Timeout(request_timeout, connect=CONNECT_TIMEOUT_S))
        await workers.check(proxy.http)
        workers.start(proxy.http)
        try:
            yield
        finally:
            await workers.stop()
            await proxy.http.aclose()

    app = FastAPI(title="minisgl router", version="0.1.0", lifespan=lifespan,
                  description="Routes OpenAI-compatible requests across minisgl serve workers.")
    app.state.workers, app.state.proxy = workers, proxy

    @app.get("/health")
    async def health() -> Any:
        up = [w for w in workers.workers if workers.up(w)]
        if not up:
            return p.error_response(503, "no worker is up: " + "; ".join(f"{w.url}: {w.reason}"
                                                                         for w in workers.workers),
                                    "server_error", None, "no_worker")
        return {"status": "ok", "workers_up": len(up), "workers": len(workers.workers)}

    @app.get("/metrics", responses={200: {"content": {"text/plain": {}}}})
    async def metrics(request: Request, format: str | None = Query(None, pattern="^(json|prometheus)$")) -> Any:
        assert proxy.http is not None
        auth = request.headers.get("authorization")
        rows = tally.rows()
        whole = ProcessFigures.whole(rows)
        per = await workers.metrics(proxy.http, {"Authorization": auth} if auth else None, whole.routed, whole.load)
        accept = request.headers.get("accept", "")
        if format == "prometheus" or (format is None and "text/plain" in accept and "application/json" not in accept):
            return PlainTextResponse(_prometheus(per, rows), media_type="text/plain; version=0.0.4; charset=utf-8")
        return {"mode": workers.dispatcher.mode, "workers": per, "total": _total(per, whole.inflight),
                "processes": [{"pid": r.pid, "requests": r.requests, "inflight": r.inflight} for r in rows]}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    async def forward(path: str, request: Request) -> Response:
        return await proxy.forward(request)

    return app


def _total(per: list[dict[str, Any]], inflight: int) -> dict[str, Any]:
    # Workers whose engine has no prefix cache (hf) report its figures as null: they count in neither sum.
    scheds = [w["scheduler"] for w in per if w["scheduler"] and w["scheduler"].get("cache_hit_tokens") is not None]
    hit = sum(s["cache_hit_tokens"] for s in scheds)
    miss = sum(s.get("cache_miss_tokens") or 0 for s in scheds)
    return {"workers_up": sum(w["alive"] for w in per), "requests": sum(w["requests"] for w in per),
            "inflight": inflight, "cache_hit_tokens": hit if scheds else None,
            "cache_miss_tokens": miss if scheds else None,
            "cache_hit_rate": (round(hit / (hit + miss), 4) if hit + miss else 0.0) if scheds else None}


def _prometheus(per: list[dict[str, Any]], rows: Sequence[ProcessFigures] = ()) -> str:
    def each(field: str) -> list[tuple[str, float]]:  # a null figure (hf has no prefix cache): no sample
        return [(f'{{worker="{escape_label(w["url"])}"}}', float(w[field])) for w in per if w[field] is not None]

    def process(field: str) -> list[tuple[str, float]]:
        return [(f'{{process="{i}"}}', float(getattr(r, field))) for i, r in enumerate(rows)]

    lines = [
        *prometheus_family("router_worker_up", "gauge", "1 while the worker serves, 0 while it is out.", each("alive")),
        *prometheus_family("router_requests_total", "counter", "Requests routed to the worker.", each("requests")),
        *prometheus_family("router_inflight", "gauge", "Requests at the worker now (its load).", each("inflight")),
        *prometheus_family("router_cache_hit_rate", "gauge", "The worker's prefix cache hits over prompt tokens.",
                           each("cache_hit_rate")),
        *prometheus_family("router_process_requests_total", "counter", "Requests this router process routed.",
                           process("requests")),
        *prometheus_family("router_process_inflight", "gauge", "Requests in flight through this router process.",
                           process("inflight")),
    ]
    return "\n".join(lines) + "\n"

