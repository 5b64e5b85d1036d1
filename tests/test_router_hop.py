"""The router's second hop, against stand-in workers: one kept connection for request after request (one each
for streams at once, reused by the next ones; none past its keep-alive), the worker's SSE bytes passed through
exactly as written however they are cut, and no body parsed where the routing mode has no use for it (only
cache_aware matches prompts). Faults, against workers that fail on purpose: a request a worker could not have run
(refused, 503) goes to another, one it took and dropped or sat on is never replayed (502 / 504), a worker is out
only after several failures in a row, and a client's hang-up closes the worker's request."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from minisgl_cli.api.http_server import BackgroundServer
from minisgl_cli.router import app as router_app
from minisgl_cli.router.connections import KeptConnections

# Frames cut the awkward ways a TCP stream may cut them: one split in two, two in one write.
PIECES = [b'data: {"a": 1}\n\n', b'data: {"b"', b': 2}\n\ndata: {"c": 3}\n\n', b"data: [DONE]\n\n"]


def _worker(ports: list[int]) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        assert request.client is not None
        ports.append(request.client.port)  # one per TCP connection the router opened

        async def body():
            for piece in PIECES:
                yield piece
                await asyncio.sleep(0.01)  # separate writes

        return StreamingResponse(body(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # a non-streamed answer
        ports.append(-1)
        return {"object": "chat.completion"}

    return app


@pytest.fixture
def hop():
    ports: list[int] = []
    with BackgroundServer(_worker(ports)) as worker:
        router = BackgroundServer(router_app.create_router_app([worker], mode="rr", health_interval=60))
        with router as url:
            yield url, ports


def test_the_router_keeps_one_connection_and_passes_sse_bytes_through(hop):
    url, ports = hop
    for _ in range(5):
        r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi", "stream": true}', timeout=30)
        assert r.status_code == 200 and r.content == b"".join(PIECES)
        assert r.headers["content-type"].startswith("text/event-stream")
    assert len(ports) == 5 and len(set(ports)) == 1  # every request over the same kept connection


def test_rr_routes_without_parsing_the_body(hop, monkeypatch):
    url, _ = hop

    def boom(body: bytes):
        raise AssertionError("rr parsed the body")

    monkeypatch.setattr(router_app, "routing_key", boom)
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi"}', timeout=30)
    assert r.status_code == 200 and r.content == b"".join(PIECES)


def test_streams_at_once_get_a_connection_each_and_the_next_ones_reuse_them(hop):
    url, ports = hop

    async def together() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            rs = await asyncio.gather(*(client.post(f"{url}/v1/completions", content=b'{"stream": true}')
                                        for _ in range(3)))
        assert all(r.content == b"".join(PIECES) for r in rs)

    asyncio.run(together())
    asyncio.run(together())
    assert len(ports) == 6 and len(set(ports)) == 3


def test_a_connection_idle_past_its_keep_alive_is_not_reused():
    ports: list[int] = []

    async def twice(url: str) -> None:
        async with httpx.AsyncClient(transport=KeptConnections(keepalive_s=0.2)) as client:
            for pause in (0.0, 0.05, 0.4):
                await asyncio.sleep(pause)
                assert (await client.post(f"{url}/v1/completions")).content == b"".join(PIECES)

    with BackgroundServer(_worker(ports)) as url:
        asyncio.run(twice(url))
    assert ports[0] == ports[1] != ports[2]


def test_a_health_check_that_times_out_takes_a_worker_out_only_when_it_keeps_timing_out(monkeypatch):
    """A full load can queue /health behind stream frames: one or two slow answers leave a serving worker in; the
    SLOW_CHECKS-th in a row takes it out, and a good answer resets the count."""
    from minisgl_cli.router import workers as w

    monkeypatch.setattr(w, "CHECK_TIMEOUT_S", 0.2)
    delay = [0.0]
    app = FastAPI()

    @app.get("/health")
    async def health():
        await asyncio.sleep(delay[0])
        return {"status": "ok"}

    async def checks(url: str) -> list[bool]:
        pool = w.Workers([url])
        seen = []
        async with httpx.AsyncClient() as http:
            for slow in (0.0, 0.5, 0.5, 0.0, 0.5, 0.5, 0.5):
                delay[0] = slow
                await pool.check(http)
                seen.append(pool.up(pool.workers[0]))
        assert "Timeout" in pool.workers[0].reason and "(3 in a row)" in pool.workers[0].reason
        return seen

    with BackgroundServer(app) as url:
        assert asyncio.run(checks(url)) == [True, True, True, True, True, True, False]


class _Failing(BaseHTTPRequestHandler):
    """A worker whose /health answers 200 while it fails every request as its server's `mode` says: `unavailable`
    (503 engine_unavailable, as a worker whose engine died), `drop` (the connection closed with no answer, as a
    worker that crashed on it), `hang` (nothing, or on /v1/completions a stream's first frame and then nothing, until
    the router closes the connection)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _answer(self, status: int, body: bytes, *headers: tuple[str, str]) -> None:
        self.close_connection = True  # none kept: once stopped, it is gone
        self.send_response(status)
        for k, v in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                     ("Connection", "close"), *headers):
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._answer(200, b'{"status": "ok"}')

    def do_POST(self) -> None:
        server: _FailingWorker = self.server  # type: ignore[assignment]
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        server.posts += 1
        if server.mode == "unavailable":
            self._answer(503, json.dumps({"error": {"message": "the engine is gone", "type": "server_error",
                                                    "param": None, "code": "engine_unavailable"}}).encode(),
                         ("Retry-After", "1"))
        elif server.mode == "drop":
            self.close_connection = True
        else:  # hang until the peer closes the connection
            if self.path == "/v1/completions":
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(PIECES[0])
                self.wfile.flush()
            while not server.stopping.is_set():
                if select.select([self.connection], [], [], 0.1)[0] and not self.connection.recv(1):
                    server.hung_up += 1
                    break
            self.close_connection = True


