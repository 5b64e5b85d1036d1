"""The tokenizer and detokenizer worker processes.

A tokenizer worker tokenizes (chat template included), admits the prompt (admission.py: the first place its ids are
known) and keeps its ids; the API process holds only their number, and the requests it makes from the prompt name them
(`AddRequest.kept`). The worker passes each request on: to scheduler rank 0 with the ids, the one crossing they need,
and to the detokenizer without them (it wants the request's stop strings). Aborts and queries go straight through.
The detokenizer turns each scheduler step into text pieces for the API process, ends requests at stop strings
(telling rank 0 to free them), and forwards replies and heartbeats. With `--num-tokenizer 0` (the default) the
detokenizer does both jobs.

With `--stream-interval N` the detokenizer holds a request's tokens until N have come (the first token and the
end go at once), then decodes and sends them as one piece: N times fewer decodes, messages and SSE frames. A
request not streamed (stream_text off: a non-streaming API call, `LLM`) holds them to its end: its first token
(the API's TTFT) and then one message. A request with stop strings is decoded every token, so its stop is found
at the token that makes it, as before.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import signal
import time
from dataclasses import dataclass

import zmq

from minisgl_cli.admission import AdmissionError, admit_prompt
from minisgl_cli.messages import (
    AbortRequest,
    AddRequest,
    CheckPagesQuery,
    DecodedPiece,
    DetokOutput,
    ForgetPrompt,
    StatsQuery,
    StepOutput,
    TokenizeQuery,
    TokenizeReply,
    TokenOutput,
)
from minisgl_cli.runtime.child import Child, leave
from minisgl_cli.runtime.ipc import Endpoints, pull, push, recv, send
from minisgl_cli.tokenizer import RequestDecoder, Tokenizer, decode_steps, prompt_ids
from minisgl_cli.types import ErrorCode, ImageInput
from minisgl_cli.vision import pixels
from minisgl_cli.vision.processor import VisionProcessor, has_images

log = logging.getLogger("minisgl.runtime")

EARLY_S = 60.0  # outputs of a request not known here after this long are dropped (its AddRequest never comes)
EARLY_MAX = 4096  # requests whose outputs wait for their AddRequest, at most (the oldest are dropped first)


@dataclass(frozen=True)
class WorkerJob:
    index: int  # tokenizer worker index; -1 for the detokenizer
    model_dir: str | None
    endpoints: Endpoints
    tokenizes: bool
    detokenizes: bool
    log_level: int = logging.WARNING
    stream_interval: int = 1  # the detokenizer: send a request's text every this many tokens

    @property
    def name(self) -> str:
        return "detokenizer" if self.detokenizes else f"tokenizer {self.index}"


def run_worker(job: WorkerJob) -> None:
    """Process entry point: report Ready (or Failed) to the launcher, serve until SIGTERM, then exit 0 (a worker
    holds nothing to hand back)."""
    child = Child(job.name, job.name, job.log_level, job.endpoints.launcher)
    worker = child.start(functools.partial(_Worker, job))
    signal.signal(signal.SIGTERM, lambda *_: leave())
    child.ready()
    worker.serve()


class _Worker:
    def __init__(self, job: WorkerJob, ctx: zmq.Context):
        self.job = job
        self.tokenizer = Tokenizer(job.model_dir) if job.model_dir is not None else None
        # A vision-language model's image prompts (the HF processor loads with the first one).
        self.processor = VisionProcessor.of(job.model_dir) if job.tokenizes and job.model_dir is not None else None
        ep = job.endpoints
        self.inbox = pull(ctx, ep.detokenizer if job.detokenizes else ep.tokenizer(job.index))
        self.to_api = push(ctx, ep.api)
        self.to_scheduler = push(ctx, ep.scheduler)
        self.to_detok = push(ctx, ep.detokenizer) if job.tokenizes and not job.detokenizes else None
        self.decoders: dict[str, RequestDecoder] = {}
        self.kept: dict[int, list[int]] = {}  # the ids of prompts the API process holds by key (TokenizeQuery.keep)
        # Requests whose tokens may be held (no stop strings), with how many go out together: --stream-interval, or
        # all of them at the end where the text is not streamed (stream_text off); and, once a request's first token
        # went out, the tokens it holds.
        self.hold: dict[str, float] = {}
        self.held: dict[str, list[TokenOutput]] = {}
        self.held_tokens: dict[str, int] = {}  # how many tokens each holds: counted as they come, not per step
        # Outputs that beat their AddRequest here, by request, oldest first, with when the first came (`_forget`).
        self.early: dict[str, tuple[float, list[TokenOutput]]] = {}
        self.ended: collections.deque[str] = collections.deque(maxlen=4096)  # late outputs of these are dropped
        self.ended_set: set[str] = set()

    def serve(self) -> None:
        while True:
            self.handle(recv(self.inbox))

    def handle(self, msg: object) -> None:
        if isinstance(msg, StepOutput):
            self._detokenize(msg)
        elif isinstance(msg, TokenizeQuery):
            send(self.to_api, self._tokenize(msg))
        elif isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, ForgetPrompt):
            self.kept.pop(msg.key, None)
        elif isinstance(msg, AbortRequest | StatsQuery | CheckPagesQuery):
            send(self.to_scheduler, msg)  # aborts and queries pass through to rank 0
        else:  # replies and heartbeats from rank 0, on their way to the API process
            send(self.to_api, msg)

    def _tokenize(self, q: TokenizeQuery) -> TokenizeReply:
        images: list[ImageInput] = []
        try:
            if self.processor is not None and has_images(q.req.messages):  # the pixels go by shared memory
                prompt = self.processor.prompt(q.req.messages or [], q.req.tools, share=True,
                                               template_kwargs=q.req.template_kwargs)
                ids, images = prompt.ids, prompt.images
            else:
                ids = prompt_ids(self.tokenizer, q.req)
            admit_prompt(ids, q.vocab_size, q.max_context_len, q.req.prompt_field)
        except AdmissionError as exc:
            for img in images:  # shared already, and no request will ever take them
                if img.shm is not None:
                    pixels.unlink(img.shm)
            return TokenizeReply(q.qid, None, exc.message, error_code=exc.code, error_param=exc.param)
        except Exception as exc:  # template or tokenizer failures are the request's fault
            return TokenizeReply(q.qid, None, str(exc) or type(exc).__name__)
        if q.keep:
            self.kept[q.qid] = ids
            return TokenizeReply(q.qid, None, images=images, tokens=len(ids))
        return TokenizeReply(q.qid, ids, images=images, tokens=len(ids))

    def _add(self, msg: AddRequest) -> None:
        if msg.kept is not None:  # its prompt is kept until every request made from it left (ForgetPrompt)
            ids = self.kept.get(msg.kept)
            if ids is None:  # never: a bug ends that request, not this worker
                send(self.to_api, DetokOutput([DecodedPiece(
                    msg.rid, error="internal error: its prompt is not kept here", error_code=ErrorCode.ENGINE_FAILED)]))
                return
            msg.input_ids, msg.kept = ids, None
        if self.job.detokenizes:
            try:
                self.decoders[msg.rid] = RequestDecoder(self.tokenizer, msg.params)
            except Exception as exc:  # that request cannot be decoded: it fails alone
                log.exception("no decoder for %s", msg.rid)
                self._ended(msg.rid)  # outputs that still come for it are dropped
                self.early.pop(msg.rid, None)
                send(self.to_api, DetokOutput([DecodedPiece(
                    msg.rid, error=f"internal error: could not decode the output ({type(exc).__name__})",
                    error_code=ErrorCode.ENGINE_FAILED)]))
                send(self.to_scheduler, AbortRequest(msg.rid))
                return
            every = self.job.stream_interval if msg.params.stream_text else math.inf  # else nothing reads it sooner
            if every > 1 and not msg.params.stop:
                self.hold[msg.rid] = every
            if msg.rid in self.early:
                self._detokenize(StepOutput(self.early.pop(msg.rid)[1]))
        if self.job.tokenizes:
            if self.to_detok is not None:  # it decodes the output: the params are all it needs
                send(self.to_detok, AddRequest(msg.rid, [], msg.params))
            send(self.to_scheduler, msg)

    def _ended(self, rid: str) -> None:
        if len(self.ended) == self.ended.maxlen:
            self.ended_set.discard(self.ended[0])
        self.ended.append(rid)
        self.ended_set.add(rid)

    def _due(self, rid: str, held: list[TokenOutput]) -> bool:
        """Whether held tokens go out now: the request's end, or as many as it holds (`hold`)."""
        last = held[-1]
        return last.finish_reason is not None or last.error is not None or self.held_tokens[rid] >= self.hold[rid]

    def _forget(self) -> None:
        """Drop the early outputs whose request never came (an output beats its AddRequest by a message or two):
        those waiting EARLY_S, and the oldest past EARLY_MAX requests, so none outlives its request."""
        now = time.monotonic()
        while self.early:
            rid, (since, items) = next(iter(self.early.items()))
            if now - since < EARLY_S and len(self.early) < EARLY_MAX:  # room for one more
                return
            del self.early[rid]
            log.warning("dropped %d outputs of request %s: it is not known here", len(items), rid)

    def _detokenize(self, step: StepOutput) -> None:
        if self.early:
            self._forget()
        by_rid: dict[str, list[TokenOutput]] = {}
        for o in step.outputs:
            by_rid.setdefault(o.rid, []).append(o)
        work: list[tuple[str, RequestDecoder, list[TokenOutput]]] = []
        for rid, items in by_rid.items():
            decoder = self.decoders.get(rid)
            if decoder is None:
                if rid not in self.ended_set:  # e.g. the abort that follows a stop string: already answered
                    self.early.setdefault(rid, (time.monotonic(), []))[1].extend(items)
                continue
            if rid in self.held:
                held = self.held[rid]
                held.extend(items)
                self.held_tokens[rid] += sum(o.token_id is not None for o in items)
                if not self._due(rid, held):
                    continue
                items, self.held[rid], self.held_tokens[rid] = held, [], 0
            work.append((rid, decoder, items))
        # The whole step's text in one pass through the Rust tokenizer, not two HF calls per request.
        results = decode_steps(self.tokenizer, [(decoder, items) for _, decoder, items in work])
        pieces: list[DecodedPiece] = []
        for (rid, _, items), result in zip(work, results):
            if isinstance(result, BaseException):  # one request's failure ends that request, not every stream
                log.error("decoding the output of %s failed", rid, exc_info=result)
                why = f"internal error: could not decode the output ({type(result).__name__})"
                piece = DecodedPiece(rid, error=why, error_code=ErrorCode.ENGINE_FAILED)
                if not any(o.finish_reason or o.error for o in items):  # still running: free its KV
                    send(self.to_scheduler, AbortRequest(rid))
            else:
                piece = result
            if piece.finished:
                del self.decoders[rid]
                self._ended(rid)
                self.hold.pop(rid, None)
                self.held.pop(rid, None)
                self.held_tokens.pop(rid, None)
            elif rid in self.hold and piece.token_ids:  # its first token is out: hold what follows
                self.held.setdefault(rid, [])
                self.held_tokens.setdefault(rid, 0)
            if piece.stopped_early:  # a stop string ended it: free its KV on the scheduler now
                send(self.to_scheduler, AbortRequest(rid, "stop"))
                piece.stopped_early = False
            pieces.append(piece)
        if pieces:
            send(self.to_api, DetokOutput(pieces))
