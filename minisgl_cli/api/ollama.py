"""The ollama API's wire format: /api/chat and /api/generate requests, their `options`, the error body.

Validated at the edge like protocol.py's models. `options` that steer sampling map onto ours; those that size or
place a model being loaded (num_ctx, num_gpu, ...) have nothing to act on -- this server's model is loaded once, at
start, with its own flags -- and are accepted; sampling options minisgl does not implement (mirostat, tfs_z,
typical_p, ...) are a 400 naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from minisgl_cli.api.protocol import MAX_MESSAGES, MAX_STOP, _Strict, check_schema_size

# Load-time options: the model is already loaded, with the server's flags; they change nothing here.
LOAD_OPTIONS = ("numa", "num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
                "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep")
# Sampling options minisgl does not implement: name -> the values that ask for nothing (ollama's defaults).
_UNIMPLEMENTED = {"tfs_z": (1.0,), "typical_p": (1.0,), "repeat_last_n": (64,), "mirostat": (0,),
                  "mirostat_tau": (5.0,), "mirostat_eta": (0.1,), "penalize_newline": (False, True)}


class Options(_Strict):
    seed: int | None = None
    num_predict: int | None = Field(None, ge=-2, description="-1 (or -2): until the context is full.")
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: list[str] | None = Field(None, max_length=MAX_STOP)

    @model_validator(mode="before")
    @classmethod
    def _sort(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if k not in LOAD_OPTIONS}
        for name, harmless in _UNIMPLEMENTED.items():
            value = data.pop(name, None)
            if value is not None and value not in harmless:
                raise ValueError(f"{name}: not a sampling option minisgl implements")
        return data


class ToolCallFunction(_Strict):
    name: str
    arguments: dict[str, Any]
    index: int | None = None


class ToolCall(_Strict):
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] | None = None


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = Field(None, description="Base64 images: for a model on the engine that takes them.")
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Generating(_Strict):
    model: str
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = Field(None, description="Accepted: the model stays loaded while serving.")
    think: bool | Literal["low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _bounded(self) -> _Generating:
        if isinstance(self.format, dict):
            check_schema_size(self.format, "format")
        return self


class ChatRequest(_Generating):
    messages: list[Message] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(_Generating):
    prompt: str = ""
    system: str | None = None
    images: list[str] | None = None
    raw: bool | None = Field(None, description="true: the prompt as it is, no template.")
    suffix: str | None = None
    template: str | None = None
    context: list[int] | None = None

    @model_validator(mode="after")
    def _refused(self) -> GenerateRequest:
        for name, why in (("suffix", "fill-in-the-middle is not supported"),
                          ("template", "the chat template is the model's own; /v1/completions takes a bare prompt"),
                          ("context", "the deprecated context is not supported: send the text (or use /api/chat)")):
            if getattr(self, name):
                raise ValueError(f"{name}: {why}")
        return self


class ModelRequest(_Strict):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool | None = None
