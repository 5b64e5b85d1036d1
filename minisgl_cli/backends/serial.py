"""SerialClient: the EngineClient of an engine that runs one request at a time on a worker thread (hf, mlx).

Where LocalClient's scheduler batches requests, a serial engine's worker takes them in arrival order and runs
each to its end through the backend's `_generate`, which yields `DecodedPiece`s: new text (from the backend's own
streaming) and token ids. Stop strings are cut on the consumer's side by the matcher RequestDecoder uses, and a
cut aborts the request like any other abort. The figures are counted here; those a serial engine has no notion of
(KV pages, scheduler steps, retraction; prefix-cache hits where the backend has no cache) are None, "n/a".
A request field the backend cannot honour is refused with a ValueError naming it (400 at the server).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator

from minisgl_cli.client.base import BaseClient
from minisgl_cli.client.protocol import STALL_S, PrefixWarm
from minisgl_cli.messages import AbortRequest, AddRequest, DecodedPiece
from minisgl_cli.scheduler.stats import RollingRate
from minisgl_cli.tokenizer import StopStringMatcher, Tokenizer, prompt_ids
from minisgl_cli.types import (
    ErrorCode,
    FinishReason,
    GenerateRequest,
    Prompt,
    SamplingParams,
    SchedulerStats,
    error_code_of,
)

log = logging.getLogger("minisgl.backends")


class PieceDecoder:
    """One request's pieces, as the backend made them, -> one DecodedPiece: their text cut at the first stop string."""

    def __init__(self, params: SamplingParams):
        self.stopper = StopStringMatcher(list(params.stop))

    def feed(self, items: list[DecodedPiece]) -> DecodedPiece:
        last = items[-1]
        tokens = [t for p in items for t in p.token_ids]
        prefill_s = next((p.prefill_s for p in items if p.prefill_s is not None), None)
        if last.error:
            return DecodedPiece(last.rid, "", tokens, None, last.error, last.cached_tokens, prefill_s)
        reason = last.finish_reason
        text, hit_stop = self.stopper.push("".join(p.text for p in items))
        if hit_stop:
            reason = "stop"
        elif reason is not None:
            text += self.stopper.flush()
        early = hit_stop and last.finish_reason is None
        return DecodedPiece(last.rid, text, tokens, reason, None, last.cached_tokens, prefill_s, early,
                            stop_string=self.stopper.matched if hit_stop else None)


def _ended(items: list[DecodedPiece]) -> bool:
    return items[-1].finished


def refuse(engine: str, unsupported: dict[str, bool]) -> None:
    """ValueError naming the first field of `unsupported` (name -> whether the request uses it) that is set."""
    for name, used in unsupported.items():
        if used:
            raise ValueError(f"{name}: the {engine} engine does not implement it (use --engine torch)")


