"""The Anthropic Messages API: /v1/messages and /v1/messages/count_tokens, translated onto the chat request.

A Messages body becomes a `ChatCompletionRequest` (`to_chat`: system, turns, tool_use / tool_result blocks,
images, tools, tool_choice, sampling) and runs through `ServerContext.start_chat`, the chat completions route's
steps: the same template, admission, grammar of forced tools and engine run (image blocks the engine's model cannot
take: the VLM beside it, as in chat). Its output comes back as content
blocks (`text`, `tool_use`), `stop_reason` / `stop_sequence` and Anthropic's usage, or streamed as Anthropic's
events (message_start, content_block_start / _delta / _stop, message_delta, message_stop, with a ping after the
start). Errors carry Anthropic's body (errors.py picks it by path).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from minisgl_cli.api import anthropic as a
from minisgl_cli.api import protocol as p
from minisgl_cli.server import tools
from minisgl_cli.server.context import ChatRun, Ctx
from minisgl_cli.server.errors import InputError, engine_error
from minisgl_cli.server.gate import downscale_headers
from minisgl_cli.server.runs import sse, stream_response, templated
from minisgl_cli.types import Delta, RequestStats

router = APIRouter(tags=["anthropic"], responses={400: {"model": a.ErrorResponse}})

ENDPOINT = "/v1/messages"


def to_chat(body: a.MessagesRequest | a.CountTokensRequest, reasoning: str | None) -> p.ChatCompletionRequest:
    """The chat completions request a Messages body asks for (a 400 naming the field where it cannot be one);
    `reasoning`: the server's reasoning parser (None: `thinking` cannot be enabled)."""
    messages: list[dict[str, Any]] = []
    if body.system_text:
        messages.append({"role": "system", "content": body.system_text})
    for m in body.messages:
        messages += _turn(m)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                            "parameters": t.input_schema}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if body.thinking is not None:
        on = body.thinking.type != "disabled"
        if on and reasoning is None:
            raise InputError("thinking: this server runs no reasoning parser for its model (--reasoning-parser)",
                             "thinking")
        chat["chat_template_kwargs"] = {"enable_thinking": on}  # Qwen3's switch; templates without it ignore it
    if isinstance(body, a.MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stream=body.stream, temperature=body.temperature, top_p=body.top_p,
                    top_k=body.top_k, stop=body.stop_sequences)
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InputError(f"messages: {err['msg']}", "messages") from None


def _turn(m: a.Message) -> list[dict[str, Any]]:
    """One Messages turn as chat messages: tool results become tool messages (before the user's own text, as
    Anthropic orders them), tool_use blocks the assistant's tool calls; earlier thinking is left out."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for b in m.content:
        if isinstance(b, a.ToolResultBlock):
            try:
                text = b.text
            except ValueError as exc:
                raise InputError(str(exc), "messages") from None
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {text}" if b.is_error else text})
        elif isinstance(b, a.TextBlock):
            parts.append({"type": "text", "text": b.text})
        elif isinstance(b, a.ImageBlock):
            parts.append({"type": "image_url", "image_url": {"url": b.url}})
        elif isinstance(b, a.ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
    if m.role == "assistant":
        text = "".join(part["text"] for part in parts)
        if text or calls or not out:
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
    elif parts:
        out.append({"role": "user", "content": parts})
    return out


@router.post("/v1/messages/count_tokens", response_model=a.TokenCount)
async def count_tokens(body: a.CountTokensRequest, ctx: Ctx) -> Any:
    chat = to_chat(body, ctx.reasoning)
    if ctx.beside_engine(chat):  # as the VLM beside the engine would run it: its template, its image tokens
        return a.TokenCount(input_tokens=(await ctx.vlm_prompt(chat)).prompt_tokens)
    ctx.check_model(chat.model)
    prompt = await ctx.prompt_of(ctx.deadline(None), messages=chat.messages, param="messages",
                                 tools=chat.tools if chat.tool_mode else None, images=True,
                                 template_kwargs=chat.chat_template_kwargs)
    return a.TokenCount(input_tokens=prompt.tokens)


@router.post("/v1/messages", response_model=a.MessageResponse)
async def messages(body: a.MessagesRequest, request: Request, ctx: Ctx) -> Any:
    ctx.gate.check(1)  # a 429 costs no tokenizing
    chat = to_chat(body, ctx.reasoning)
    user = (body.metadata.user_id if body.metadata else None) or body.user_profile_id
    started = await ctx.start_chat(chat, ENDPOINT, "msg", user)
    mid, parallel = f"msg_{uuid.uuid4().hex[:24]}", chat.parallel_tool_calls
    if not body.stream:
        [(text, final)] = await started.run.finish_all(request)
        thoughts, content, calls = started.reply(text, parallel)
        blocks, called = _blocks(content, calls)
        if thoughts is not None:
            blocks.insert(0, {"type": "thinking", "thinking": thoughts, "signature": ""})
        reason, stop = _stop_reason(final, called)
        resp = a.MessageResponse(id=mid, content=blocks, model=started.model, stop_reason=reason, stop_sequence=stop,
                                 usage=_usage(final.stats or RequestStats()))
        return JSONResponse(resp.model_dump(), headers=downscale_headers(started.note))
    first = await started.run.first_event(request)
    return stream_response(started.run, _events(started, first, mid, started.model, parallel, ctx), started.note)


def _blocks(content: str | None, calls: list[tools.Call]) -> tuple[list[dict], bool]:
    """A whole reply's content and calls as content blocks, and whether it called a tool."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for c in calls:
        args = _object(c.arguments)
        if args is None:  # arguments cut short (max_tokens): the text as it came, nothing dropped
            blocks.append({"type": "text", "text": c.arguments})
        else:
            blocks.append({"type": "tool_use", "id": _tool_use_id(), "name": c.name, "input": args})
    return blocks, any(b["type"] == "tool_use" for b in blocks)


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _stop_reason(final: Delta, called: bool) -> tuple[a.StopReason, str | None]:
    if final.finish_reason == "length":
        return "max_tokens", None
    if final.stop_string is not None:
        return "stop_sequence", final.stop_string
    return ("tool_use" if called else "end_turn"), None


