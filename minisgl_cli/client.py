"""EngineClient: the one engine API every front uses — submit(request) -> async stream of Deltas.

`EngineClient` is the protocol: model info, submit / abort, tokenize (off the caller's event loop),
cache warming, stats, page check, health. Fronts see nothing else: not the engine, not the scheduler.
`LocalClient` implements it in this process: the scheduler loop runs on its own thread, which also builds
the engine (so the process has one OpenMP pool; torch releases the GIL while the model runs, so a busy
front never stalls decoding) and talks to the client only in `messages` — requests and named queries in,
one `StepOutput` per step out, routed here by request id to each request's stream on its own event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.messages import (
    AbortRequest,
    AddRequest,
    CheckPagesQuery,
    CheckPagesReply,
    DecodedPiece,
    FromScheduler,
    StatsQuery,
    StatsReply,
    StepOutput,
    TokenOutput,
    ToScheduler,
)
from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig
from minisgl_cli.tokenizer import RequestDecoder, Tokenizer, prompt_ids
from minisgl_cli.types import (
    Completion,
    Delta,
    GenerateRequest,
    ModelInfo,
    RequestStats,
    SamplingParams,
    SchedulerStats,
    TokenLogprob,
    new_request_id,
)

log = logging.getLogger("minisgl.client")

STALL_S = 30.0  # a scheduler loop silent this long is reported unhealthy (a step never takes that long)
ENGINE_GONE = "the engine is gone"  # how the error of a request whose engine died begins


@dataclass
class PrefixWarm:
    """A prefix being prefilled into the radix cache: its length, and an event set once it is cached."""

    tokens: int
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


class EngineClient(Protocol):
    info: ModelInfo

    def submit(self, req: GenerateRequest) -> AsyncGenerator[Delta, None]:
        """Stream a request's output; closing the stream early aborts the request (its KV is freed)."""
        ...

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (chat template applied), computed off the event loop."""
        ...

    def abort(self, rid: str) -> None: ...

    def insert_prefix(self, prefix: str | list[int]) -> PrefixWarm:
        """Prefill a prefix into the radix cache in the background."""
        ...

    def stats(self, timeout: float = 10.0) -> SchedulerStats: ...

    def check_pages(self, timeout: float = 10.0) -> None:
        """Raise AssertionError unless free + cached + in-use KV pages add up to the pool."""
        ...

    def healthy(self) -> bool:
        """The scheduler is alive and its loop is coming round."""
        ...

    def failure(self) -> str | None:
        """Why the engine is gone for good (a dead process or thread), in one line; None while it runs."""
        ...

    def close(self) -> None: ...


async def complete(client: EngineClient, req: GenerateRequest) -> Completion:
    """Run a request to the end and return the whole result (ValueError on an engine error)."""
    parts: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] | None = [] if req.params.wants_logprobs else None
    final: Delta | None = None
    async for d in client.submit(req):
        if d.error:
            raise ValueError(d.error)
        parts.append(d.text)
        ids.extend(d.token_ids)
        if logprobs is not None and d.logprobs:
            logprobs.extend(d.logprobs)
        final = d
    assert final is not None and final.stats is not None
    return Completion(req.rid, "".join(parts), ids, final.finish_reason, final.stats, logprobs)


class _Stream:
    """Where one request's outputs go: a queue on its consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[list] = asyncio.Queue()


def _deliver(batch: list[tuple[_Stream, list]]) -> None:
    for stream, items in batch:
        stream.queue.put_nowait(items)


