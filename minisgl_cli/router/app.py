"""`minisgl router`: one OpenAI-compatible endpoint in front of several `minisgl serve` workers (other hosts).

Each request is routed by its prompt text (rr | fsfs | random | cache_aware, routing.py) and proxied as it
came; the worker's response comes back as the worker writes it, so the OpenAI API and /generate are the
same for clients. A worker that cannot be reached, or answers 503 (starting, or its engine gone), before
the client got anything is taken out and the request retried on another; a stream whose worker dies after
it started ends with an error frame in the stream's own format. Caps answer 429 + Retry-After, like
`serve`'s. /health and /metrics (each worker and the total) are the router's own.

This app is one router process; `minisgl router --processes N` runs N of them on one port (processes.py), each
routing on its own, their figures shared through a `Tally` so that /metrics from any of them is the whole router's.
"""

from __future__ import annotations

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
from minisgl_cli.router.connections import KeptConnections
from minisgl_cli.router.tally import ProcessFigures, Tally
from minisgl_cli.router.workers import Worker, Workers
from minisgl_cli.routing import Busy, NoReplica

log = logging.getLogger("minisgl.router")

WORKER_HEADER = "X-Minisgl-Worker"  # which worker answered (every proxied response)
KEEPALIVE_S = 4.0  # idle connections to a worker are closed after this (under uvicorn's 5 s)
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


class _Relay:
    """One worker response being streamed to the client: whole frames only, and an error frame if the worker
    dies mid-stream. `close` (however the response ends) frees the worker's slot and the connection."""

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
            self.proxy.workers.take_out(self.worker, f"died while streaming: {type(exc).__name__}")
            error = {"message": f"worker {self.worker.url} failed while streaming this response "
                                f"({type(exc).__name__}); it is taken out: retry the request",
                     "type": "server_error", "param": None, "code": "worker_failed"}
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
    """Forwards a request to a worker the router picks, retrying on another while nothing has reached the client."""

    def __init__(self, workers: Workers, total_cap: int | None, tally: Tally, retry_after_s: int = 1):
        self.workers, self.total_cap, self.tally, self.retry_after_s = workers, total_cap, tally, retry_after_s
        self.inflight = 0
        self.http: httpx.AsyncClient | None = None  # opened by the app's lifespan

    def release(self, w: Worker) -> None:
        self.inflight -= 1
        self.workers.done(w)
        self._publish()

    def _publish(self) -> None:
        self.tally.write(self.inflight, self.workers.router.routed, self.workers.router.load)

    def _busy(self, message: str) -> Response:
        return p.error_response(429, message, "rate_limit_error", None, "too_many_requests",
                                {"Retry-After": str(self.retry_after_s)})

    async def forward(self, request: Request) -> Response:
        assert self.http is not None
        body = await request.body()
        # Only cache_aware matches prompts: the other modes never parse the body.
        key = routing_key(body) if body and self.workers.router.mode == "cache_aware" else None
        if self.total_cap and self.inflight >= self.total_cap:
            return self._busy(f"server busy: {self.inflight} requests in flight (cap {self.total_cap}); retry shortly")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP]
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: set[int] = set()
        failures: list[str] = []
        while True:
            try:
                w = self.workers.pick(key, tried)
            except Busy as exc:
                return self._busy(str(exc))
            except NoReplica as exc:
                return p.error_response(503, f"{exc}: " + "; ".join(
                    failures or [f"{x.url}: {x.reason}" for x in self.workers.workers]), "server_error", None,
                    "no_worker")
            self.inflight += 1
            self._publish()
            relayed = False
            try:
                try:
                    resp = await self.http.send(self.http.build_request(
                        request.method, w.url + target, headers=headers, content=body), stream=True)
                except httpx.TransportError as exc:  # refused, reset, or died before answering: nothing sent yet
                    failures.append(f"{w.url}: {type(exc).__name__}")
                    self.workers.take_out(w, f"unreachable: {type(exc).__name__}")
                    tried.add(w.index)
                    continue
                out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
                out_headers[WORKER_HEADER] = w.url
                if resp.status_code == 503:  # starting, or its engine is gone: another worker takes it
                    await resp.aclose()
                    failures.append(f"{w.url}: answered 503")
                    self.workers.take_out(w, "answered 503")
                    tried.add(w.index)
                    continue
                kind = resp.headers.get("content-type", "")
                if kind.startswith(("text/event-stream", "application/x-ndjson")):
                    relayed = True
                    return _RelayResponse(_Relay(self, resp, w), status_code=resp.status_code, headers=out_headers)
                try:
                    content = await resp.aread()
                except httpx.TransportError as exc:  # died before the whole answer came: nothing sent yet
                    failures.append(f"{w.url}: {type(exc).__name__}")
                    self.workers.take_out(w, f"died while answering: {type(exc).__name__}")
                    tried.add(w.index)
                    continue
                finally:
                    await resp.aclose()
                return Response(content, resp.status_code, headers=out_headers)
            finally:
                if not relayed:
                    self.release(w)


def create_router_app(urls: Sequence[str], mode: str = "rr", per_worker_cap: int | None = None,
                      total_cap: int | None = None, health_interval: float = 2.0, tally: Tally | None = None,
                      label: str = "") -> FastAPI:
    """The router over these worker base URLs (http://HOST:PORT). One of several processes: `tally` with this
    process's row claimed, and `label` ("router 1: ") before its lines about the workers."""
    workers = Workers(urls, mode, per_worker_cap, health_interval, label)
    if tally is None:
        tally = Tally(1, len(urls))
        tally.claim(0)
    proxy = Proxy(workers, total_cap, tally)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One client for every request: its connections to the workers stay open between requests (every one
        # kept, however many streams were in flight at once), and are dropped idle before a worker's uvicorn drops
        # them (its keep-alive is 5 s): a request never meets a connection the worker just closed, which would
        # take the worker out.
        proxy.http = httpx.AsyncClient(transport=KeptConnections(KEEPALIVE_S),
                                       timeout=httpx.Timeout(None, connect=5.0))
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
        return {"mode": workers.router.mode, "workers": per, "total": _total(per, whole.inflight),
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

