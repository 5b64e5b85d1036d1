"""Vision-language chat in transformers beside the engine: a chat whose images the engine's model cannot take,
checked and prepared for the in-process VLM (vision/vlm.py: SmolVLM / Idefics3, or a Qwen VLM beside another served
model), whose reply streams as an engine client's does.

`ServerContext.start_chat` sends a chat here when it holds an image and the engine's model takes none (a Qwen2-VL /
Qwen2.5-VL engine runs image chats itself, as text ones), so every front that runs a chat (chat completions,
Messages, Responses, ollama) serves it through the same steps and answers it in its own shapes. What the VLM cannot
honour is a 400 naming the field; a `VlmPrompt` is the prepared chat, and its `submit` is what an `EngineRun` streams
(deadline, disconnects, metrics and the inflight slot as for the engine's requests).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from minisgl_cli.admission import AdmissionError
from minisgl_cli.api import protocol as p
from minisgl_cli.server.errors import InputError, admission_error
from minisgl_cli.types import Delta, GenerateRequest, SamplingParams
from minisgl_cli.vision.vlm import (
    LoadedVlm,
    Prepared,
    VlmChat,
    VlmLoadError,
    check_budget,
    prepare,
    refused_fields,
    stream,
)


def refuse(body: p.ChatCompletionRequest) -> None:
    """A 400 naming the first field the VLM chat does not implement."""
    fields = [name for name, on in (("tools", body.tool_mode is not None), ("n", body.n > 1),
                                    ("response_format", body.response_format is not None
                                     and body.response_format.type != "text"),
                                    ("regex", body.regex is not None), ("ebnf", body.ebnf is not None)) if on]
    fields += refused_fields(body.sampling_params(1, extra=dict(logprobs=bool(body.logprobs),
                                                               top_logprobs=body.top_logprobs or 0)))
    if fields:
        raise InputError(f"{fields[0]}: not supported with images (the vision-language model runs in transformers, "
                         "not on the engine); drop it or send text only", fields[0])


@dataclass
class VlmPrompt:
    """A chat prepared for the VLM: the loaded model and its processor's outputs (ids with the image tokens,
    pixels)."""

    loaded: LoadedVlm
    prepared: Prepared

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def prompt_tokens(self) -> int:
        return self.prepared.prompt_tokens

    def budget(self, requested: int | None) -> int:
        """max_new_tokens: what was asked, or what fits the VLM's context (a 400 past it)."""
        try:
            return check_budget(self.loaded, self.prepared, requested)
        except AdmissionError as exc:
            raise admission_error(exc) from None

    def request(self, params: SamplingParams, rid: str) -> GenerateRequest:
        """The one request a run of this chat streams (its prompt: the prepared ids, image tokens in)."""
        return GenerateRequest(input_ids=self.prepared.inputs["input_ids"][0].tolist(), params=params, rid=rid,
                               prompt_param="messages")

    def submit(self, req: GenerateRequest) -> AsyncGenerator[Delta]:
        """The reply (as `EngineClient.submit`'s): closing the stream stops the generation at its next token."""
        return stream(self.loaded, self.prepared, req.params, req.rid)


async def prepare_chat(vlm: VlmChat, chat: list[dict], template_kwargs: dict[str, Any] | None) -> VlmPrompt:
    """Load the VLM (on first use) and prepare `chat` (its image parts read already), off the event loop: a 500
    where the model cannot load, a 400 where the chat does not fit its template or processor."""
    loop = asyncio.get_running_loop()
    try:
        loaded = await loop.run_in_executor(None, vlm.load)
    except VlmLoadError as exc:
        raise InputError(str(exc), "model", 500, "vlm_unavailable") from None
    try:
        prepared = await loop.run_in_executor(None, prepare, loaded, chat, template_kwargs)
    except ValueError as exc:  # the template or the processor refused the input
        raise InputError(str(exc), "messages") from None
    return VlmPrompt(loaded, prepared)