class SerialClient(BaseClient):
    """One request at a time: the worker thread pulls AddRequests from a queue and runs each through
    `_generate`; aborts mark the request, which the backend checks between tokens."""

    engine = "serial"  # ModelInfo.engine of the subclass
    prefix_cache: str | None = None  # what serves cached prompt prefixes, if anything (ModelInfo.prefix_cache)

    def __init__(self, tokenizer: Tokenizer, max_context_len: int):
        super().__init__()
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.heartbeat = time.monotonic()
        self._jobs: queue.Queue[AddRequest | None] = queue.Queue()
        self._lock = threading.Lock()
        self._live: set[str] = set()  # queued or running
        self._aborted: set[str] = set()
        self._running = 0
        self._stats = SchedulerStats(tokens_total=None, tokens_free=None, tokens_cached=None, tokens_in_use=None,
                                     state_slots_total=None, state_slots_free=None, window_tokens_total=None,
                                     window_tokens_free=None, kv_bytes_total=None, kv_bytes_used=None, steps=None,
                                     retracted_requests=None)
        if self.prefix_cache is None:
            s = self._stats
            s.cache_hit_tokens = s.cache_miss_tokens = s.cache_hit_requests = s.cache_miss_requests = None
        self._prefill_rate, self._decode_rate = RollingRate(), RollingRate(active=True)
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minisgl-tokenize")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"minisgl-{self.engine}", daemon=True)

    # --- what a backend implements -------------------------------------------------------------------
    def _generate(self, ids: list[int], params: SamplingParams,
                  stopped: Callable[[], bool]) -> Generator[DecodedPiece, None, None]:
        """Yield the request's pieces (rid left empty), the last with its finish reason; end early, without a
        finish reason, once `stopped()` is true."""
        raise NotImplementedError

    # --- the worker ---------------------------------------------------------------------------------
    def _start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    job = self._jobs.get(timeout=1.0)
                except queue.Empty:
                    self.heartbeat = time.monotonic()
                    continue
                if job is None:
                    break
                self._serve(job)
        finally:
            if not self._stop.is_set():
                log.error("minisgl: the %s engine's worker thread exited", self.engine)
                self._fail_all(f"the {self.engine} engine's worker thread exited")

    def _emit(self, piece: DecodedPiece) -> None:
        self.heartbeat = time.monotonic()
        if _ended([piece]):  # counted before the consumer hears of it, so its next stats() sees it
            with self._lock:
                self._live.discard(piece.rid)
                self._aborted.discard(piece.rid)
                self._running = 0
                self._stats.finished_requests += 1
                self._stats.aborted_requests += piece.finish_reason == "abort"
        self._route({piece.rid: [piece]}, _ended)

    def _serve(self, job: AddRequest) -> None:
        rid, ids = job.rid, job.input_ids

        def stopped() -> bool:
            return rid in self._aborted or self._stop.is_set()

        with self._lock:
            self._running = 1
        try:
            if len(ids) >= self.max_context_len:
                raise _Refused(f"the prompt has {len(ids)} tokens; the context limit is {self.max_context_len}")
            room = self.max_context_len - len(ids)
            params = job.params
            if params.max_new_tokens > room:  # as our engine does: the context limit ends it with "length"
                params = dataclasses.replace(params, max_new_tokens=room)
            self._run_job(rid, ids, params, stopped)
        except _Refused as exc:
            self._emit(DecodedPiece(rid, error=str(exc), error_code=error_code_of(exc)))
        except Exception as exc:  # the backend failed: this request ends with the error, the engine goes on
            log.exception("%s engine: request %s failed", self.engine, rid)
            if rid in self._live:  # not already ended (a failure after its last piece only gets logged)
                self._emit(DecodedPiece(rid, error=f"internal error: {type(exc).__name__}: {exc}",
                                        error_code=ErrorCode.ENGINE_FAILED))

    def _run_job(self, rid: str, ids: list[int], params: SamplingParams, stopped: Callable[[], bool]) -> None:
        if stopped():
            self._emit(DecodedPiece(rid, finish_reason="abort"))
            return
        if params.max_new_tokens == 0:
            self._emit(DecodedPiece(rid, finish_reason="length"))
            return
        t0 = time.perf_counter()
        first = True
        reason: FinishReason | None = None
        with contextlib.closing(self._generate(ids, params, stopped)) as pieces:
            for piece in pieces:
                piece.rid = rid
                now = time.perf_counter()
                if piece.token_ids:
                    decoded = len(piece.token_ids) - first  # the first token comes out of the prefill
                    with self._lock:
                        if first:
                            piece.prefill_s = now - t0
                            self._count_prefill(len(ids), piece.cached_tokens, now)
                        self._stats.decode_tokens += decoded
                        self._decode_rate.add(decoded, now)
                    first = False
                self._emit(piece)
                reason = piece.finish_reason
                if reason is not None or stopped():
                    break
        if reason is None:
            if not stopped():
                raise RuntimeError("the backend ended a request without a finish reason")
            self._emit(DecodedPiece(rid, finish_reason="abort"))

    def _count_prefill(self, prompt: int, cached: int, now: float) -> None:
        self._stats.prefill_tokens += prompt - cached
        self._prefill_rate.add(prompt - cached, now)
        if self.prefix_cache is not None:
            self._stats.add(cache_hit_tokens=cached, cache_miss_tokens=prompt - cached,
                            cache_hit_requests=int(cached > 0), cache_miss_requests=int(cached == 0))

    # --- the EngineClient side ------------------------------------------------------------------------
    def _send(self, msg: AddRequest | AbortRequest) -> None:
        with self._lock:
            if isinstance(msg, AbortRequest):
                if msg.rid in self._live:
                    self._aborted.add(msg.rid)
                return
            self._live.add(msg.rid)
        self._jobs.put(msg)

    def _error_item(self, rid: str, error: str, code: ErrorCode) -> DecodedPiece:
        return DecodedPiece(rid, error=error, error_code=code)

    def _decoder(self, params: SamplingParams) -> Callable[[list], DecodedPiece]:
        return PieceDecoder(params).feed

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, prompt_ids, self.tokenizer, req)

    def insert_prefix(self, prefix: str | list[int]) -> PrefixWarm:
        if self.prefix_cache is None:
            raise ValueError(f"the {self.engine} engine has no prefix cache to warm")
        req = GenerateRequest(prompt=prefix) if isinstance(prefix, str) else GenerateRequest(input_ids=list(prefix))
        return self._warm(self._admitted(Prompt(prompt_ids(self.tokenizer, req)), req))

    def stats(self, timeout: float = 10.0) -> SchedulerStats:
        with self._lock:
            s = SchedulerStats(**self._stats.__dict__)
            s.running = self._running
            s.waiting = len(self._live) - self._running
        s.prefill_tok_s, s.decode_tok_s = self._prefill_rate.rate(), self._decode_rate.rate()
        return s

    def check_pages(self, timeout: float = 10.0) -> None:
        raise NotImplementedError(f"the {self.engine} engine has no KV page pool to check")

    def healthy(self) -> bool:
        return self._thread.is_alive() and time.monotonic() - self.heartbeat < STALL_S

    def failure(self) -> str | None:
        if self._thread.is_alive() or self._stop.is_set():
            return None
        return f"the {self.engine} engine's worker thread exited"

    def close(self) -> None:
        self._stop.set()  # the request running stops at its next token
        self._jobs.put(None)
        self._thread.join(timeout=30)
        self._tokenize_pool.shutdown(wait=False)


class _Refused(Exception):
    """A request the engine turns down with a message for the user (400, not 500)."""
