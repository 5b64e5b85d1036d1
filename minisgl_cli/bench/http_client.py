"""One HTTP client's work: stream prepared requests from an OpenAI-compatible server at a rate and a concurrency,
timing each; the same loop in the bench's own process or in each of its client worker processes (`worker`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from minisgl_cli.bench.metrics import RequestTiming
from minisgl_cli.bench.target import ClientClock, ClientCpu


@dataclass
class Send:
    """One request as it goes on the wire: the route, the JSON body, and its prompt length (for the metrics)."""

    path: str
    body: dict[str, Any]
    prompt_tokens: int


@dataclass
class Sent:
    """What came back for one Send: its timing (output_tokens not yet counted) and the server's usage count."""

    timing: RequestTiming
    usage_tokens: int | None


@dataclass
class Share:
    """One client process's part of a run: which requests (indexes into the run's), how many in flight, the rate."""

    index: list[int]
    sends: list[Send]
    concurrency: int | None
    request_rate: float
    seed: int


def parse_sse_line(line: str) -> dict | None | str:
    """One SSE line -> its JSON payload; "[DONE]" for the end marker; None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return None


def chunk_text(payload: dict, chat: bool) -> str | None:
    """A streamed chunk's generated text ("" when its tokens have no text yet, e.g. a server without a
    tokenizer); None for chunks that carry no tokens (the role, the finish reason, usage)."""
    choices = payload.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        text = delta.get("content")
        return None if delta.get("role") or (text is None) or (not text and c.get("finish_reason")) else text
    text = c.get("text")
    return None if text is None or (not text and c.get("finish_reason")) else text


async def _one(http: httpx.AsyncClient, url: str, send: Send) -> Sent:
    timing = RequestTiming(prompt_tokens=send.prompt_tokens)
    parts: list[str] = []
    usage_tokens: int | None = None
    chat = send.path.endswith("/chat/completions")
    t0 = time.perf_counter()
    try:
        async with http.stream("POST", url + send.path, json=send.body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:200]
                raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                payload = parse_sse_line(line)
                if payload == "[DONE]":
                    break
                if not isinstance(payload, dict):
                    continue
                if payload.get("error"):
                    raise RuntimeError(str(payload["error"])[:200])
                now = time.perf_counter() - t0
                if (text := chunk_text(payload, chat)) is not None:
                    if timing.ttft_s is None:
                        timing.ttft_s = now
                    timing.chunk_times_s.append(now)
                    parts.append(text)
                if usage := payload.get("usage"):
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    except Exception as exc:
        timing.success, timing.error = False, f"{type(exc).__name__}: {exc}"
    timing.latency_s = time.perf_counter() - t0
    timing.text = "".join(parts)
    return Sent(timing, usage_tokens)


async def stream_requests(url: str, share: Share, timeout_s: float, on_done: Callable[[int], None],
                          ready: Callable[[], Awaitable[None]] | None = None) -> list[Sent]:
    """Send the share's requests, Poisson arrivals at its rate (inf: all at once), at most its concurrency in
    flight; on_done(index) as each ends. The results in the share's order. `ready`: awaited first, after one
    request to /health (its answer does not matter): a fresh client's first request pays its own set-up (TLS
    context, lazy imports, ~50 ms), which is not the server's time to first token."""
    rng = random.Random(share.seed)
    gate = asyncio.Semaphore(share.concurrency) if share.concurrency else None
    limits = httpx.Limits(max_connections=share.concurrency or len(share.sends) or 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
        if ready is not None:
            with contextlib.suppress(httpx.HTTPError):
                await http.get(url + "/health")
            await ready()

        async def limited(i: int, send: Send) -> Sent:
            if gate is None:
                sent = await _one(http, url, send)
            else:
                async with gate:
                    sent = await _one(http, url, send)
            on_done(i)
            return sent

        tasks = []
        for k, (i, send) in enumerate(zip(share.index, share.sends)):
            if k and math.isfinite(share.request_rate) and share.request_rate > 0:
                await asyncio.sleep(rng.expovariate(share.request_rate))  # Poisson process: exponential gaps
            tasks.append(asyncio.create_task(limited(i, send)))
        return list(await asyncio.gather(*tasks))


@dataclass
class ShareRun:
    """One share's run as its process saw it: the results, that process's CPU / wall / GC over it, and its clock's
    start (perf_counter, shared by the processes; time.time())."""

    sents: list[Sent]
    cpu: ClientCpu
    t0: float
    started_at: float


async def run_share(url: str, share: Share, timeout_s: float, on_done: Callable[[int], None],
                    before_clock: Callable[[], Awaitable[None]] | None = None) -> ShareRun:
    """stream_requests on this process's clock, which starts once the client is warm and `before_clock` returned
    (a worker's common start)."""
    clock: list[ClientClock] = []

    async def start() -> None:
        if before_clock is not None:
            await before_clock()
        clock.append(ClientClock())

    sents = await stream_requests(url, share, timeout_s, on_done, start)
    return ShareRun(sents, clock[0].stop(), clock[0].t0, clock[0].started_at)


def worker(n: int, url: str, share: Share, timeout_s: float, start: Any, events: Any) -> None:
    """A client worker process: warm its client, say ready, wait for the common start, run its share, send back its
    ShareRun. `events` gets ("ready", n), ("done", index) per request, then ("result", n, ShareRun) or ("error", n,
    traceback)."""

    async def ready() -> None:
        events.put(("ready", n))
        await asyncio.get_running_loop().run_in_executor(None, start.wait)

    try:
        run = asyncio.run(run_share(url, share, timeout_s, lambda i: events.put(("done", i)), ready))
        events.put(("result", n, run))
    except BaseException:
        events.put(("error", n, traceback.format_exc(limit=5)))
