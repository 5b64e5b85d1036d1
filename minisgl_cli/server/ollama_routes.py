"""The ollama API on the same port: /api/chat and /api/generate translated onto the chat request, NDJSON streams;
/api/tags, /api/show, /api/ps, /api/version describe the one served model; /api/embed(dings) are refused.

A chat (or a generate: its system and prompt as a two-message chat) becomes a `ChatCompletionRequest` (`to_chat`:
messages with their images and tool calls, tools, `format` through the grammar, `options` mapped onto our
sampling, `think` onto the template) and runs through `ServerContext.start_chat`, as /v1/chat/completions does
(images the engine's model cannot take: on the VLM beside it).
Errors carry ollama's body, `{"error": "..."}` (errors.py picks it by path).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from minisgl_cli.api import ollama as o
from minisgl_cli.api import protocol as p
from minisgl_cli.server.context import ChatRun, Ctx
from minisgl_cli.server.errors import InputError, engine_error
from minisgl_cli.server.gate import downscale_headers
from minisgl_cli.server.runs import ndjson, stream_response
from minisgl_cli.types import Delta, RequestStats

router = APIRouter(tags=["ollama"])

VERSION = "0.9.0"  # the ollama API version whose routes and fields these follow (clients gate features on it)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _model(ctx: Ctx, name: str) -> str:
    """The served model a request's `model` names (ollama's `:latest` tag is the name itself)."""
    ctx.check_model(name.removesuffix(":latest"))
    return ctx.model_name


def to_chat(body: o.ChatRequest | o.GenerateRequest, messages: list[o.Message], reasoning: str | None) \
        -> p.ChatCompletionRequest:
    """The chat completions request an ollama body asks for (a 400 naming the field where it cannot be one)."""
    out: list[dict[str, Any]] = []
    calls_made: list[tuple[str, str]] = []  # (call id, tool name) of assistant calls, for the tool results after
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                cid = c.id or f"call_{i}_{j}"
                calls_made.append((cid, c.function.name))
                calls.append({"id": cid, "type": "function", "function": {
                    "name": c.function.name, "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}})
            out.append({"role": "assistant", "content": m.content, "tool_calls": calls})
        elif m.role == "tool":
            # ollama names the tool, not the call: the latest call of that tool (else the latest call) it answers.
            cid = next((c for c, n in reversed(calls_made) if n == m.tool_name), None) or \
                (calls_made[-1][0] if calls_made else f"call_{i}")
            out.append({"role": "tool", "tool_call_id": cid, "content": m.content})
        elif m.images:
            if m.role != "user":
                raise InputError(f"messages.{i}.images: only user messages take images", f"messages.{i}.images")
            out.append({"role": "user", "content": [{"type": "text", "text": m.content}, *(
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{img}"}} for img in m.images)]})
        else:
            out.append({"role": m.role, "content": m.content})
    chat: dict[str, Any] = {"model": body.model.removesuffix(":latest"), "messages": out, "stream": body.stream}
    if isinstance(body, o.ChatRequest) and body.tools:
        chat["tools"], chat["tool_choice"] = body.tools, "auto"
    if body.format == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    opts = body.options or o.Options.model_validate({})
    chat.update(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k, min_p=opts.min_p, seed=opts.seed,
                stop=opts.stop, presence_penalty=opts.presence_penalty, frequency_penalty=opts.frequency_penalty,
                repetition_penalty=opts.repeat_penalty,
                max_tokens=opts.num_predict if opts.num_predict is not None and opts.num_predict >= 0 else None)
    if body.think is not None:
        if body.think is not False and reasoning is None:
            raise InputError("think: this server runs no reasoning parser for its model (--reasoning-parser)",
                             "think")
        chat["chat_template_kwargs"] = {"enable_thinking": body.think is not False}
        if isinstance(body.think, str):  # gpt-oss's levels: harmony's reasoning effort
            chat["chat_template_kwargs"]["reasoning_effort"] = body.think
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise InputError(f"{where}: {err['msg']}" if where else err["msg"], where or None) from None


@router.post("/api/chat")
async def chat(body: o.ChatRequest, request: Request, ctx: Ctx) -> Any:
    return await _run(body, body.messages, request, ctx, "/api/chat", "message")


@router.post("/api/generate")
async def generate(body: o.GenerateRequest, request: Request, ctx: Ctx) -> Any:
    if body.raw:
        raise InputError("raw: a prompt without the template is served by /v1/completions (or /generate)", "raw")
    if not body.prompt and not body.images:  # ollama loads the model and answers done: it is loaded already
        return {"model": _model(ctx, body.model), "created_at": _now(), "response": "", "done": True,
                "done_reason": "load"}
    messages = [o.Message.model_validate(m) for m in (
        [{"role": "system", "content": body.system}] if body.system else []) + [
        {"role": "user", "content": body.prompt, "images": body.images}]]
    return await _run(body, messages, request, ctx, "/api/generate", "response")


async def _run(body: o.ChatRequest | o.GenerateRequest, messages: list[o.Message], request: Request, ctx: Ctx,
               endpoint: str, field: str) -> Any:
    """One chat or generate: `field` is where the reply's text goes ("message" for chat, "response")."""
    ctx.gate.check(1)
    chat_body = to_chat(body, messages, ctx.reasoning)
    started = await ctx.start_chat(chat_body, endpoint, "ollama")  # checks the model (the VLM's name with images)
    model = started.model
    if not body.stream:
        [(text, final)] = await started.run.finish_all(request)
        thoughts, content, calls = started.reply(text, None)
        return JSONResponse({**_piece(model, field, content or "", thoughts, [_call(c.name, c.arguments)
                                                                                for c in calls]), **_done(final)},
                            headers=downscale_headers(started.note))
    first = await started.run.first_event(request)
    return stream_response(started.run, _lines(started, first, model, field, ctx), started.note,
                           media_type="application/x-ndjson")


