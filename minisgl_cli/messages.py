"""Every message between a front's client, the tokenizer / detokenizer workers, the schedulers and the media worker.

Typed dataclasses, the same in one process and across processes: a client sends `AddRequest`,
`AbortRequest` and named queries; a scheduler answers with one `StepOutput` per step (every request's
new token, keyed by request id) and a reply per query; a detokenizer turns step outputs into
`DecodedPiece`s. Nothing here holds a callback, so `encode` / `decode` (msgpack) carry any of them
over ZMQ.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import msgpack

from minisgl_cli.types import (
    ErrorCode,
    FinishReason,
    GenerateRequest,
    ImageInput,
    ModelInfo,
    SamplingParams,
    SchedulerStats,
    TokenLogprob,
    TopLogprob,
)


# --- to the scheduler --------------------------------------------------------------------------------
@dataclass
class AddRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    images: list[ImageInput] = field(default_factory=list)  # a VLM prompt's (their pixels in shared memory)
    # From the API process only: the tokenizer worker keeps the ids under this key (TokenizeQuery.keep), input_ids is
    # empty; the worker fills them in as it passes the request on. A scheduler always gets the ids.
    kept: int | None = None


@dataclass
class AbortRequest:
    """End a request early: "abort" (its consumer went away) or "stop" (a stop string ended its text before the
    scheduler saw it end): either way its KV is freed; only "abort" counts as aborted."""

    rid: str
    reason: FinishReason = "abort"


@dataclass
class StatsQuery:
    qid: int


@dataclass
class CheckPagesQuery:
    """Ask the scheduler to verify its KV accounting (free + cached + in use == pool)."""

    qid: int


ToScheduler = AddRequest | AbortRequest | StatsQuery | CheckPagesQuery


# --- from the scheduler ------------------------------------------------------------------------------
@dataclass(slots=True)  # one per request per step: slots make it a quarter cheaper to build
class TokenOutput:
    """One request's result of one step: a token, or the end (finish reason or error)."""

    rid: str
    token_id: int | None
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    prefill_s: float | None = None  # on the first token: its prefill time, queueing excluded
    # Only when the request asked for logprobs: the token's, and the top candidates' ids and logprobs.
    logprob: float | None = None
    top_ids: list[int] | None = None
    top_logprobs: list[float] | None = None
    error_code: ErrorCode | None = None  # with `error`: what kind of failure (a plain str once it crossed msgpack)
    drafted: bool = False  # a draft token a verify step accepted (speculative decoding)


@dataclass
class StepOutput:
    """Everything one scheduler step (or one admission/abort) produced, in request order."""

    outputs: list[TokenOutput] = field(default_factory=list)


@dataclass
class StatsReply:
    qid: int
    stats: SchedulerStats


@dataclass
class CheckPagesReply:
    qid: int
    error: str | None  # None: the accounting is exact


FromScheduler = StepOutput | StatsReply | CheckPagesReply


# --- the multi-process runtime's own ------------------------------------------------------------------
@dataclass
class TokenizeQuery:
    """Ask a tokenizer worker for a request's prompt, admitted there against the engine's limits (`admit_prompt`: the
    worker starts before the engine knows its context). With `keep` the worker keeps the ids (under the qid, until
    `ForgetPrompt`) and answers with their number only: the requests made from it name them (`AddRequest.kept`)."""

    qid: int
    req: GenerateRequest
    vocab_size: int
    max_context_len: int
    keep: bool = False


@dataclass
class TokenizeReply:
    qid: int
    ids: list[int] | None  # None when kept, or refused (`error`)
    error: str | None = None
    images: list[ImageInput] = field(default_factory=list)  # a VLM prompt's (their pixels in shared memory)
    tokens: int = 0  # how many ids
    error_code: ErrorCode | None = None  # with `error`: an admission refusal's (None: the template or tokenizer failed)
    error_param: str | None = None  # with `error_code`: the field it is about


@dataclass
class ForgetPrompt:
    """The API process dropped a kept prompt (every request made from it went before this): its ids go."""

    key: int


@dataclass(slots=True)
class DecodedPiece:
    """What one batch of a request's token outputs adds: text, ids, and how it ends (if it does)."""

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    cached_tokens: int = 0
    prefill_s: float | None = None  # set on the batch holding the first token
    stopped_early: bool = False  # a stop string ended it while the scheduler still runs it
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    error_code: ErrorCode | None = None  # with `error`: what kind of failure
    drafted: int = 0  # of its tokens, the accepted drafts of verify steps (speculative decoding)
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop"), if one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class DetokOutput:
    """A detokenizer's pieces for one scheduler step."""

    pieces: list[DecodedPiece]


@dataclass
class Heartbeat:
    """Rank 0's loop came round (sent about once a second through the detokenizer): the engine is live."""

    time: float


