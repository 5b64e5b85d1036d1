"""The HTTP API's wire format: every request and response model of `minisgl serve`, validated at the edge.

Requests follow the OpenAI API (chat completions with logprobs, structured outputs and tools; completions;
models) plus sglang's extensions and the reference stack's `/generate`. Every field is implemented or
refused: an unknown field, or an OpenAI field minisgl does not implement, is a 400 naming it, as is any
value the engine cannot honour, before a handler runs.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal, Union, cast

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minisgl_cli.types import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprob

# Bounds keep fuzzed or hostile values inside what torch and the scheduler accept, and one body from becoming
# unbounded work: each is checked while the body is validated, before any tokenizing (docs/server.md#bounds).
MAX_TOKENS_LIMIT = 2**31 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_N = 16
MAX_STOP = 16
MAX_STOP_CHARS = 1024  # each stop string: the detokenizer looks for every one after each token
MAX_PROMPTS = 2048  # prompts in one /v1/completions body (OpenAI's own limit)
MAX_BODY_REQUESTS = 2048  # engine requests one body may start: prompts x n
MAX_GRAMMAR_CHARS = 64 * 1024  # a regex, an EBNF grammar, a JSON schema (as JSON text): each compiles per request
MAX_LOGIT_BIAS = 1024
MAX_MESSAGES = 8192  # a chat's messages: each is validated, then rendered by the template and tokenized
MAX_TOOLS = 128
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a request's `timeout` at most


# --- errors --------------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: what every non-2xx response of this server carries."""

    error: ErrorInfo


class InputError(Exception):
    """A request the engine cannot serve as given: becomes a 4xx with an OpenAI error body (errors.py)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers


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
class _Strict(BaseModel):
    """A request part: a field this API does not know is a 400 naming it, never silently dropped."""

    model_config = ConfigDict(extra="forbid")


# OpenAI's reasoning efforts -> whether the model thinks (the chat template's `enable_thinking`). Templates have one
# switch, no depth: "low" thinks as much as "high".
EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


def thinks_at(effort: str) -> bool:
    """The thinking switch for a reasoning effort; ValueError for an effort OpenAI does not name."""
    if effort not in EFFORTS:
        raise ValueError(f"reasoning.effort: {effort!r} is not one of {', '.join(EFFORTS)}")
    return EFFORTS[effort]


# OpenAI fields minisgl does not implement: name -> (why, the values that ask for nothing and so pass). They are
# not fields of the models (the OpenAPI schema lists what works); a value outside those is a 400 naming them.
_CHAT_UNIMPLEMENTED: dict[str, tuple[str, tuple]] = {
    "audio": ("audio output is not supported", ()),
    "modalities": ('only ["text"] output is supported', (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "verbosity": ("not a setting minisgl implements", ()),
    "web_search_options": ("web search is not supported", ()),
    "functions": ("deprecated: use tools", ()),
    "function_call": ("deprecated: use tool_choice", ()),
    "store": ("stored completions are not supported", (False,)),
    "metadata": ("only stored completions take metadata, and they are not supported", ()),
    "service_tier": ("only the default tier exists", ("auto", "default")),
    "prompt_cache_key": ("not supported: the prefix cache needs no key", ()),
}
_COMPLETION_UNIMPLEMENTED: dict[str, tuple[str, tuple]] = {
    "echo": ("echoing the prompt is not supported", (False,)),
    "suffix": ("insertion (a suffix) is not supported", ()),
}


def _refuse(data: Any, table: dict[str, tuple[str, tuple]]) -> Any:
    """The request without the unimplemented fields that ask for nothing (null or a harmless value)."""
    if not isinstance(data, dict) or not any(name in data for name in table):
        return data
    data = dict(data)
    for name, (why, harmless) in table.items():
        value = data.pop(name, None)
        if value is not None and value not in harmless:
            raise ValueError(f"{name}: {why}")
    return data


def check_schema_size(schema: Any, field: str) -> None:
    """A JSON schema becomes a grammar compiled per request: its JSON text is bounded like a regex's."""
    size = len(schema) if isinstance(schema, str) else len(json.dumps(schema))
    if size > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{field}: the schema is {size} characters of JSON; at most {MAX_GRAMMAR_CHARS} are taken")


