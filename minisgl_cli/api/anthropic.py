"""The Anthropic Messages API's wire format: /v1/messages and /v1/messages/count_tokens requests and responses.

Validated at the edge like protocol.py's OpenAI models: a field Anthropic defines that minisgl does not implement is
a 400 naming it (`_UNIMPLEMENTED`), an unknown one too. The translation onto the engine's request lives in
server/messages_route.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from minisgl_cli.api.protocol import (
    MAX_MESSAGES,
    MAX_STOP,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    _refuse,
    _Strict,
    check_schema_size,
)

# Anthropic fields minisgl does not implement: name -> (why, the values that ask for nothing and so pass).
_UNIMPLEMENTED: dict[str, tuple[str, tuple]] = {
    "container": ("code-execution containers are not supported", ()),
    "mcp_servers": ("MCP servers are not supported", ((),)),
    "context_management": ("context management is not supported", ()),
    "service_tier": ("only the default tier exists", ("auto", "standard_only")),
    "output_config": ("not a setting minisgl implements", ()),
    "inference_geo": ("not a setting minisgl implements", ()),
    "speed": ("only the standard speed exists", ("standard",)),
    "diagnostics": ("not a setting minisgl implements", ()),
    "workspace_id": ("this server has no workspaces", ()),
}


class CacheControl(_Strict):
    """Accepted: the radix cache reuses every shared prefix anyway (cache_read_input_tokens counts its hits)."""

    type: Literal["ephemeral"]
    ttl: str | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: None = None


class Base64Source(_Strict):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None

    @property
    def url(self) -> str:
        s = self.source
        return s.url if isinstance(s, UrlSource) else f"data:{s.media_type};base64,{s.data}"


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] = ""
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if any(isinstance(b, ImageBlock) for b in self.content):
            raise ValueError("images in a tool_result are not supported: put the image in the user's content")
        return "".join(b.text for b in self.content if isinstance(b, TextBlock))


class ThinkingBlock(_Strict):
    """An earlier turn's reasoning, echoed back: left out of the prompt, as reasoning templates do."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> Message:
        if isinstance(self.content, list):
            wrong = {"user": (ToolUseBlock, ThinkingBlock, RedactedThinkingBlock),
                     "assistant": (ToolResultBlock, ImageBlock)}[self.role]
            for b in self.content:
                if isinstance(b, wrong):
                    raise ValueError(f"content: a {b.type} block cannot be in a {self.role} message")
        return self


class Tool(_Strict):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = Field(None, description="Accepted either way: forced calls always follow the schema.")

    @model_validator(mode="after")
    def _bounded(self) -> Tool:
        check_schema_size(self.input_schema, "input_schema")
        return self


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_iff_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice: name is required with type tool, and only then")
        return self


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    display: str | None = None


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=256, description="Written to the request log.")


class _Prompted(_Strict):
    """What a Messages request and a count_tokens request share: the prompt."""

    model: str
    messages: list[Message] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse(data, _UNIMPLEMENTED)

    @model_validator(mode="after")
    def _check_tools(self) -> _Prompted:
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in {t.name for t in self.tools or []}:
            raise ValueError(f"tool_choice: no tool is named {choice.name!r}")
        return self

    @property
    def system_text(self) -> str | None:
        s = self.system
        return s if isinstance(s, str) or s is None else "\n\n".join(b.text for b in s)


class MessagesRequest(_Prompted):
    max_tokens: int = Field(..., ge=0, le=MAX_TOKENS_LIMIT, description="0: prefill the prompt into the cache only.")
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP)
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0, description="0 = greedy (minisgl's default).")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOKENS_LIMIT)
    metadata: Metadata | None = None
    user_profile_id: str | None = Field(None, max_length=256, description="Written to the request log.")


class CountTokensRequest(_Prompted):
    pass


# --- responses -----------------------------------------------------------------------------------
class Usage(BaseModel):
    """Anthropic's usage: input_tokens are the prompt tokens the cache did not hold; cache reads are its hits."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[dict[str, Any]]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's error body: what /v1/messages answers with on any non-2xx status."""

    type: Literal["error"] = "error"
    error: ErrorDetail


# Anthropic's error type by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "timeout_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return ErrorResponse(error=ErrorDetail(type=ERROR_TYPES.get(status, "api_error"), message=message)).model_dump()
