"""The HTTP API's wire format: every request and response model of `minisgl serve`, validated at the edge.

Requests follow the OpenAI API (chat completions, completions, models) plus the reference stack's
`/generate`. Unknown OpenAI fields (user, logprobs, tools, ...) are ignored, so stock clients work;
anything the engine cannot honour is rejected here with a 422 before a handler runs.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union, cast

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from minisgl_cli.types import SamplingParams

# Bounds keep fuzzed or hostile values inside what torch and the scheduler accept.
MAX_TOKENS_LIMIT = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_STOP = 16


# --- errors --------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: what every non-2xx response of this server carries."""

    error: ErrorInfo


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 422, 429)
}


# --- sampling fields shared by every generation request ------------------------------------------
class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy (the default).")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT, description="Extension; -1 or 0 = off.")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP, description="Extension.")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = Field(False, description="Extension: keep generating past end-of-sequence.")

    def sampling_params(self, max_new_tokens: int, seed_offset: int = 0) -> SamplingParams:
        """Engine params; choice i of n gets seed + i so seeded choices differ but reproduce."""
        seed = self.seed
        if seed is not None and seed_offset:
            seed = (seed + seed_offset - SEED_MIN) % 2**64 + SEED_MIN
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature if self.temperature is not None else 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=self.top_k if self.top_k is not None else -1,
            seed=seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


# --- /v1/chat/completions ------------------------------------------------------------------------
class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        # The chat templates of small models know system/user/assistant only.
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# --- /v1/completions -----------------------------------------------------------------------------
TokenIds = list[int]
Prompt = Union[str, list[str], TokenIds, list[TokenIds]]


class CompletionRequest(_Sampling):
    prompt: Prompt = Field(..., description="A string, a list of strings, token ids, or a list of token id lists.")
    model: str | None = None
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT, description="OpenAI's default is 16.")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a token id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        # Validation made p one of the list types whole: all() tells token ids from a list of prompts.
        if all(isinstance(x, int) for x in p):
            return [cast(TokenIds, list(p))]  # one prompt of token ids
        return cast("list[str | list[int]]", list(p))


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


# --- /v1/models, /health -------------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "minisgl"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


# --- /generate (reference stack) -----------------------------------------------------------------
class GenerateBody(_Sampling):
    """`/generate`: exactly one of prompt, messages, input_ids; streams JSON lines unless stream=false."""

    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    input_ids: list[int] | None = None
    max_new_tokens: int = Field(128, ge=0, le=MAX_TOKENS_LIMIT)
    stream: bool = True


class GenerateDone(BaseModel):
    """The last JSON line of a streamed /generate (and the whole non-stream reply, with `text`)."""

    event: Literal["done"] = "done"
    rid: str
    text: str | None = None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    latency_ms: float
    decode_tok_s: float
    max_new_tokens_downscaled: str | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


# --- stream framing ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def chat_chunk(
    id: str, created: int, model: str, index: int, *, role: bool = False, content: str | None = None,
    finish_reason: str | None = None, with_usage_field: bool = False,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; `usage: null` appears on every chunk when include_usage is on."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    chunk: dict[str, Any] = {
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    id: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None,
    with_usage_field: bool = False,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(id: str, created: int, model: str, object: str, u: Usage) -> dict[str, Any]:
    """The extra last chunk of stream_options.include_usage: no choices, the whole request's usage."""
    return {"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": u.model_dump()}