class JsonSchemaSpec(_Strict):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="Accepted either way: the schema is always enforced.")

    @model_validator(mode="after")
    def _bounded(self) -> JsonSchemaSpec:
        check_schema_size(self.schema_, "schema")
        return self


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format.json_schema is required with type json_schema, and only then")
        return self


class _Sampling(_Strict):
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy (the default).")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT, description="Extension; -1 or 0 = off.")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Extension (sglang, vLLM): drop tokens less "
                                "likely than min_p times the most likely one; 0 = off.")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP, description="Extension.")
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description=(
        "Extension (sglang, vLLM): over the prompt and the output so far, a positive logit is divided by it and "
        "a negative one multiplied; 1 = off."))
    ignore_eos: bool = Field(False, description="Extension: keep generating past end-of-sequence.")
    logit_bias: dict[int, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS,
        description="Token id -> bias in [-100, 100] added to its logit before sampling.",
        json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,9}$"}})
    # Structured output: OpenAI's response_format, and sglang's regex / ebnf extensions.
    response_format: ResponseFormat | None = None
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS,
                              description="Extension (sglang): the output matches this regular expression.")
    ebnf: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS,
                             description="Extension (sglang): the output follows this EBNF grammar (GBNF).")
    timeout: float | None = Field(None, gt=0.0, le=MAX_TIMEOUT_S, description=(
        "Extension: seconds the request may take in all (default and most: the server's --request-timeout); past "
        "it the request is aborted and answers 504 `request_timeout` (a stream ends with that error frame)."))

    @field_validator("stop")
    @classmethod
    def _short_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        longest = max(map(len, [stop] if isinstance(stop, str) else stop or []), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string of {longest} characters; at most {MAX_STOP_CHARS} are taken")
        return stop

    def structured(self) -> dict[str, str]:
        """The grammar the output must follow, as SamplingParams fields (empty: free text)."""
        rf = self.response_format
        given = [name for name, on in (("response_format", rf is not None and rf.type != "text"),
                                       ("regex", self.regex is not None), ("ebnf", self.ebnf is not None)) if on]
        if len(given) > 1:
            raise InputError(f"give at most one of response_format, regex, ebnf (got {', '.join(given)})", given[1])
        if self.regex is not None:
            return {"regex": self.regex}
        if self.ebnf is not None:
            return {"ebnf": self.ebnf}
        if rf is None or rf.type == "text":
            return {}
        schema = rf.json_schema.schema_ if rf.json_schema is not None else {"type": "object"}
        return {"json_schema": json.dumps(schema)}

    def sampling_params(self, max_new_tokens: int, seed_offset: int = 0, vocab_size: int | None = None,
                        extra: dict[str, Any] | None = None) -> SamplingParams:
        """Engine params; choice i of n gets seed + i so seeded choices differ but reproduce."""
        seed = self.seed
        if seed is not None and seed_offset:
            seed = (seed + seed_offset - SEED_MIN) % 2**64 + SEED_MIN
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.logit_bias and vocab_size is not None:
            bad = [t for t in self.logit_bias if not 0 <= t < vocab_size]
            if bad:
                raise InputError(f"logit_bias: token id {bad[0]} is out of range: the vocabulary has {vocab_size} "
                                 "tokens", "logit_bias")
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature if self.temperature is not None else 0.0,
            top_p=self.top_p if self.top_p is not None else 1.0,
            top_k=self.top_k if self.top_k is not None else -1,
            min_p=self.min_p or 0.0,
            seed=seed,
            stop=[s for s in stop if s],
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty if self.repetition_penalty is not None else 1.0,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            **(extra or {}),
        )


class StreamOptions(_Strict):
    include_usage: bool = False


# --- /v1/chat/completions ------------------------------------------------------------------------
class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: str = Field(..., description="A data:image/...;base64,... URL; a local path under --allow-local-images DIR; "
                                      "http(s) only with --allow-remote-images.")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="Accepted; the model's processor "
                                                                            "decides the resolution.")


class ImagePart(_Strict):
    """An image beside the text of a user message: served by the vision-language model (`--vlm-model`)."""

    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str = Field(..., description="The arguments as JSON text.")


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallIn(ToolCall):
    index: int | None = None  # present on streamed calls a client may echo back


Content = str | list[TextPart]
UserContent = str | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]]