class _FailingWorker(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str):
        super().__init__(("127.0.0.1", 0), _Failing)
        self.mode, self.posts, self.hung_up = mode, 0, 0
        self.stopping = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


@pytest.fixture
def pair(request):
    """A failing worker of the mode the test names (`@pytest.mark.parametrize("pair", [mode], indirect=True)`) and
    a good one, with a router over both (fsfs: the failing one first while it is idle and up; no health check
    after the first; request timeout 1 s); yields (router url, failing worker, the good one's request ports)."""
    bad = _FailingWorker(request.param)
    ports: list[int] = []
    try:
        with BackgroundServer(_worker(ports)) as good:
            app = router_app.create_router_app([bad.url, good], mode="fsfs", health_interval=60, request_timeout=1.0)
            with BackgroundServer(app) as url:
                yield url, bad, ports
    finally:
        bad.stop()


def _alive(url: str) -> list[bool]:
    return [w["alive"] for w in httpx.get(f"{url}/metrics", timeout=10).json()["workers"]]


def _requests(url: str):
    """Streamed and non-streamed requests in turn, for ever."""
    while True:
        yield httpx.post(f"{url}/v1/completions", content=b'{"stream": true}', timeout=30)
        yield httpx.post(f"{url}/v1/chat/completions", content=b"{}", timeout=30)


@pytest.mark.parametrize("pair", ["unavailable", "refused"], indirect=True)
def test_a_request_its_worker_could_not_run_goes_to_another_and_three_in_a_row_take_it_out(pair):
    url, bad, ports = pair
    if bad.mode == "refused":  # up at the router's first check, then gone: its port refuses connections
        bad.stop()
    sent = _requests(url)
    for i in range(1, 5):  # each offered to the failing worker first, until it is out
        r = next(sent)
        assert r.status_code == 200 and r.headers[router_app.WORKER_HEADER] != bad.url, r.text
        assert _alive(url) == [i < 3, True]  # one or two failures leave it in; the third takes it out
    reason = httpx.get(f"{url}/metrics").json()["workers"][0]["reason"]
    assert "3 requests failed in a row" in reason, reason
    assert len(ports) == 4 and bad.posts == (3 if bad.mode == "unavailable" else 0)


@pytest.mark.parametrize("pair", ["drop"], indirect=True)
def test_a_request_whose_worker_dropped_it_is_not_replayed_on_another(pair):
    url, bad, ports = pair
    sent = _requests(url)
    for i in range(1, 4):
        r = next(sent)
        assert r.status_code == 502 and r.headers["x-should-retry"] == "false", r.text
        error = r.json()["error"]
        assert error["code"] == "worker_failed" and bad.url in error["message"]
        assert bad.posts == i and ports == []  # the good worker never saw it
        assert _alive(url) == [i < 3, True]
    r = next(sent)
    assert r.status_code == 200 and bad.posts == 3  # out: the next one goes to the good worker


@pytest.mark.parametrize("pair", ["hang"], indirect=True)
def test_a_worker_that_sends_nothing_for_the_request_timeout_answers_504_and_is_not_replayed(pair):
    url, bad, ports = pair
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/chat/completions", content=b"{}", timeout=30)
    assert r.status_code == 504 and r.headers["x-should-retry"] == "false", r.text
    assert r.json()["error"]["code"] == "worker_timeout" and time.monotonic() - t0 >= 1.0  # the router's 1 s
    # A stream that started, then stalled: its error frame, then [DONE].
    lines = [x for x in httpx.post(f"{url}/v1/completions", content=b'{"stream": true}', timeout=30).text
             .split("\n\n") if x]
    assert lines[0] == PIECES[0].decode().strip() and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "worker_timeout"
    assert ports == [] and bad.posts == 2
    deadline = time.monotonic() + 10
    while bad.hung_up < 2 and time.monotonic() < deadline:  # the router closed both: the worker can abort them
        time.sleep(0.05)
    assert bad.hung_up == 2


def test_a_client_that_hangs_up_on_a_non_streamed_request_closes_it_at_the_worker():
    bad = _FailingWorker("hang")
    try:
        with BackgroundServer(router_app.create_router_app([bad.url], health_interval=60)) as url:
            host, port = httpx.URL(url).host, httpx.URL(url).port
            with socket.create_connection((host, port)) as client:
                client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                               b"\r\nContent-Length: 2\r\n\r\n{}")
                deadline = time.monotonic() + 10
                while bad.posts == 0 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert bad.posts == 1
            deadline = time.monotonic() + 10  # the client is gone: the router closes the worker's request
            while bad.hung_up == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert bad.hung_up == 1
            assert httpx.get(f"{url}/metrics").json()["total"]["inflight"] == 0
    finally:
        bad.stop()
