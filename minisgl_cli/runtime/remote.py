"""RemoteClient: the EngineClient of the multi-process runtime, in the API process.

Prompts go to a tokenizer worker, which tokenizes and admits them and keeps their ids: this side holds a `Prompt` of
their number (`kept`), and the requests made from it name it, so the ids cross from that worker to the scheduler only
(with --dp the pool routes by the ids: they come back, `keep_prompts` off). Each request goes to the worker that keeps
its prompt, else always the same one for its id, and its abort follows it there (never overtaking it). Text pieces
come back from the detokenizer on one socket, read by one thread and routed by request id to each stream's event loop,
exactly as the in-process client routes tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import weakref
import zlib
from collections.abc import Callable

import zmq

from minisgl_cli.admission import AdmissionError
from minisgl_cli.client.base import BaseClient, settle
from minisgl_cli.client.protocol import ENGINE_GONE, STALL_S, EngineGone, PrefixWarm
from minisgl_cli.messages import (
    AbortRequest,
    AddRequest,
    CheckPagesReply,
    DecodedPiece,
    DetokOutput,
    ForgetPrompt,
    Heartbeat,
    StatsReply,
    TokenizeQuery,
    TokenizeReply,
    ToScheduler,
    encode,
)
from minisgl_cli.runtime.ipc import Endpoints, pull, push, recv
from minisgl_cli.runtime.supervisor import Runtime
from minisgl_cli.types import ErrorCode, GenerateRequest, ImageInput, ModelInfo, Prompt, SamplingParams, SchedulerStats
from minisgl_cli.vision import pixels
from minisgl_cli.vision.processor import has_images, messages_to_wire

log = logging.getLogger("minisgl.runtime")


def _merge(pieces: list[DecodedPiece]) -> DecodedPiece:
    """Several pieces of one request (a slow consumer) as one; the detokenizer already handled stop strings."""
    first, last = pieces[0], pieces[-1]
    if len(pieces) == 1:
        return first
    return DecodedPiece(
        last.rid, "".join(p.text for p in pieces), [t for p in pieces for t in p.token_ids], last.finish_reason,
        last.error, last.cached_tokens, next((p.prefill_s for p in pieces if p.prefill_s is not None), None),
        logprobs=[lp for p in pieces for lp in p.logprobs or []] if any(p.logprobs for p in pieces) else None,
        error_code=last.error_code, stop_string=last.stop_string,
    )


SEND_TIMEOUT_MS = 10_000
Outgoing = ToScheduler | TokenizeQuery | ForgetPrompt  # what this side sends a worker


def _worker(key: str, n: int) -> int:
    return zlib.crc32(key.encode()) % n


class RemoteClient(BaseClient):
    def __init__(self, info: ModelInfo, endpoints: Endpoints, num_tokenizer: int, runtime: Runtime,
                 keep_prompts: bool = True):
        super().__init__()
        self.info = info
        self.runtime = runtime
        self.keep_prompts = keep_prompts  # the workers keep the prompts' ids (off: they come here, for --dp's pool)
        self._ctx = zmq.Context()
        self._inbox = pull(self._ctx, endpoints.api)
        targets = [endpoints.tokenizer(i) for i in range(num_tokenizer)] or [endpoints.detokenizer]
        # Only the sender thread touches these (zmq sockets are not thread-safe): fronts hand it messages through a
        # queue, so a send never blocks an event loop; one that cannot leave in SEND_TIMEOUT_MS (the worker is gone
        # or wedged) fails its request instead of waiting for ever.
        self._out = [push(self._ctx, t, timeout_ms=SEND_TIMEOUT_MS) for t in targets]
        self._outbox: queue.SimpleQueue[tuple[Outgoing, bytes, int] | None] = queue.SimpleQueue()
        self._via: dict[str, int] = {}  # with several workers: the one holding each open request's kept prompt
        self._beat = time.monotonic()
        self._closed = False
        # Image pixels a tokenizer worker put in shared memory for this process's prompts, not yet handed to a
        # scheduler (which unlinks what it is handed): unlinked here when their prompt is dropped unsent.
        self._unsent: dict[str, weakref.finalize] = {}
        self._sender = threading.Thread(target=self._send_loop, name="minisgl-api-send", daemon=True)
        self._sender.start()
        self._receiver = threading.Thread(target=self._receive, name="minisgl-api-recv", daemon=True)
        self._receiver.start()
        runtime.on_death(self._fail_all)

    # --- transport -----------------------------------------------------------------------------
    def _send(self, msg: Outgoing) -> None:
        """Hand `msg` to the sender thread, encoded here: a request holding what msgpack cannot carry (an integer past
        64 bits in a tool's JSON schema) is a ValueError for its caller, not the end of the sender."""
        if self._closed:  # an abort from a stream that outlives close() goes nowhere
            return
        try:
            data = encode(msg)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"the request holds a value the engine's processes cannot carry: {exc}") from None
        self._outbox.put((msg, data, self._target(msg)))

    def _target(self, msg: Outgoing) -> int:
        """The worker `msg` goes to: a kept prompt's, for its query, the requests made from it and their aborts (each
        after its request), and its forgetting; otherwise by request id or query id."""
        n = len(self._out)
        if n == 1:
            return 0
        if isinstance(msg, AddRequest) and msg.kept is not None:
            w = _worker(str(msg.kept), n)
            if msg.rid in self._streams:  # (a cache warm has none, and no abort)
                self._via[msg.rid] = w
            return w
        if isinstance(msg, AbortRequest) and msg.rid in self._via:
            return self._via[msg.rid]
        if isinstance(msg, ForgetPrompt):
            return _worker(str(msg.key), n)
        return _worker(msg.rid if isinstance(msg, AddRequest | AbortRequest) else str(msg.qid), n)

    def _closed_stream(self, rid: str) -> None:
        self._via.pop(rid, None)

    def _send_loop(self) -> None:
        while (item := self._outbox.get()) is not None:
            msg, data, target = item
            try:
                self._out[target].send(data, copy=False)
            except zmq.Again:
                self._undeliverable(msg)
            except zmq.ZMQError:  # the context is being destroyed: nothing more leaves
                return

    def _undeliverable(self, msg: Outgoing) -> None:
        """End what waits on a message that could not be sent: its stream, or its query."""
        reason = "the tokenizer/detokenizer does not take messages (gone or wedged)"
        if isinstance(msg, AddRequest):
            self._route({msg.rid: [self._error_item(msg.rid, f"{ENGINE_GONE}: {reason}", ErrorCode.UNAVAILABLE)]},
                        lambda items: True)
        elif not isinstance(msg, AbortRequest | ForgetPrompt) and (fut := self._replies.pop(msg.qid, None)) is not None:
            settle(fut, error=EngineGone(reason))

    def _receive(self) -> None:
        # Polls rather than blocking in recv: a socket may only be closed by its own thread's side of the
        # context, so close() waits for this loop to leave before destroying the context (else libzmq aborts).
        while not self._closed:
            if not self._inbox.poll(100):
                continue
            try:
                self._handle(recv(self._inbox))
            except Exception:  # this thread feeds every stream: one bad message is dropped, not the end of them all
                log.exception("the API process dropped a message it could not read or route")

    def _handle(self, msg: object) -> None:
        if isinstance(msg, DetokOutput):
            by_rid: dict[str, list[DecodedPiece]] = {}
            for p in msg.pieces:
                by_rid.setdefault(p.rid, []).append(p)
            self._route(by_rid, lambda items: items[-1].finished)
        elif isinstance(msg, Heartbeat):
            self._beat = time.monotonic()
        elif isinstance(msg, TokenizeReply):
            prompt = self._prompt_of(msg)
            if (fut := self._replies.pop(msg.qid, None)) is not None:  # else its caller gave up: the Prompt goes
                settle(fut, error=prompt) if isinstance(prompt, Exception) else settle(fut, prompt)
        elif isinstance(msg, StatsReply | CheckPagesReply):
            self._reply(msg.qid, msg)
        else:
            raise TypeError(f"unexpected message {type(msg).__name__}")

    def _decoder(self, params: SamplingParams) -> Callable[[list], DecodedPiece]:
        return _merge

    def _error_item(self, rid: str, error: str, code: ErrorCode) -> DecodedPiece:
        return DecodedPiece(rid, "", [], None, error, 0, None, error_code=code)

    # --- EngineClient --------------------------------------------------------------------------
    async def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        return (await self._ask(req, keep=False)).ids

    async def prompt(self, req: GenerateRequest) -> Prompt:
        if req.tokenized is not None or (not self.info.images and has_images(req.messages)):
            return await super().prompt(req)  # as made, or refuses the images
        if req.input_ids is not None:  # known first here: admitted here
            return self._admitted(Prompt(list(req.input_ids)), req)
        if has_images(req.messages):  # PIL images cross to the tokenizer worker as raw RGB bytes
            req = dataclasses.replace(req, messages=messages_to_wire(req.messages or []))
        return await self._ask(req, self.keep_prompts)

    async def _ask(self, req: GenerateRequest, keep: bool) -> Prompt:
        """The prompt of `req` from a tokenizer worker (tokenized and admitted there; its ids kept there if `keep`)."""
        qid = next(self._qids)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._replies[qid] = fut
        if (reason := self.failure()) is not None:  # it died before the query was registered: no reply will come
            self._replies.pop(qid, None)
            raise EngineGone(reason)
        try:
            self._send(TokenizeQuery(qid, req, self.info.vocab_size, self.info.max_context_len, keep))
            return await asyncio.wrap_future(fut)
        finally:  # answered, or given up (a hang-up, a deadline: the future is cancelled and a late reply dropped)
            self._replies.pop(qid, None)

    def _prompt_of(self, reply: TokenizeReply) -> Prompt | Exception:
        """A worker's answer as a Prompt that owns what the worker holds for it, made as the answer arrives (so that
        what a caller who gave up never takes is let go as well): its kept ids (forgotten when the Prompt goes) and
        its images' pixels (unlinked unless a request took them); or the error to raise."""
        if reply.error is not None:
            if reply.error_code is None:  # the template or the tokenizer failed
                return ValueError(reply.error)
            return AdmissionError(reply.error, ErrorCode(reply.error_code), reply.error_param)
        kept = reply.qid if reply.ids is None else None
        prompt = Prompt(reply.ids or [], reply.images, reply.tokens, kept)
        if kept is not None:
            weakref.finalize(prompt, self._send, ForgetPrompt(kept))
        for img in reply.images:
            assert img.shm is not None  # the worker shares what it made
            self._unsent[img.shm] = weakref.finalize(img, self._dropped, img.shm)
        return prompt

    def _dropped(self, name: str) -> None:
        """A prompt's image was never handed to a scheduler: its pixels go."""
        self._unsent.pop(name, None)
        pixels.unlink(name)

    def _own(self, images: list[ImageInput]) -> list[ImageInput]:
        """Each image as the scheduler will own it: a copy of the prompt's segment for every request, so each
        request's end unlinks its own. The prompt's segment lives as long as the prompt (`_dropped`): handing the
        segment itself to the first request let its scheduler unlink it before the next choice (n > 1) copied it."""
        out = []
        for img in images:
            if img.shm is not None:
                out.append(dataclasses.replace(img, shm=pixels.copy(img.shm, img.shape), pixels=None))
            else:  # pixels made in this process (an in-process processor's)
                out.append(dataclasses.replace(img, shm=pixels.write(img.pixels), pixels=None))
        return out

    def insert_prefix(self, prefix: str | list[int]) -> PrefixWarm:
        if isinstance(prefix, str):
            qid = next(self._qids)
            query = TokenizeQuery(qid, GenerateRequest(prompt=prefix), self.info.vocab_size, self.info.max_context_len,
                                  self.keep_prompts)
            prompt = self._query(query, qid, 30.0)
            if not isinstance(prompt, Prompt):
                raise ValueError("the tokenizer worker did not answer")
            return self._warm(prompt)
        return self._warm(self._admitted(Prompt(list(prefix)), GenerateRequest(input_ids=list(prefix))))

    def stats(self, timeout: float = 10.0) -> SchedulerStats:
        stats = super().stats(timeout)
        stats.process_cpu_s = self.runtime.cpu_seconds()  # the children's pids are known here, not in them
        return stats

    def healthy(self) -> bool:
        return not self._closed and self.runtime.alive() and time.monotonic() - self._beat < STALL_S

    def failure(self) -> str | None:
        return self.runtime.dead

    def close(self) -> None:
        """Stop every child (within 5 s) and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self.runtime.shutdown()
        self._receiver.join(5)
        self._outbox.put(None)
        self._sender.join(SEND_TIMEOUT_MS / 1000 + 1)  # a send in progress is bounded too
        self._ctx.destroy(linger=0)