class _Message(_Strict):
    role: str  # each kind narrows it to its Literal: the discriminator
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = getattr(self, "content", None)
        text = content if isinstance(content, str) else "".join(getattr(p, "text", "") for p in content or [])
        role = self.role
        # The chat templates of small models know system/user/assistant (and tool) only.
        out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class SystemMessage(_Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(_Message):
    role: Literal["user"]
    content: UserContent

    @property
    def images(self) -> list[ImagePart]:
        return [p for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) else []


class AssistantMessage(_Message):
    """An earlier assistant turn; its tool calls come back with their results. The null fields are what the
    openai SDK echoes back from a response message."""

    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCallIn] | None = None
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: list[Any] | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def as_template_dict(self) -> dict[str, Any]:
        out = super().as_template_dict()
        if self.reasoning_content:  # the name gpt-oss's template (and harmony.render) reads earlier thoughts from
            out["thinking"] = self.reasoning_content
        if self.tool_calls:
            # Templates (Qwen, Llama 3.1) render arguments as a mapping: hand them the parsed JSON.
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        return out


class ToolMessage(_Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str = Field(..., description="The call this message answers.")

    def as_template_dict(self) -> dict[str, Any]:
        return {**super().as_template_dict(), "tool_call_id": self.tool_call_id}


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class FunctionDef(_Strict):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted either way: arguments of forced calls always follow "
                                                   "the schema.")

    @model_validator(mode="after")
    def _bounded(self) -> FunctionDef:
        check_schema_size(self.parameters, "parameters")  # a forced call compiles it into a grammar
        return self


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = Field(None, description="Return each output token's logprob (choices[].logprobs).")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: the n most "
                                                                                   "likely tokens at each position.")
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="false: at most one tool call per reply.")
    user: str | None = Field(None, max_length=256, description="An end-user id: written to the request log.")
    safety_identifier: str | None = Field(None, max_length=256, description="Written to the request log.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=16, description=(
        "Extension (vLLM, sglang): extra variables for the chat template, e.g. {\"enable_thinking\": false}."))
    reasoning_effort: str | None = Field(None, description=(
        "With --reasoning-parser: none / minimal turn the template's thinking off, low .. xhigh on (enable_thinking); "
        "harmony (gpt-oss): the system message's `Reasoning:` low / medium / high (none, minimal: low; xhigh: high)."))

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse(data, _CHAT_UNIMPLEMENTED)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        names = {t.function.name for t in self.tools or []}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: no tool is named {choice.function.name!r}")
        if self.reasoning_effort is not None:  # the switch of Qwen3's templates, the effort itself for harmony's
            self.chat_template_kwargs = {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort,
                                         "enable_thinking": thinks_at(self.reasoning_effort)}
        return self

    @property
    def has_images(self) -> bool:
        return any(isinstance(m, UserMessage) and m.images for m in self.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def tool_mode(self) -> str | None:
        """None (no tools in play), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprobOut(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprobOut):
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser: the thoughts, apart from the content
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class _Response(BaseModel):
    """What a chat and a text completion response share; each narrows `object` and `choices`, which keep their
    place here in the JSON (pydantic orders overridden fields as the base declares them)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


# --- /v1/completions -----------------------------------------------------------------------------
TokenIds = list[int]
CompletionPrompts = Union[str, list[str], TokenIds, list[TokenIds]]  # /v1/completions: one prompt or several


class CompletionRequest(_Sampling):
    prompt: CompletionPrompts = Field(
        ..., description="A string, a list of strings, token ids, or a list of token id lists.")
    model: str | None = None
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS_LIMIT, description="OpenAI's default is 16.")
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Return each token's logprob and the "
                                                                              "n most likely tokens at each position.")
    user: str | None = Field(None, max_length=256, description="An end-user id: written to the request log.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        n = data.get("n", 1) if isinstance(data, dict) else 1
        _bound_prompts(data, n)
        return _refuse(data, {**_COMPLETION_UNIMPLEMENTED, "best_of": ("only best_of=1 (or equal to n) is supported",
                                                                       (1, n))})

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


def _bound_prompts(data: Any, n: Any) -> None:
    """Refuse a body of too many prompts, or prompts x n, before its prompts are validated one by one (a 4 MB body
    holds a million short prompts)."""
    prompt = data.get("prompt") if isinstance(data, dict) else None
    if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], int):  # one prompt (token ids: one)
        return
    if len(prompt) > MAX_PROMPTS:
        raise ValueError(f"prompt: {len(prompt)} prompts in one request; at most {MAX_PROMPTS} are taken")
    if isinstance(n, int) and len(prompt) * n > MAX_BODY_REQUESTS:
        raise ValueError(f"n: {len(prompt)} prompts x n={n} make {len(prompt) * n} completions; one request may "
                         f"ask for at most {MAX_BODY_REQUESTS}")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


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
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    input_ids: list[int] | None = None
    max_new_tokens: int = Field(128, ge=0, le=MAX_TOKENS_LIMIT)
    stream: bool = True
    json_schema: str | dict[str, Any] | None = Field(None, description="sglang's: the output is JSON following "
                                                                       "this schema.")
    return_logprob: bool = Field(False, description="sglang's: each output token's logprob in `logprobs`.")
    top_logprobs_num: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="sglang's: with return_logprob, the "
                                                                            "n most likely tokens at each position.")

    @model_validator(mode="after")
    def _bounded(self) -> GenerateBody:
        if self.json_schema is not None:
            check_schema_size(self.json_schema, "json_schema")
        return self

    def structured(self) -> dict[str, str]:
        out = super().structured()
        if self.json_schema is not None:
            if out:
                raise InputError("give at most one of json_schema, response_format, regex, ebnf", "json_schema")
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    json.loads(schema)
                except ValueError as exc:
                    raise InputError(f"json_schema is not valid JSON: {exc}", "json_schema") from None
            return {"json_schema": schema if isinstance(schema, str) else json.dumps(schema)}
        return out


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
    logprobs: list[dict[str, Any]] | None = None  # non-stream replies with return_logprob


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


