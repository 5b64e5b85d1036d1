"""Engine runs: `EngineRun` merges a route's n engine streams, watches for disconnects, streams the HTTP response.

An HTTP request becomes one `EngineRun` (n choices, k prompts: n·k engine requests). The run is closed
however the HTTP side ends — finished, failed, past its deadline, or the client gone — and closing it aborts
whatever is unfinished (freeing its KV) and gives the inflight slots back.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar, cast

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from minisgl_cli.server.deadline import Deadline, DeadlineExceeded
from minisgl_cli.server.errors import Disconnected, engine_error, refused
from minisgl_cli.server.gate import InflightGate, downscale_headers
from minisgl_cli.server.metrics import ServerMetrics
from minisgl_cli.types import Delta, GenerateRequest, RequestStats, TokenLogprob, error_code_of

log = logging.getLogger("minisgl.server")
T = TypeVar("T")


class Source(Protocol):
    """Where a run's requests stream from: the engine's client, or a chat prepared for the VLM beside it
    (vlm_chat.VlmPrompt)."""

    def submit(self, req: GenerateRequest) -> AsyncGenerator[Delta, None]:
        """Stream a request's output; closing the stream early stops the request (its KV is freed)."""
        ...


class EngineRun:
    """n engine requests merged into one stream of (choice index, Delta).

    One request is read straight from its `client.submit` stream; several are each pumped by a task into a
    queue. `close()` closes the stream or cancels the pumps (a cancelled pump closes its stream), which aborts
    what is unfinished and frees its KV. The inflight slots come back on close or when the last request ends,
    whichever is first.
    """

    def __init__(self, client: Source, reqs: list[GenerateRequest], gate: InflightGate,
                 metrics: ServerMetrics, endpoint: str, active: set[EngineRun], deadline: Deadline | None = None):
        self.reqs, self.gate, self.metrics, self.endpoint = reqs, gate, metrics, endpoint
        self.client, self.active = client, active
        self.deadline = deadline or Deadline(None)
        self.deadline.start()  # one timer for every output, dropped when the run is released
        active.add(self)
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.open = len(reqs)  # requests not yet finished
        self.chunks = [0] * len(reqs)
        self.finals: list[Delta | None] = [None] * len(reqs)
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in reqs]  # per choice, when its request asked
        self._released = False
        self.closed = False
        # One request (most runs) is read straight from its stream by whoever awaits `next`: no task and no queue,
        # one wake-up per output instead of two. Several are merged through the queue, each pumped by a task.
        self.stream = client.submit(reqs[0]) if len(reqs) == 1 else None
        self.tasks = [] if self.stream else [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(reqs)]
        self._reading = False  # a task awaits the stream's next output right now
        self._closing: asyncio.Future | None = None

    async def _pump(self, i: int, req: GenerateRequest) -> None:
        try:
            async for delta in self.client.submit(req):
                self.queue.put_nowait((i, delta))
        except Exception as exc:  # e.g. a tokenizer failure: report it as this choice's error
            self.queue.put_nowait((i, _failed(req, exc)))

    async def _take(self) -> tuple[int, Delta]:
        if self.stream is None:
            try:
                return await self.deadline.wait(self.queue.get())
            except DeadlineExceeded as exc:  # the first choice still open fails; closing the run aborts the rest
                i = self.finals.index(None)
                return i, _failed(self.reqs[i], exc)
        self._reading = True
        try:
            # Past the deadline the stream's read is cancelled: its `finally` aborts the request (its KV is freed).
            return 0, await self.deadline.wait(anext(self.stream))
        except StopAsyncIteration:  # a client's stream always ends with a finished delta; never wait for one
            return 0, _failed(self.reqs[0], RuntimeError("the engine's stream ended before its request finished"))
        except Exception as exc:  # as _pump; a deadline too (a 504)
            return 0, _failed(self.reqs[0], exc)
        finally:
            self._reading = False

    async def next(self) -> tuple[int, Delta] | None:
        """The next event, or None once every request has finished."""
        if self.open == 0:
            return None
        i, delta = await self._take()
        if delta.text or delta.token_ids:
            self.chunks[i] += 1
        if delta.logprobs:
            self.logprobs[i].extend(delta.logprobs)
        if delta.finished:
            self.open -= 1
            self.finals[i] = delta
            self._log_finish(i, delta)
            if not refused(delta):  # one its client refused never ran: its HTTP status alone counts it
                self.metrics.finish(delta.stats, delta.finish_reason if not delta.error else None, self.endpoint)
            if self.open == 0:
                self._release()
        return i, delta

    async def collect(self, until_error: bool = False) -> list[tuple[str, Delta | None]]:
        """Run every request to the end (`until_error`: or until one fails): [(text, final delta)] in choice
        order."""
        texts = [""] * len(self.reqs)
        while (event := await self.next()) is not None:
            i, delta = event
            texts[i] += delta.text
            if until_error and delta.error:
                break
        return list(zip(texts, self.finals))

    async def first_event(self, request: Request) -> tuple[int, Delta] | None:
        """Wait for the first delta before answering, so early engine errors get a real status."""
        try:
            event = await unless_disconnected(request, self.next())
        except BaseException:
            self.close()
            raise
        if event is not None and event[1].error:
            self.close()
            raise engine_error(event[1], self.gate.retry_after_s, self.reqs[event[0]].params)
        return event

    async def finish_all(self, request: Request) -> list[tuple[str, Delta]]:
        """Run to the end (a non-stream response): [(text, final delta)]; the first engine error is raised as soon
        as it comes (the response fails as a whole: closing aborts the others)."""
        try:
            results = await unless_disconnected(request, self.collect(until_error=True))
        finally:
            self.close()
        for req, (_, final) in zip(self.reqs, results):
            if final is not None and final.error:
                raise engine_error(final, self.gate.retry_after_s, req.params)
        # No error: every request finished, so every final delta is set.
        return cast("list[tuple[str, Delta]]", results)

    def close(self) -> None:
        """Abort what is unfinished (client gone, error) and give the inflight slots back."""
        if self.closed:
            return
        self.closed = True
        unfinished = [i for i, f in enumerate(self.finals) if f is None]
        for task in self.tasks:
            task.cancel()
        if self.stream is not None and not self._reading:
            # Between outputs (or past the last): closing it runs its `finally`, which drops its entry and aborts the
            # request if unfinished. One read right now ends with its reader, being cancelled, or by shutdown's abort.
            self._closing = asyncio.ensure_future(self.stream.aclose())
        if unfinished:
            failed = any(f is not None and f.error for f in self.finals)  # the response fails as a whole
            if not failed:
                self.metrics.disconnect()
            for i in unfinished:
                self.metrics.finish(None, "abort", self.endpoint)
                log.info("rid=%s %s: %s after %d chunks, aborted (KV freed)", self.reqs[i].rid, self.endpoint,
                         "another choice failed" if failed else "client gone", self.chunks[i])
        self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.deadline.cancel()
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