def _usage(s: RequestStats) -> a.Usage:
    return a.Usage(input_tokens=s.prompt_tokens - s.cached_tokens, output_tokens=s.completion_tokens,
                   cache_read_input_tokens=s.cached_tokens)


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's stream: its name, and its JSON (whose `type` repeats the name)."""
    return sse({"type": name, **data}, event=name)


class BlockStream:
    """A streamed reply's content blocks: chat chunk contents (ChoiceStream's) in, Anthropic's block events out."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # the type of the block being streamed
        self.called = False
        self.text_delta: Callable[[str], str] = self._text_delta  # the open text block's frame maker

    def _start(self, block: dict[str, Any]) -> list[str]:
        out = self.stop()
        self.index += 1
        self.open = block["type"]
        if self.open == "text":  # a token's frame: one string encode, not a dict's (runs.templated)
            self.text_delta = templated(self._text_delta)
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _text_delta(self, text: str) -> str:
        return self._delta({"type": "text_delta", "text": text})

    def feed(self, kw: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if kw.get("reasoning_content"):
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": kw["reasoning_content"]}))
        if kw.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append(self.text_delta(kw["content"]))
        for call in kw.get("tool_calls") or []:
            fn = call["function"]
            if "id" in call:  # a new call (a named one's first piece, or a whole parsed call)
                self.called = True
                out += self._start({"type": "tool_use", "id": _tool_use_id(), "name": fn["name"], "input": {}})
            if fn.get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return out

    def stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]


async def _events(started: ChatRun, first: tuple[int, Delta] | None, mid: str, model: str, parallel: bool | None,
                  ctx: Ctx) -> AsyncIterator[str]:
    """A streamed reply's events, in Anthropic's order; an engine error after the start ends them with an error
    event. The run is closed however the stream ends."""
    blocks = BlockStream()
    start: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant", "content": [], "model": model,
                             "stop_reason": None, "stop_sequence": None,
                             "usage": {"input_tokens": started.prompt_tokens, "output_tokens": 0}}
    try:
        yield event("message_start", {"message": start})
        yield event("ping", {})
        final: Delta | None = None
        async for d, kws in started.deltas(first, parallel):
            if d.error:
                e = engine_error(d, ctx.gate.retry_after_s)
                yield event("error", {"error": a.error_body(e.status, e.message)["error"]})
                return
            for kw in kws:
                for frame in blocks.feed(kw):
                    yield frame
            if d.finished:
                final = d
        for frame in blocks.stop():
            yield frame
        assert final is not None  # the run ended without an error: its request finished
        reason, stop = _stop_reason(final, blocks.called)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                      "usage": _usage(final.stats or RequestStats()).model_dump()})
        yield event("message_stop", {})
    finally:
        started.run.close()
