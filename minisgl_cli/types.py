"""Typed boundary objects: what a front asks of the engine, what streams back, and what the engine reports."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]


class ErrorCode(str, Enum):
    """Why a request failed, as a code every layer passes on and one table maps to HTTP (server/errors.py)."""

    INVALID_REQUEST = "invalid_request"  # the input's fault: bad ids, a grammar that does not compile, ...
    CONTEXT_LENGTH = "context_length"  # the prompt (plus max_tokens) does not fit the context
    UNSUPPORTED = "unsupported"  # a feature this engine or install lacks (e.g. structured output without xgrammar)
    ENGINE_FAILED = "engine_failed"  # the engine (or a process of it) failed while serving the request
    OVERLOADED = "overloaded"  # every replica is at its cap: retry later
    UNAVAILABLE = "unavailable"  # the engine is gone (a process or thread of it died)
    CANCELLED = "cancelled"  # the engine is shutting down or the client was closed
    TIMEOUT = "timeout"  # the request ran past its deadline (its `timeout`, or the server's): aborted


def error_code_of(exc: BaseException) -> ErrorCode:
    """The code of an exception a client raised instead of streaming: its own `code` where it has one, else the
    input's fault for a ValueError and the engine's for anything else."""
    code = getattr(exc, "code", None)
    if isinstance(code, ErrorCode):
        return code
    return ErrorCode.INVALID_REQUEST if isinstance(exc, ValueError) else ErrorCode.ENGINE_FAILED
MAX_TOP_LOGPROBS = 20

_ids = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_ids)}"


@dataclass
class SamplingParams:
    """Per-request sampling and stopping; field names follow the OpenAI / sglang APIs."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 means no top-k cut
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one (0 = off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF / vLLM semantics over the prompt and the output so far: a positive logit is divided by it, a negative one
    # multiplied (1 = off).
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    logprobs: bool = False  # report each output token's logprob (from the distribution the sampler drew from)
    top_logprobs: int = 0  # and the n most likely alternatives at each position (0..20)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    # Structured output (at most one): a JSON schema (text), a regular expression, an EBNF grammar, or xgrammar's
    # structural tag (JSON text: literal text, single special tokens and JSON schemas in sequence or alternation, as
    # harmony's forced tool calls need).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # False: the text comes whole with the last delta, decoded once at the end (no stop strings: they need it as
    # it grows), for a consumer that only wants the whole text (LLM.generate, the offline bench).
    stream_text: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if self.logit_bias:  # JSON and msgpack maps may carry the ids as strings
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError("top_k must be -1 (off), 0 (off) or a positive count")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise ValueError("repetition_penalty must be > 0")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
        if sum(x is not None for x in (self.json_schema, self.regex, self.ebnf, self.structural_tag)) > 1:
            raise ValueError("give at most one of json_schema, regex, ebnf, structural_tag")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0

    @property
    def constrained(self) -> bool:
        """A grammar restricts which tokens may come next."""
        return any(g is not None for g in (self.json_schema, self.regex, self.ebnf, self.structural_tag))

    @property
    def penalized(self) -> bool:
        """Presence or frequency penalty on: sampling depends on how often each token was output."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def repetition_penalized(self) -> bool:
        """Repetition penalty on: sampling depends on which tokens the prompt and output hold."""
        return self.repetition_penalty != 1.0


@dataclass
class ImageInput:
    """One image of a tokenized prompt, as the engine takes it: where its placeholder tokens sit in the prompt's
    ids, its patch grid, its content hash and where its pixels are (vision/processor.py makes it).

    The pixels (the processor's `pixel_values` rows, float32 [patches, channels * temporal * patch * patch]) are a
    tensor in the process that made them (`pixels`, never sent) and cross processes through shared memory (`shm`:
    vision/pixels.py), never inside a message."""

    hash: str  # hex digest of the processed pixels and grid: the radix cache keys the image's positions by it
    offset: int  # index of its first placeholder token in the prompt's ids
    tokens: int  # its placeholder tokens (t * h * w / merge**2)
    grid: list[int]  # [t, h, w] in patches
    shape: list[int]  # the pixel rows' shape
    shm: str | None = None  # the shared-memory segment holding the pixels (multi-process runtime)
    pixels: Any = None  # the pixel rows (torch.Tensor) in this process; None on the wire
    data: bytes | None = None  # the pixel rows' bytes, only for TP ranks on other hosts (--nnodes > 1)

    def __post_init__(self) -> None:
        self.grid, self.shape = list(self.grid), list(self.shape)  # msgpack hands back lists or tuples

    @property
    def key(self) -> int:
        """A number derived from the hash: the radix cache's stand-in for each of this image's placeholder ids."""
        return int(self.hash[:15], 16)


@dataclass
class Prompt:
    """A request's prompt as the engine takes it, admitted (`admission.admit_prompt`) by the client that made it: its
    token ids, and the images whose placeholders they hold.

    In the multi-process runtime the tokenizer worker that made the ids keeps them (`kept`: its key for them) and the
    API process holds only their number (`tokens`): the ids go from that worker to the scheduler, never here and back.
    """

    ids: list[int]  # empty where they are kept
    images: list[ImageInput] = field(default_factory=list)
    tokens: int = -1  # how many ids (set from `ids` where they are here)
    kept: int | None = None  # the tokenizer worker's key for the ids it keeps (runtime/remote.py)

    def __post_init__(self) -> None:
        if self.kept is None:
            self.tokens = len(self.ids)


@dataclass
class GenerateRequest:
    """One generation request as a front builds it: exactly one of prompt, messages, input_ids, tokenized.

    `tokenized`: a prompt a client's `prompt()` made and admitted (the server tokenizes before it sizes the budget;
    its images ride with it); messages carry theirs as `{"type": "image", "image": <PIL image>}` parts."""

    prompt: str | None = None
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=new_request_id)
    tools: list[dict] | None = None  # OpenAI function tools, handed to the chat template with `messages`
    tokenized: Prompt | None = None
    # The request field an error about the prompt names (OpenAI's `param`), for a front whose prompt came in another
    # field (the server: "messages", "prompt"); None: input_ids if given, else prompt.
    prompt_param: str | None = None
    template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template (e.g. enable_thinking)

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.input_ids, self.tokenized))
        if given != 1:
            raise ValueError("give exactly one of prompt, messages, input_ids, tokenized")

    @property
    def prompt_field(self) -> str:
        """The field an error about the prompt names: prompt_param, else input_ids or prompt."""
        return self.prompt_param or ("input_ids" if self.input_ids is not None else "prompt")


@dataclass
class RequestStats:
    """Per-request figures reported with the final delta (and shown by chat, /generate, bench)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    prefill_s: float = 0.0  # scheduler time from joining a prefill batch to the first token
    drafted_tokens: int = 0  # speculative decoding: output tokens that were accepted drafts

    @property
    def decode_tok_s(self) -> float:
        decode_time = self.latency_s - self.ttft_s
        return (self.completion_tokens - 1) / decode_time if decode_time > 0 and self.completion_tokens > 1 else 0.0

    @property
    def accept_length(self) -> float:
        """Output tokens per engine step of this request (1 without accepted drafts: each step adds one token of
        its own, after the drafts it accepted)."""
        steps = self.completion_tokens - self.drafted_tokens
        return self.completion_tokens / steps if steps > 0 else 1.0

    @property
    def drafted_tok_s(self) -> float:
        """Accepted draft tokens per second of decode."""
        decode_time = self.latency_s - self.ttft_s
        return self.drafted_tokens / decode_time if decode_time > 0 else 0.0


@dataclass
class TopLogprob:
    """One candidate token at a position: its id, its text, its logprob."""

    token_id: int
    token: str
    logprob: float


@dataclass
class TokenLogprob:
    """One output token's logprob, and the most likely candidates at its position (when asked for)."""

    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class Delta:
    """One streamed piece of output: new text and token ids; finish_reason and stats on the last."""

    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    error_code: ErrorCode | None = None  # what kind of failure `error` is (set with it)
    error_param: str | None = None  # the request field `error` is about (OpenAI's `param`), where it names one
    stop_string: str | None = None  # on the last delta: the stop string that ended the request, if one did

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class Completion:
    """A whole (non-streamed) result: what `LLM.generate` and non-stream HTTP responses return."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stats: RequestStats
    logprobs: list[TokenLogprob] | None = None


_NOT_SUMMED = ("replicas", "process_cpu_s")  # SchedulerStats' fields that are not one figure


@dataclass
class SchedulerStats:
    """The engine's figures: queues, KV use, cache hits, token rates (for chat, /metrics, bench).

    None is "n/a": a figure the engine behind the client does not have (the hf and mlx engines have no KV page
    pool, hf no prefix cache, neither retracts nor counts scheduler steps), never a 0 standing in for it."""

    waiting: int = 0
    running: int = 0
    tokens_total: int | None = 0
    tokens_free: int | None = 0
    tokens_cached: int | None = 0  # held by the prefix cache (evictable or locked)
    tokens_in_use: int | None = 0  # held by running requests beyond their cached prefix
    # Sliding and full layers mixed (Gemma 3 / 4, gpt-oss): the sliding layers' window pages, in tokens (0: none)
    window_tokens_total: int | None = 0
    window_tokens_free: int | None = 0
    # KV bytes of both kinds of page (full and window): the pool's, and those not free (requests' and cached)
    kv_bytes_total: int | None = 0
    kv_bytes_used: int | None = 0
    # A linear-attention model's recurrent-state slots (kvcache/state.py): all of them, and those no request holds
    state_slots_total: int | None = 0
    state_slots_free: int | None = 0
    cache_hit_tokens: int | None = 0
    cache_miss_tokens: int | None = 0
    cache_hit_requests: int | None = 0
    cache_miss_requests: int | None = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_tok_s: float = 0.0  # rolling
    decode_tok_s: float = 0.0  # rolling
    steps: int | None = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retracted_requests: int | None = 0
    decode_compiling: int = 0  # engines building their compiled CPU decode step (cpu_step/compiled.py)
    decode_compiled: int = 0  # engines decoding through it
    # Speculative decoding: requests' verify rows run (each carrying drafts), the drafts they ran, those accepted.
    spec_verifies: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_tok_s: float = 0.0  # rolling: accepted draft tokens per second of decode
    # Vision-language models on the engine (vision/state.py): images the vision tower encoded, images whose
    # embeddings came from its cache instead, and the tower's seconds.
    images_encoded: int = 0
    image_cache_hits: int = 0
    vision_s: float = 0.0
    # CPU seconds (user + system) of each engine process by name ("detokenizer", "scheduler rank 0", ...): the
    # multi-process runtime's children; empty where the engine runs in the caller's process.
    process_cpu_s: dict[str, float] = field(default_factory=dict)
    # Data parallel: each replica's own figures (the fields above are then their sum over live replicas).
    replicas: list[ReplicaStats] = field(default_factory=list)

    @property
    def spec_accept_length(self) -> float | None:
        """Tokens a request gained per verify (its accepted drafts + the one drawn after them); None before any."""
        return (self.spec_accepted_tokens + self.spec_verifies) / self.spec_verifies if self.spec_verifies else None

    def add(self, **counts: int) -> None:
        """Add to counters (a counter the engine has no notion of, None, stays n/a: adding to it is a bug)."""
        for name, n in counts.items():
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"{name} is n/a for this engine")
            setattr(self, name, value + n)

    @property
    def cache_hit_rate(self) -> float | None:
        if self.cache_hit_tokens is None or self.cache_miss_tokens is None:
            return None
        total = self.cache_hit_tokens + self.cache_miss_tokens
        return self.cache_hit_tokens / total if total else 0.0

    @property
    def decode_step(self) -> str:
        """What runs the CPU decode (cpu_step/compiled.py): `building` while an engine builds its compiled step
        (decoding eagerly meanwhile), `compiled` where one runs it and none builds, else `eager` (CUDA: graphs)."""
        return "building" if self.decode_compiling else "compiled" if self.decode_compiled else "eager"

    @classmethod
    def total(cls, parts: list[SchedulerStats]) -> SchedulerStats:
        """The sum of several schedulers' figures (counters, queues, pools and rolling rates alike; n/a in any
        part stays n/a)."""
        def summed(name: str) -> Any:
            values = [getattr(p, name) for p in parts]
            return None if None in values else sum(values)

        total = cls(**{f.name: summed(f.name) for f in fields(cls) if f.name not in _NOT_SUMMED})
        total.process_cpu_s = {name: s for p in parts for name, s in p.process_cpu_s.items()}  # names differ
        return total

    def to_dict(self) -> dict[str, Any]:
        rate, accept = self.cache_hit_rate, self.spec_accept_length
        out = {**{f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SUMMED},
               "cache_hit_rate": None if rate is None else round(rate, 4),
               "spec_accept_length": None if accept is None else round(accept, 3), "decode_step": self.decode_step}
        if self.replicas:
            out["replicas"] = [r.to_dict() for r in self.replicas]
        return out


@dataclass
class ReplicaStats:
    """One data-parallel replica as the pool sees it: up or out, requests routed to it, its load, its scheduler."""

    replica: int
    alive: bool
    requests: int  # routed to it so far
    inflight: int  # its load: requests routed to it and not yet finished
    stats: SchedulerStats | None  # None once it is out (or when it did not answer)

    def to_dict(self) -> dict[str, Any]:
        rate = self.stats.cache_hit_rate if self.stats else None
        return {"replica": self.replica, "alive": self.alive, "requests": self.requests, "inflight": self.inflight,
                "cache_hit_rate": None if rate is None else round(rate, 4),
                "scheduler": self.stats.to_dict() if self.stats else None}


@dataclass(frozen=True)
class ModelInfo:
    """What a front may know of the engine behind a client (start-up line, limits, /v1/models)."""

    name: str
    source: str
    device: str
    dtype: str
    attention_backend: str
    model_dir: str | None  # the HF dir (tokenizer, config); None for built-in dummy configs
    vocab_size: int
    page_size: int
    max_running: int  # requests decoded together at most
    max_context_len: int
    kv_tokens: int | None  # None: no KV page pool (the hf and mlx engines)
    load_s: float
    overlap: bool  # overlap scheduling on
    eos_token_ids: tuple[int, ...] = ()
    tp_size: int = 1
    engine: str = "torch"  # what runs the model: torch (our engine), sgl (ours with sgl_kernel ops), hf, mlx
    prefix_cache: str | None = "radix"  # what serves cached prompt prefixes; None when nothing does (hf)
    dp_size: int = 1  # engine replicas behind the client (max_running and kv_tokens are then their sums)
    quantization: str = "none"  # how the linear weights are held: none (dense in dtype), int4, int8, fp8
    kv_cache_dtype: str = ""  # the KV pool's element type (bfloat16, float8_e4m3fn, ...); "" = dtype
    sampler: str = ""  # our engine's cut-and-draw implementation (torch, triton); "" where another library samples
    speculative: str = ""  # speculative decoding, e.g. "ngram k=3"; "" without
    images: bool = False  # the model takes images in chat messages (a vision-language model on the engine)

    @property
    def has_tokenizer(self) -> bool:
        return self.model_dir is not None