class RoutedClient:
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

    def _decoder(self, params: SamplingParams) -> Callable[[list], DecodedPiece]:
        raise NotImplementedError

    def _error_item(self, rid: str, error: str) -> Any:
        """An item that ends a stream with `error`, of the kind `_decoder` reads."""
        raise NotImplementedError

    def _check(self, req: GenerateRequest) -> None:
        """Raise ValueError naming a request field this engine cannot honour (before anything is registered)."""

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

    def _fail_all(self, reason: str) -> None:
        """The engine is gone: end every open stream and pending query with `reason` (from any thread)."""
        self._route({rid: [self._error_item(rid, f"{ENGINE_GONE}: {reason}")] for rid in list(self._streams)},
                    lambda items: True)
        for qid in list(self._replies):
            fut = self._replies.pop(qid, None)
            if fut is not None and not fut.done():
                fut.set_exception(RuntimeError(reason))

    def failure(self) -> str | None:
        return None

    def _reply(self, qid: int, reply: object) -> None:
        fut = self._replies.pop(qid, None)
        if fut is not None:
            fut.set_result(reply)

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
            raise RuntimeError(f"{ENGINE_GONE}: {reason}")
        self._check(req)
        ids = await self.tokenize(req)
        if req.rid in self._streams:
            raise ValueError(f"request id {req.rid!r} is already in flight")
        stream = _Stream(asyncio.get_running_loop())
        self._streams[req.rid] = stream
        if (reason := self.failure()) is not None:  # it died while we tokenized: its end-of-streams missed this one
            del self._streams[req.rid]
            raise RuntimeError(f"{ENGINE_GONE}: {reason}")
        decode = self._decoder(req.params)
        stats = RequestStats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        self._send(AddRequest(req.rid, ids, req.params))
        done = False
        try:
            while not done:
                items = await stream.queue.get()
                while not stream.queue.empty():  # a slow consumer gets several tokens in one delta
                    items = items + stream.queue.get_nowait()
                piece = decode(items)
                delta = _delta(req.rid, piece, stats, t0)
                done = delta.finished
                if done and piece.stopped_early:
                    self.abort(req.rid)  # a stop string ended it before the scheduler did: free its KV now
                yield delta
        finally:
            del self._streams[req.rid]
            if not done:  # the consumer went away (client disconnect, Ctrl-C): free its KV
                self.abort(req.rid)

    def abort(self, rid: str) -> None:
        self._send(AbortRequest(rid))

    def _warm(self, ids: list[int]) -> PrefixWarm:
        rid = new_request_id("warm")
        warm = PrefixWarm(len(ids))
        self._warming[rid] = warm
        self._send(AddRequest(rid, ids, SamplingParams(max_new_tokens=1, ignore_eos=True)))
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
    stats.cached_tokens = piece.cached_tokens
    if piece.error or piece.finish_reason:
        stats.latency_s = now - t0
    if piece.error:
        return Delta(rid, error=piece.error, stats=stats)
    if log.isEnabledFor(logging.INFO) and piece.token_ids:
        lps = f" logprobs {[round(lp.logprob, 3) for lp in piece.logprobs]}" if piece.logprobs else ""
        log.info("decode %s: token ids %s -> %r%s", rid, piece.token_ids, piece.text, lps)
    return Delta(rid, piece.text, piece.token_ids, piece.finish_reason, stats if piece.finish_reason else None,
                 logprobs=piece.logprobs)


def _ended(items: list[TokenOutput]) -> bool:
    return items[-1].finish_reason is not None or items[-1].error is not None