def _call(name: str, arguments: str) -> dict[str, Any]:
    try:
        args = json.loads(arguments)
    except ValueError:
        args = {}
    return {"function": {"name": name, "arguments": args if isinstance(args, dict) else {}}}


def _piece(model: str, field: str, text: str, thoughts: str | None = None,
           calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One reply object (a stream's line, or the whole reply) before its end fields."""
    out: dict[str, Any] = {"model": model, "created_at": _now()}
    if field == "message":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thoughts:
            message["thinking"] = thoughts
        if calls:
            message["tool_calls"] = calls
        out["message"] = message
    else:
        out["response"] = text
        if thoughts:
            out["thinking"] = thoughts
    out["done"] = False
    return out


def _done(final: Delta) -> dict[str, Any]:
    """The end fields: done, why, and ollama's counts and durations (nanoseconds)."""
    s = final.stats or RequestStats()
    return {"done": True, "done_reason": "length" if final.finish_reason == "length" else "stop",
            "total_duration": int(s.latency_s * 1e9), "load_duration": 0, "prompt_eval_count": s.prompt_tokens,
            "prompt_eval_duration": int(s.ttft_s * 1e9), "eval_count": s.completion_tokens,
            "eval_duration": int(max(s.latency_s - s.ttft_s, 0.0) * 1e9)}


async def _lines(started: ChatRun, first: tuple[int, Delta] | None, model: str, field: str, ctx: Ctx) \
        -> AsyncIterator[str]:
    """A streamed reply as NDJSON lines: one per piece of text (or thoughts, or the tool calls), then the done
    line; an engine error after the start ends it with an `{"error": ...}` line. The run is closed however it ends."""
    try:
        async for d, kws in started.deltas(first, None):
            if d.error:
                yield ndjson({"error": engine_error(d, ctx.gate.retry_after_s).message})
                return
            for kw in kws:
                calls = [_call(c["function"]["name"], c["function"]["arguments"]) for c in kw.get("tool_calls") or []]
                if kw.get("content") or kw.get("reasoning_content") or calls:
                    yield ndjson(_piece(model, field, kw.get("content") or "", kw.get("reasoning_content"), calls))
            if d.finished:
                yield ndjson({**_piece(model, field, ""), **_done(d)})
    finally:
        started.run.close()


def _details(ctx: Ctx) -> dict[str, Any]:
    info = ctx.client.info
    family = _family(info.model_dir)
    return {"parent_model": "", "format": "gguf" if info.source.endswith(".gguf") else "safetensors",
            "family": family, "families": [family], "parameter_size": "",
            "quantization_level": info.quantization.upper() if info.quantization != "none" else info.dtype.upper()}


def _family(model_dir: str | None) -> str:
    try:
        with open(f"{model_dir}/config.json") as f:
            return str(json.load(f).get("model_type", ""))
    except (OSError, ValueError, TypeError):
        return ""


def _entry(ctx: Ctx) -> dict[str, Any]:
    name = ctx.model_name
    return {"name": name, "model": name, "digest": hashlib.sha256(name.encode()).hexdigest(), "size": 0,
            "modified_at": datetime.fromtimestamp(ctx.created, timezone.utc).isoformat(), "details": _details(ctx)}


@router.get("/api/tags")
async def tags(ctx: Ctx) -> Any:
    return {"models": [_entry(ctx)]}


@router.get("/api/ps")
async def ps(ctx: Ctx) -> Any:
    far = datetime(2100, 1, 1, tzinfo=timezone.utc).isoformat()  # loaded for as long as the server runs
    return {"models": [{**_entry(ctx), "expires_at": far, "size_vram": 0,
                        "context_length": ctx.client.info.max_context_len}]}


@router.get("/api/version")
async def version() -> Any:
    return {"version": VERSION}


@router.post("/api/show")
async def show(body: o.ModelRequest, ctx: Ctx) -> Any:
    name = body.model or body.name
    if not name:
        raise InputError("model: required", "model")
    _model(ctx, name)
    details = _details(ctx)
    caps = ["completion", "tools"] + ["thinking"] * bool(ctx.reasoning) + \
        ["vision"] * (ctx.client.info.images or ctx.vlm is not None)
    return {"modelfile": "", "parameters": "", "template": "", "details": details,
            "model_info": {"general.architecture": details["family"],
                           f"{details['family'] or 'model'}.context_length": ctx.client.info.max_context_len},
            "capabilities": caps, "modified_at": _entry(ctx)["modified_at"]}


@router.post("/api/embed")
@router.post("/api/embeddings")
async def embed(ctx: Ctx) -> Any:
    raise InputError(f"embeddings are not served: {ctx.model_name} is a generative model; serve an embedding model "
                     "with an embedding server", "model", 400)