def _failed(req: GenerateRequest, exc: Exception) -> Delta:
    """A request's stream raised (e.g. a tokenizer failure): its error, as the choice's last delta."""
    return Delta(req.rid, error=str(exc) or type(exc).__name__, error_code=error_code_of(exc))


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
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


class EngineStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its run however the response ends: even when the client
    is gone before the first chunk (the body generator then never starts, so its `finally` never runs)."""

    def __init__(self, run: EngineRun, content: AsyncIterator[str], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.run.close()


def stream_response(run: EngineRun, body: AsyncIterator[str], note: str | None,
                    media_type: str = "text/event-stream") -> StreamingResponse:
    """The streamed reply of a run: unbuffered by proxies, with the downscale header if one was applied."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **downscale_headers(note)}
    return EngineStreamingResponse(run, body, media_type=media_type, headers=headers)


_JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps(x, ensure_ascii=False), without a new encoder per call


def sse(obj: dict[str, Any] | str, event: str | None = None) -> str:
    """One server-sent event frame: a JSON object, or a bare string such as "[DONE]"; `event`: its name line
    (Anthropic's stream names every event)."""
    data = f"data: {obj if isinstance(obj, str) else _JSON.encode(obj)}\n\n"
    return data if event is None else f"event: {event}\n{data}"


def ndjson(obj: dict[str, Any]) -> str:
    """One line of an NDJSON stream (ollama's)."""
    return _JSON.encode(obj) + "\n"


_SLOT = "\x00text\x00"  # JSON writes it as "\u0000text\u0000": no real id or model name holds a NUL


def templated(frame: Callable[[str], str]) -> Callable[[str], str]:
    """`frame`, made once: a frame whose only varying part is one text, written as a JSON string (ensure_ascii off),
    costs one string encode per call (a token's SSE chunk: no dict, no whole-object JSON), byte for byte the same.
    Falls back to calling `frame` where the text is not found exactly once, or not written that way."""
    parts = frame(_SLOT).split(_JSON.encode(_SLOT))
    if len(parts) != 2:
        return frame
    head, tail = parts
    made = lambda text: head + _JSON.encode(text) + tail  # noqa: E731
    probe = 'é"\\\n\x01😀'  # non-ASCII, characters JSON escapes, a control character, an emoji
    return made if made(probe) == frame(probe) else frame
