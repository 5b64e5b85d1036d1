"""BaseClient: what every EngineClient implementation shares — streams fed by outputs keyed by request id.

Outputs arrive on whichever thread receives the scheduler's messages and are handed to each request's stream on
its own event loop, one wake-up per loop; named queries (stats, page check) are answered by id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

from minisgl_cli.admission import AdmissionError, admit_params, admit_prompt
from minisgl_cli.client.protocol import ENGINE_GONE, EngineGone, PrefixWarm
from minisgl_cli.messages import (
    AbortRequest,
    AddRequest,
    CheckPagesQuery,
    CheckPagesReply,
    DecodedPiece,
    StatsQuery,
    StatsReply,
)
from minisgl_cli.types import (
    Delta,
    ErrorCode,
    GenerateRequest,
    ImageInput,
    ModelInfo,
    Prompt,
    RequestStats,
    SamplingParams,
    SchedulerStats,
    new_request_id,
)
from minisgl_cli.vision.processor import has_images

log = logging.getLogger("minisgl.client")


class _Stream:
    """Where one request's outputs go: a list on its consumer's event loop and, while the consumer waits, the future
    that wakes it (an asyncio.Queue's get and put cost several times this, paid per request per step)."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.waiter: asyncio.Future | None = None

    async def take(self) -> list:
        """Every item delivered since the last take (waiting for one): a slow consumer gets several at once."""
        if not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


def settle(fut: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    """Answer a query's future, unless its caller gave up on it first (cancelled it: a hang-up, a deadline): a late
    reply then goes nowhere, instead of raising InvalidStateError in the thread that received it."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # done() then set_*() would race the cancel
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


def _deliver(batch: list[tuple[_Stream, list]]) -> None:
    """On the consumers' event loop."""
    for stream, items in batch:
        stream.items += items
        if stream.waiter is not None and not stream.waiter.done():
            stream.waiter.set_result(None)


class BaseClient:
    """What every EngineClient implementation shares: request streams fed by outputs keyed by request id,
    and named queries answered by id. Subclasses say how messages reach the scheduler (`_send`), how
    prompts are tokenized (`tokenize`), and how a request's raw outputs become text (`_decoder`)."""

    info: ModelInfo

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}
        self._warming: dict[str, PrefixWarm] = {}
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._qids = itertools.count()

    def _send(self, msg: Any) -> None:
        raise NotImplementedError

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        raise NotImplementedError

    async def prompt(self, req: GenerateRequest) -> Prompt:
        """The request's prompt as the engine takes it, admitted: its ids, and its images where the model takes images
        (a client whose engine does overrides this). AdmissionError for a prompt that cannot run."""
        if req.tokenized is not None:
            return req.tokenized
        if has_images(req.messages):
            raise ValueError(f"{self.info.name} takes no images: send text, or serve a vision-language model "
                             "(Qwen2-VL / Qwen2.5-VL) on the engine")
        return self._admitted(Prompt(await self.tokenize(req)), req)

    def _admitted(self, prompt: Prompt, req: GenerateRequest) -> Prompt:
        """`prompt`, once its ids passed the one prompt check (where they are first known: see admission.py)."""
        admit_prompt(prompt.ids, self.info.vocab_size, self.info.max_context_len, req.prompt_field)
        return prompt

    def _own(self, images: list[ImageInput]) -> list[ImageInput]:
        """The images as one request hands them to the scheduler (a transport may need its own copy of each)."""
        return images

    def _decoder(self, params: SamplingParams) -> Callable[[list], DecodedPiece]:
        raise NotImplementedError

    def _error_item(self, rid: str, error: str, code: ErrorCode) -> Any:
        """An item that ends a stream with `error` (of kind `code`), of the kind `_decoder` reads."""
        raise NotImplementedError

    def _check(self, req: GenerateRequest) -> None:
        """Raise ValueError naming a request field this engine cannot honour (before anything is registered)."""

    def _closed_stream(self, rid: str) -> None:
        """A request's stream ended (its abort, if it needed one, sent): nothing more is sent for it."""

    # --- routing (on whichever thread receives the scheduler's messages) --------------------------
    def _route(self, items_by_rid: dict[str, list], finished: Callable[[list], bool]) -> None:
        """Hand each request its items, with one wake-up per consumer event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, list]]] = {}
        for rid, items in items_by_rid.items():
            stream = self._streams.get(rid)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, items))
            elif rid in self._warming and finished(items):
                self._warming.pop(rid).done.set()
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # that consumer's event loop is closed: nobody is listening any more
                pass

    def _fail_all(self, reason: str, code: ErrorCode = ErrorCode.UNAVAILABLE) -> None:
        """The engine is gone: end every open stream and pending query with `reason` (from any thread); a query's
        caller gets EngineGone (a 503 where a front answers it, not the input's fault)."""
        self._route({rid: [self._error_item(rid, f"{ENGINE_GONE}: {reason}", code)] for rid in list(self._streams)},
                    lambda items: True)
        self._warming.clear()  # no prefix is cached any more
        for qid in list(self._replies):
            fut = self._replies.pop(qid, None)
            if fut is not None:
                settle(fut, error=EngineGone(reason))

    def failure(self) -> str | None:
        return None

    def _reply(self, qid: int, reply: object) -> None:
        fut = self._replies.pop(qid, None)
        if fut is not None:
            settle(fut, reply)

    def _query(self, msg: Any, qid: int, timeout: float) -> object | None:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._replies[qid] = fut
        self._send(msg)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            self._replies.pop(qid, None)
            return None

    # --- requests ------------------------------------------------------------------------------
    async def submit(self, req: GenerateRequest) -> AsyncGenerator[Delta, None]:
        if (reason := self.failure()) is not None:
            raise EngineGone(reason)
        self._check(req)
        prompt: Prompt | None = None
        try:  # the prompt is admitted where it was tokenized (a `tokenized` one already was); the parameters here
            prompt = await self.prompt(req)
            admit_params(req.params, self.info.vocab_size)
        except AdmissionError as exc:  # refused before it reaches the engine: a stream of one error, like any other
            yield Delta(req.rid, error=exc.message, error_code=exc.code, error_param=exc.param,
                        stats=RequestStats(prompt_tokens=prompt.tokens if prompt else 0, latency_s=0.0))
            return
        if req.rid in self._streams:
            raise ValueError(f"request id {req.rid!r} is already in flight")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[req.rid] = stream
        sent = done = False
        try:  # from here on the stream's entry goes whatever happens (a failed send, a decoder error, a hang-up)
            if (reason := self.failure()) is not None:  # it died while we tokenized: its end-of-streams missed this
                raise EngineGone(reason)
            decode = self._decoder(req.params)
            stats = RequestStats(prompt_tokens=prompt.tokens)
            t0 = time.perf_counter()
            self._send(AddRequest(req.rid, prompt.ids, req.params, self._own(prompt.images), prompt.kept))
            sent = True
            while not done:
                piece = decode(await stream.take())
                delta = _delta(req.rid, piece, stats, t0)
                done = delta.finished
                if done and piece.stopped_early:
                    self._send(AbortRequest(req.rid, "stop"))  # a stop string ended it first: free its KV now
                yield delta
        finally:
            self._streams.pop(req.rid, None)
            if sent and not done:  # the consumer went away (client disconnect, Ctrl-C) or decoding failed: free its KV
                with contextlib.suppress(RuntimeError):  # a transport that takes nothing more has nothing to free
                    self.abort(req.rid)
            self._closed_stream(req.rid)

    def abort(self, rid: str) -> None:
        self._send(AbortRequest(rid))

    def _warm(self, prompt: Prompt) -> PrefixWarm:
        """Prefill an admitted prompt into the radix cache (`insert_prefix`)."""
        rid = new_request_id("warm")
        warm = PrefixWarm(prompt.tokens)
        self._warming[rid] = warm
        self._send(AddRequest(rid, prompt.ids, SamplingParams(max_new_tokens=1, ignore_eos=True), kept=prompt.kept))
        return warm

    def stats(self, timeout: float = 10.0) -> SchedulerStats:
        qid = next(self._qids)
        reply = self._query(StatsQuery(qid), qid, timeout)
        if not isinstance(reply, StatsReply):
            raise TimeoutError(f"the scheduler did not answer a stats query within {timeout:g}s")
        return reply.stats

    def check_pages(self, timeout: float = 10.0) -> None:
        qid = next(self._qids)
        reply = self._query(CheckPagesQuery(qid), qid, timeout)
        if not isinstance(reply, CheckPagesReply):
            raise TimeoutError(f"the scheduler did not answer a page check within {timeout:g}s")
        if reply.error is not None:
            raise AssertionError(reply.error)


def _delta(rid: str, piece: DecodedPiece, stats: RequestStats, t0: float) -> Delta:
    """A Delta from a decoded piece; the request's clock (TTFT, latency) runs on the consumer's side."""
    now = time.perf_counter()
    if piece.token_ids and stats.completion_tokens == 0:
        stats.ttft_s = now - t0
        stats.prefill_s = piece.prefill_s if piece.prefill_s is not None else stats.ttft_s
    stats.completion_tokens += len(piece.token_ids)
    stats.drafted_tokens += piece.drafted
    stats.cached_tokens = piece.cached_tokens
    if piece.error or piece.finish_reason:
        stats.latency_s = now - t0
    if piece.error:
        code = ErrorCode(piece.error_code) if piece.error_code is not None else None  # a str after msgpack
        return Delta(rid, error=piece.error, stats=stats, error_code=code)
    if log.isEnabledFor(logging.INFO) and piece.token_ids:
        lps = f" logprobs {[round(lp.logprob, 3) for lp in piece.logprobs]}" if piece.logprobs else ""
        log.info("decode %s: token ids %s -> %r%s", rid, piece.token_ids, piece.text, lps)
    return Delta(rid, piece.text, piece.token_ids, piece.finish_reason, stats if piece.finish_reason else None,
                 logprobs=piece.logprobs, stop_string=piece.stop_string)
