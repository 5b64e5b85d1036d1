"""The OpenAI Responses API's wire format: /v1/responses requests, their input items, and the response object.

Validated at the edge like protocol.py's models: a Responses field minisgl does not implement is a 400 naming it
(`_UNIMPLEMENTED`), built-in tools are refused by their type. The translation onto the engine's request and the
store of earlier responses live in server/responses_route.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from minisgl_cli.api.protocol import (
    MAX_MESSAGES,
    MAX_TOKENS_LIMIT,
    MAX_TOOLS,
    JsonSchemaSpec,
    _refuse,
    _Strict,
    check_schema_size,
)

_UNIMPLEMENTED: dict[str, tuple[str, tuple]] = {
    "background": ("background responses are not supported", (False,)),
    "background_options": ("background responses are not supported", ()),
    "conversation": ("conversations are not supported: chain responses with previous_response_id", ()),
    "context_management": ("context management is not supported", ()),
    "include": ("no extra output can be included", ((),)),
    "max_tool_calls": ("not a setting minisgl implements", ()),
    "prompt": ("stored prompt templates are not supported", ()),
    "top_logprobs": ("logprobs are served by /v1/chat/completions", (0,)),
    "truncation": ("the input is never truncated: a prompt past the context is a 400", ("disabled",)),
    "service_tier": ("only the default tier exists", ("auto", "default")),
    "stream_options": ("no stream options are implemented", ()),
    "moderation": ("not a setting minisgl implements", ()),
    "image": ("image output is not supported", ()),
    "access_programs": ("not a setting minisgl implements", ()),
    "prompt_cache_options": ("the prefix cache takes no options", ()),
}


class InputText(_Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] | None = None
    file_id: str | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


Part = Annotated[InputText | InputImage | Refusal, Field(discriminator="type")]


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(_Strict):
    """An earlier reply's thoughts, echoed back: left out of the prompt, as reasoning templates do."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _kind(item: Any) -> str:
    """An input item's type: a message may leave it out."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_kind)]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(None, description="Accepted either way: forced calls always follow the schema.")

    @model_validator(mode="after")
    def _bounded(self) -> FunctionTool:
        check_schema_size(self.parameters, "parameters")
        return self


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = Field(None, description="Only the default is implemented.")


class ReasoningConfig(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[Item] = Field(..., max_length=MAX_MESSAGES)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy (the default).")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256, description="Written to the request log.")
    safety_identifier: str | None = Field(None, max_length=256, description="Written to the request log.")
    reasoning: ReasoningConfig | None = None
    prompt_cache_key: str | None = Field(None, description="Accepted: the prefix cache needs no key.")
    prompt_cache_retention: Literal["in_memory"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data: Any) -> Any:
        return _refuse(data, _UNIMPLEMENTED)

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        for i, tool in enumerate(self.tools or []):
            if tool.get("type") != "function":
                raise ValueError(f"tools: tools[{i}] is the built-in tool {tool.get('type')!r}, which minisgl does not "
                                 "run: only function tools are supported")
            try:
                FunctionTool.model_validate(tool)
            except ValueError as exc:
                raise ValueError(f"tools: tools[{i}] is not a function tool: {exc}") from None
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(choice, NamedFunction) and choice.name not in {t.get("name") for t in self.tools or []}:
            raise ValueError(f"tool_choice: no tool is named {choice.name!r}")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None or fmt.name is None:
                raise ValueError("text: format json_schema needs a name and a schema")
            JsonSchemaSpec.model_validate({"name": fmt.name, "schema": fmt.schema_})  # the same bounds as chat's
        return self

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [FunctionTool.model_validate(t) for t in self.tools or []]
