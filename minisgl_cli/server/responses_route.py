"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}, translated onto the chat request.

A Responses body becomes a `ChatCompletionRequest` (`to_chat`: instructions, the stored conversation of
`previous_response_id`, input items -- messages, function calls and their outputs --, function tools, tool_choice,
text.format, sampling) and runs through `ServerContext.start_chat`, the chat completions route's steps (input_image
parts the engine's model cannot take: the VLM beside it, as in chat). Its output
comes back as output items (`reasoning` with --reasoning-parser, `message` with `output_text`, `function_call`)
and usage with cached tokens, or streamed as the Responses events in order, each with its `sequence_number`.
Stored responses (`store`, the default) live in a bounded `ResponseStore`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from minisgl_cli.api import protocol as p
from minisgl_cli.api import responses as r
from minisgl_cli.server import tools
from minisgl_cli.server.context import ChatRun, Ctx
from minisgl_cli.server.errors import InputError, engine_error
from minisgl_cli.server.gate import downscale_headers
from minisgl_cli.server.response_store import ResponseStore
from minisgl_cli.server.runs import sse, stream_response
from minisgl_cli.types import Delta, RequestStats

router = APIRouter(tags=["openai"], responses=p.ERROR_RESPONSES)

ENDPOINT = "/v1/responses"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def store_of(request: Request) -> ResponseStore:
    state = request.app.state
    if not hasattr(state, "responses"):
        state.responses = ResponseStore()
    return state.responses


