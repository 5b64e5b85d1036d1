"""Load: 120 concurrent streams on loopback, 20% hanging up after their first chunk; the pool ends idle."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_fixtures import wait_idle

pytestmark = pytest.mark.slow

N_REQUESTS = 120
DROP_EVERY = 5  # every 5th request disconnects midway: 20%
SYSTEM = "You are a terse assistant. Answer in one short sentence."


async def one(http: httpx.AsyncClient, url: str, i: int) -> dict:
    body = {
        "model": "default", "stream": True, "max_tokens": 8 + i % 9, "temperature": 0.7, "seed": i,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Say something about {i}."}],
    }
    drop = i % DROP_EVERY == 0
    text, reason, chunks = "", None, 0
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                break
            choice = json.loads(payload)["choices"][0]
            text += choice["delta"].get("content") or ""
            reason = choice["finish_reason"] or reason
            chunks += 1
            if drop and choice["delta"].get("content"):
                return {"i": i, "dropped": True}  # leaving the block closes the connection mid-stream
    return {"i": i, "dropped": False, "text": text, "reason": reason, "chunks": chunks}


async def health_probe(url: str, stop: asyncio.Event) -> int:
    """Hit /health all along; the event loop must answer while the engine is busy."""
    ok = 0
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            r = await http.get(f"{url}/health")
            assert r.status_code == 200
            ok += 1
            await asyncio.sleep(0.5)
    return ok


def test_concurrent_streams_with_disconnects(server_url, engine_client):
    async def run():
        stop = asyncio.Event()
        probe = asyncio.create_task(health_probe(server_url, stop))
        limits = httpx.Limits(max_connections=N_REQUESTS + 10, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=240, limits=limits) as http:
            results = await asyncio.gather(*(one(http, server_url, i) for i in range(N_REQUESTS)))
        stop.set()
        return results, await probe

    t0 = time.monotonic()
    results, health_ok = asyncio.run(run())
    elapsed = time.monotonic() - t0
    dropped = [r for r in results if r["dropped"]]
    completed = [r for r in results if not r["dropped"]]
    assert len(dropped) == N_REQUESTS // DROP_EVERY
    for r in completed:
        assert r["reason"] in ("stop", "length"), r
        assert r["text"], r
    assert health_ok >= 1
    assert httpx.get(f"{server_url}/health").status_code == 200

    wait_idle(engine_client)
    engine_client.check_pages()
    s = engine_client.stats()
    assert s.running == 0 and s.waiting == 0 and s.tokens_in_use == 0, s.to_dict()
    m = httpx.get(f"{server_url}/metrics", timeout=30).json()
    assert m["server"]["inflight"] == 0
    assert m["server"]["disconnects"] >= len(dropped)
    print(f"\n{N_REQUESTS} streams ({len(dropped)} dropped) in {elapsed:.1f}s; "
          f"e2e p50 {m['latency']['e2e_ms']['p50']:.0f} ms")