class LocalClient(RoutedClient):
    """The in-process EngineClient: engine and scheduler in this process, the loop on a thread;
    each request's tokens are detokenized on its consumer's event loop."""

    def __init__(self, engine_cfg: EngineConfig | None = None, sched_cfg: SchedulerConfig | None = None,
                 engine: Engine | None = None):
        super().__init__()
        self._stop = threading.Event()
        self.tokenizer: Tokenizer | None = None
        # The scheduler thread builds the engine (unless one is given) as well as stepping it: the CPU ops' thread
        # pool (OpenMP's, one per thread that starts parallel work) is then the only one in the process. A second
        # one, made here by loading the weights, makes both spin-wait less: decode ran 2x slower on 2 cores.
        built: concurrent.futures.Future[Scheduler] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine, engine_cfg or EngineConfig(),
                                                                sched_cfg or SchedulerConfig(), built),
                                        name="minisgl-scheduler", daemon=True)
        self._thread.start()
        scheduler = built.result()  # re-raises what the build raised (ModelLoadError, ValueError)
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minisgl-tokenize")
        self.info = engine_info(scheduler.engine, scheduler)
        # Only the thread holds the scheduler (and the engine it built): both go when it ends, weights and KV pool
        # with them, while this client may be kept (an LLM closed but still referenced).
        self._inbox = scheduler.inbox
        self._scheduler = weakref.ref(scheduler)

    def _run(self, engine: Engine | None, engine_cfg: EngineConfig, sched_cfg: SchedulerConfig,
             built: concurrent.futures.Future[Scheduler]) -> None:
        try:
            e = engine or Engine(engine_cfg)
            self.tokenizer = Tokenizer(e.loaded.model_dir) if e.loaded.model_dir is not None else None
            eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
            scheduler = Scheduler(e, sched_cfg, self._on_output, eos_token_ids=eos)
        except BaseException as exc:  # noqa: BLE001 (handed to the constructor, which raises it)
            built.set_exception(exc)
            return
        built.set_result(scheduler)
        try:
            scheduler.run_forever(self._stop)
        finally:
            if not self._stop.is_set():
                log.error("minisgl: the scheduler thread exited")
                self._fail_all("the scheduler thread exited")

    def _send(self, msg: ToScheduler) -> None:
        self._inbox.put(msg)

    def _error_item(self, rid: str, error: str) -> TokenOutput:
        return TokenOutput(rid, None, None, error=error)

    def _on_output(self, msg: FromScheduler) -> None:
        """On the scheduler thread: route a step's outputs by request id."""
        if not isinstance(msg, StepOutput):
            self._reply(msg.qid, msg)
            return
        by_rid: dict[str, list] = {}
        for o in msg.outputs:
            by_rid.setdefault(o.rid, []).append(o)
        self._route(by_rid, _ended)

    def _decoder(self, params: SamplingParams) -> Callable[[list], DecodedPiece]:
        return RequestDecoder(self.tokenizer, params).feed

    def input_ids(self, req: GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (chat template applied to messages), on the calling thread."""
        return prompt_ids(self.tokenizer, req)

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, self.input_ids, req)

    def insert_prefix(self, prefix: str | list[int]) -> PrefixWarm:
        return self._warm(prompt_ids(self.tokenizer, GenerateRequest(prompt=prefix) if isinstance(prefix, str)
                                     else GenerateRequest(input_ids=list(prefix))))

    def healthy(self) -> bool:
        scheduler = self._scheduler()
        return (scheduler is not None and self._thread.is_alive()
                and time.monotonic() - scheduler.heartbeat < STALL_S)

    def failure(self) -> str | None:
        return None if self._thread.is_alive() or self._stop.is_set() else "the scheduler thread exited"

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)  # wake an idle loop
        self._thread.join(timeout=30)
        self._tokenize_pool.shutdown(wait=False)
        self._fail_all("the client was closed")  # streams still open end with an error, not silence
        if not self._thread.is_alive():
            # Free the engine now (its parts refer to each other) and give its CUDA memory back to the device: the
            # next engine in this process sizes its KV pool from the free memory.
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()


def engine_info(e: Engine, scheduler: Scheduler) -> ModelInfo:
    """ModelInfo of an engine and the scheduler driving it (in whichever process they live)."""
    loaded, mc = e.loaded, e.model_cfg
    return ModelInfo(
        loaded.name, loaded.source, str(e.device), str(e.dtype).removeprefix("torch."), e.attn.name,
        str(loaded.model_dir) if loaded.model_dir is not None else None, mc.vocab_size, e.pool.page_size,
        scheduler.max_running, e.max_context_len, e.pool.num_pages * e.pool.page_size, loaded.load_s,
        scheduler.overlap, tuple(sorted(scheduler.eos)), e.tp.size, "sgl" if e.kernels.sgl is not None else "torch",
        quantization=e.quantization, kv_cache_dtype=str(e.kv_dtype).removeprefix("torch."),
    )