def history(body: r.ResponsesRequest, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: the earlier one (`previous_response_id`'s), then this body's input."""
    out = list(earlier)
    items = [r.MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, r.MessageItem):
            if isinstance(item.content, str):
                out.append({"role": item.role, "content": item.content})
                continue
            parts: list[dict[str, Any]] = []
            for part in item.content:
                if isinstance(part, r.InputText):
                    parts.append({"type": "text", "text": part.text})
                elif isinstance(part, r.Refusal):
                    parts.append({"type": "text", "text": part.refusal})
                elif part.image_url is None:
                    raise InputError("input_image: only image_url images are supported (no file_id)", "input")
                else:
                    parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
            if item.role == "user":
                out.append({"role": "user", "content": parts})
            else:
                if any(part["type"] != "text" for part in parts):
                    raise InputError(f"input: a {item.role} message takes text only", "input")
                out.append({"role": item.role, "content": "".join(part["text"] for part in parts)})
        elif isinstance(item, r.FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, r.FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return out


def to_chat(body: r.ResponsesRequest, turns: list[dict[str, Any]], reasoning: str | None) -> p.ChatCompletionRequest:
    """The chat completions request a Responses body asks for, over the conversation `turns`."""
    if body.reasoning is not None and reasoning is None and (body.reasoning.effort or body.reasoning.summary):
        raise InputError("reasoning: this server runs no reasoning parser for its model (--reasoning-parser)",
                         "reasoning")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + turns
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p, "stream": body.stream,
                            "parallel_tool_calls": body.parallel_tool_calls}
    if body.reasoning is not None and body.reasoning.effort is not None:
        try:
            p.thinks_at(body.reasoning.effort)  # named as this API names it; the chat request maps it
        except ValueError as exc:
            raise InputError(str(exc), "reasoning.effort") from None
        chat["reasoning_effort"] = body.reasoning.effort
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in body.function_tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = {"type": fmt.type} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        raise InputError(f"input: {err['msg']}", "input") from None


@router.post("/v1/responses")
async def create(body: r.ResponsesRequest, request: Request, ctx: Ctx) -> Any:
    ctx.gate.check(1)  # a 429 costs no tokenizing
    store = store_of(request)
    earlier: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        stored = store.get(body.previous_response_id)
        if stored is None:
            raise InputError(f"previous_response_id: no stored response {body.previous_response_id!r} (never stored, "
                             "deleted, or expired)", "previous_response_id", 404, "not_found")
        earlier = stored.history
    turns = history(body, earlier)
    chat = to_chat(body, turns, ctx.reasoning)
    started = await ctx.start_chat(chat, ENDPOINT, "resp", body.safety_identifier or body.user)
    shell = Shell(body, started.model)
    if not body.stream:
        [(text, final)] = await started.run.finish_all(request)
        thoughts, content, calls = started.reply(text, chat.parallel_tool_calls)
        items = ([_reasoning(_id("rs"), thoughts)] if thoughts is not None else []) + \
            ([_message(_id("msg"), content or "", "completed")] if content else []) + \
            [_call(_id("fc"), tools.new_call_id(), c.name, c.arguments, "completed") for c in calls]
        resp = shell.done(items, final)
        _keep(store, resp, turns)
        return JSONResponse(resp, headers=downscale_headers(started.note))
    first = await started.run.first_event(request)
    return stream_response(started.run, _events(started, first, shell, chat.parallel_tool_calls, ctx, store, turns),
                           started.note)


@router.get("/v1/responses/{response_id}")
async def retrieve(response_id: str, request: Request) -> Any:
    stored = store_of(request).get(response_id)
    if stored is None:
        raise InputError(f"no stored response {response_id!r}", "response_id", 404, "not_found")
    return stored.response


@router.delete("/v1/responses/{response_id}")
async def delete(response_id: str, request: Request) -> Any:
    if not store_of(request).delete(response_id):
        raise InputError(f"no stored response {response_id!r}", "response_id", 404, "not_found")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _keep(store: ResponseStore, resp: dict[str, Any], turns: list[dict[str, Any]]) -> None:
    """Store a finished response (with `store`): its JSON, and the conversation with its reply for the next turn."""
    if not resp["store"]:
        return
    reply: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in resp["output"]:
        if item["type"] == "message":
            reply["content"] += "".join(part["text"] for part in item["content"])
        elif item["type"] == "function_call":
            reply.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
    store.put(resp["id"], resp, [*turns, reply])


class Shell:
    """The response object around the output items: the request's settings echoed, status and usage at the end."""

    def __init__(self, body: r.ResponsesRequest, model: str):
        self.id, self.created = _id("resp"), int(time.time())
        self.base = {
            "id": self.id, "object": "response", "created_at": self.created, "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature if body.temperature is not None else 0.0,
            "top_p": body.top_p if body.top_p is not None else 1.0,
            "tools": [t.model_dump(exclude_none=True) for t in body.function_tools],
            "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str)
                            else body.tool_choice.model_dump() if body.tool_choice else "auto"),
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store, "metadata": body.metadata or {},
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "user": body.user, "error": None, "incomplete_details": None, "truncation": "disabled",
        }

    def pending(self) -> dict[str, Any]:
        return {**self.base, "status": "in_progress", "output": [], "usage": None}

    def done(self, items: list[dict[str, Any]], final: Delta) -> dict[str, Any]:
        s = final.stats or RequestStats()
        cut = final.finish_reason == "length"
        return {**self.base, "status": "incomplete" if cut else "completed", "output": items,
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "usage": {"input_tokens": s.prompt_tokens, "input_tokens_details": {"cached_tokens": s.cached_tokens},
                          "output_tokens": s.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": s.prompt_tokens + s.completion_tokens}}


def _message(mid: str, text: str, status: str) -> dict[str, Any]:
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": mid, "status": status, "role": "assistant", "content": parts}


def _reasoning(rid: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": rid, "summary": [], "content": content}


def _call(fid: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ItemStream:
    """A streamed reply's output items: chat chunk contents (ChoiceStream's) in, the Responses events out."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []  # finished items, in order
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # its text (message, reasoning) or arguments (function call) so far

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq, **data})

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open, self.text = item, ""
        index = len(self.items)
        out.append(self.event("response.output_item.added", output_index=index, item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return out

    def feed(self, kw: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if kw.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                out += self._start(_reasoning(_id("rs"), None))
            self.text += kw["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                  output_index=len(self.items), content_index=0, delta=kw["reasoning_content"]))
        if kw.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._start(_message(_id("msg"), "", "in_progress"))
            self.text += kw["content"]
            out.append(self.event("response.output_text.delta", item_id=self.open["id"],  # type: ignore[index]
                                  output_index=len(self.items), content_index=0, delta=kw["content"], logprobs=[]))
        for call in kw.get("tool_calls") or []:
            fn = call["function"]
            if "id" in call:
                out += self._start(_call(_id("fc"), call["id"], fn["name"], "", "in_progress"))
            if fn.get("arguments"):
                self.text += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=self.open["id"], output_index=len(self.items),  # type: ignore[index]
                                      delta=fn["arguments"]))
        return out

    def close(self) -> list[str]:
        """End the item being streamed: its done events, then output_item.done with the item whole."""
        item, text = self.open, self.text
        if item is None:
            return []
        self.open, index, out = None, len(self.items), []
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
            item = {**item, "status": "completed", "content": [part]}
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text))
            item = {**item, "content": [{"type": "reasoning_text", "text": text}]}
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=text))
            item = {**item, "status": "completed", "arguments": text}
        self.items.append(item)
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def _events(started: ChatRun, first: tuple[int, Delta] | None, shell: Shell, parallel: bool | None, ctx: Ctx,
                  store: ResponseStore, turns: list[dict[str, Any]]) -> AsyncIterator[str]:
    """A streamed response's events in the Responses order; an engine error after the start ends them with an
    `error` event and `response.failed`. The run is closed however the stream ends."""
    items = ItemStream()
    try:
        yield items.event("response.created", response=shell.pending())
        yield items.event("response.in_progress", response=shell.pending())
        final: Delta | None = None
        async for d, kws in started.deltas(first, parallel):
            if d.error:
                e = engine_error(d, ctx.gate.retry_after_s)
                yield items.event("error", code=e.code, message=e.message, param=e.param)
                yield items.event("response.failed", response={**shell.pending(), "status": "failed", "error": {
                    "code": e.code or "server_error", "message": e.message}})
                return
            for kw in kws:
                for frame in items.feed(kw):
                    yield frame
            if d.finished:
                final = d
        for frame in items.close():
            yield frame
        assert final is not None  # no error: the request finished
        resp = shell.done(items.items, final)
        _keep(store, resp, turns)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        yield items.event(kind, response=resp)
    finally:
        started.run.close()