@dataclass
class RankBatch:
    """What rank 0 hands the other TP ranks before each step: the messages it will handle, in order."""

    msgs: list[Any]
    stop: bool = False


@dataclass
class Ready:
    """A child process is up; rank 0 sends its engine's ModelInfo."""

    proc: str
    info: ModelInfo | None = None
    detail: str = ""


@dataclass
class Failed:
    """A child process could not start; `error` is the one line the user sees."""

    proc: str
    error: str


# --- the media worker (media/worker.py) and its client (media/service.py) --------------------------------
@dataclass
class MediaSubmit:
    """A job for the media worker: `kind` "image" (num_images per prompt) or "video" (num_frames at fps);
    `output_format` png / jpeg / webp (images, `quality` 1-100 for the lossy two) or mp4 / frames (video);
    `partial_images` previews decoded between steps (images)."""

    jid: str
    kind: str
    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    num_images: int = 1
    num_frames: int = 0
    fps: int = 0
    output_format: str = "png"
    quality: int | None = None
    partial_images: int = 0


@dataclass
class MediaCancel:
    """Drop a job: unqueued if it waits; if it runs, dropped at the next step end (the call stops once every job
    of its batch is dropped)."""

    jid: str


@dataclass
class MediaProgress:
    """A job's steps done (0: its batch started: `batch` ids the pipeline call, `batch_size` its images);
    `step_s` the last step's seconds."""

    jid: str
    step: int
    steps: int
    batch: int = 0
    batch_size: int = 0
    step_s: float = 0.0


@dataclass
class MediaPartial:
    """A preview of image `image` of a job, decoded from the latents after a step, encoded as the job asked."""

    jid: str
    image: int
    index: int
    data: bytes


@dataclass
class MediaResult:
    """A job's end: its images (or one mp4, or the video's PNG frames), encoded as asked."""

    jid: str
    items: list[bytes]
    seed: int
    elapsed_s: float  # the pipeline call (its whole batch)
    prompt_tokens: int = 0
    encode_s: float = 0.0  # this job's items encoded (PNG, mp4...) in the worker, after the call


@dataclass
class MediaFailed:
    """A job's end without a result: refused (status 4xx), cancelled (code "cancelled") or failed (5xx)."""

    jid: str
    message: str
    status: int = 500
    param: str | None = None
    code: str | None = None


FromMediaWorker = MediaProgress | MediaPartial | MediaResult | MediaFailed


# --- wire format -------------------------------------------------------------------------------------
_TYPES: list[type] = [
    SamplingParams, GenerateRequest, SchedulerStats, ModelInfo, TokenLogprob, TopLogprob, ImageInput,
    AddRequest, AbortRequest, StatsQuery, CheckPagesQuery,
    TokenOutput, StepOutput, StatsReply, CheckPagesReply,
    TokenizeQuery, TokenizeReply, ForgetPrompt, DecodedPiece, DetokOutput, Heartbeat, RankBatch, Ready, Failed,
    MediaSubmit, MediaCancel, MediaProgress, MediaPartial, MediaResult, MediaFailed,
]
_CODE = {cls: i for i, cls in enumerate(_TYPES)}
_FIELDS = {cls: operator.attrgetter(*(f.name for f in dataclasses.fields(cls))) for cls in _TYPES}
# A step's rows go as plain tuples (no per-row extension): 256 rows cost ~0.1 ms, not ~1.5.
_ROWS: dict[type, tuple[type, str]] = {StepOutput: (TokenOutput, "outputs"), DetokOutput: (DecodedPiece, "pieces")}


def _default(obj: Any) -> msgpack.ExtType:
    cls = type(obj)
    code = _CODE.get(cls)
    if code is None:
        what = f"the integer {obj} (past 64 bits)" if cls is int else f"a {cls.__name__}"
        raise TypeError(f"cannot send {what} between processes")
    rows = _ROWS.get(cls)
    if rows is not None:
        row_fields = _FIELDS[rows[0]]
        values: Any = [row_fields(r) for r in getattr(obj, rows[1])]
    else:
        values = _FIELDS[cls](obj)
        values = values if isinstance(values, tuple) else (values,)
    return msgpack.ExtType(code, msgpack.packb(values, default=_default))


def _ext(code: int, data: bytes) -> Any:
    cls = _TYPES[code]
    values = msgpack.unpackb(data, ext_hook=_ext, strict_map_key=False)  # logit_bias maps token ids
    rows = _ROWS.get(cls)
    if rows is not None:
        row = rows[0]
        return cls([row(*r) for r in values])
    return cls(*values)


def encode(msg: Any) -> bytes:
    return msgpack.packb(msg, default=_default)


def decode(data: bytes | memoryview) -> Any:  # a memoryview: zero-copy from a ZMQ frame
    return msgpack.unpackb(data, ext_hook=_ext, strict_map_key=False)  # logit_bias maps token ids
