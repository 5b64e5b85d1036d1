"""The router's second hop, against a stand-in worker: one kept connection for request after request (one each
for streams at once, reused by the next ones; none past its keep-alive), the worker's SSE bytes passed through
exactly as written however they are cut, and no body parsed where the routing mode has no use for it (only
cache_aware matches prompts)."""

from __future__ import annotations

import asyncio

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