def json_logprob(x: float) -> float:
    """A logprob JSON can carry: OpenAI's floor -9999 for -inf (a token the grammar or top-k ruled out) and for NaN
    (a row whose logits overflowed, e.g. under a repetition penalty near 0)."""
    return x if x >= -9999.0 else -9999.0


def chat_logprobs(lps: list[TokenLogprob]) -> ChoiceLogprobs:
    """OpenAI's `choices[].logprobs` of chat: one entry per output token, each with its top candidates."""
    return ChoiceLogprobs(content=[TokenLogprobOut(
        token=t.token, logprob=json_logprob(t.logprob), bytes=list(t.token.encode()),
        top_logprobs=[TopLogprobOut(token=c.token, logprob=json_logprob(c.logprob), bytes=list(c.token.encode()))
                      for c in t.top]) for t in lps])


def completion_logprobs(lps: list[TokenLogprob], offset: int = 0) -> CompletionLogprobs:
    """OpenAI's legacy `choices[].logprobs` of completions; text offsets count from `offset`."""
    offsets = []
    for t in lps:
        offsets.append(offset)
        offset += len(t.token)
    return CompletionLogprobs(tokens=[t.token for t in lps], token_logprobs=[json_logprob(t.logprob) for t in lps],
                              top_logprobs=[{c.token: json_logprob(c.logprob) for c in t.top} for t in lps],
                              text_offset=offsets)


def chat_chunk(
    id: str, created: int, model: str, index: int, *, role: bool = False, content: str | None = None,
    finish_reason: str | None = None, with_usage_field: bool = False, tool_calls: list[dict] | None = None,
    logprobs: list[TokenLogprob] | None = None, reasoning_content: str | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`; `usage: null` appears on every chunk when include_usage is on."""
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    if reasoning_content is not None:
        delta["reasoning_content"] = reasoning_content
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
              "logprobs": chat_logprobs(logprobs).model_dump() if logprobs else None}
    chunk: dict[str, Any] = {
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def completion_chunk(
    id: str, created: int, model: str, index: int, text: str, finish_reason: str | None = None,
    with_usage_field: bool = False, logprobs: CompletionLogprobs | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "finish_reason": finish_reason,
                     "logprobs": logprobs.model_dump() if logprobs else None}],
    }
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(id: str, created: int, model: str, object: str, u: Usage) -> dict[str, Any]:
    """The extra last chunk of stream_options.include_usage: no choices, the whole request's usage."""
    return {"id": id, "object": object, "created": created, "model": model, "choices": [], "usage": u.model_dump()}
