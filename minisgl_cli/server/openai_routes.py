"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models — handlers that only translate.

Protocol models in, engine requests out (through `ServerContext`), engine deltas back as OpenAI
responses or SSE `chunk` frames ending in `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from minisgl_cli.server import protocol as p
from minisgl_cli.server.context import Ctx
from minisgl_cli.server.errors import InputError, error_frame
from minisgl_cli.server.gate import downscale_headers
from minisgl_cli.server.runs import sse, stream_response
from minisgl_cli.types import Delta, GenerateRequest, RequestStats, new_request_id

router = APIRouter(tags=["openai"], responses=p.ERROR_RESPONSES)


@router.get("/v1/models", response_model=p.ModelList)
async def models(ctx: Ctx) -> Any:
    return p.ModelList(data=[ctx.model_card()])


@router.get("/v1/models/{model}", response_model=p.ModelCard)
async def model_card(model: str, ctx: Ctx) -> Any:
    ctx.check_model(model)
    return ctx.model_card()


@router.post("/v1/chat/completions", response_model=p.ChatCompletionResponse)
async def chat_completions(body: p.ChatCompletionRequest, request: Request, ctx: Ctx) -> Any:
    ctx.check_model(body.model)
    ids = await ctx.tokens_of(messages=body.messages, param="messages")
    max_new, note = ctx.budget([ids], body.requested_max_tokens, "max_tokens")
    reqs = [GenerateRequest(input_ids=ids, params=body.sampling_params(max_new, i), rid=new_request_id("chat"))
            for i in range(body.n)]
    run = ctx.start(reqs, "/v1/chat/completions")
    cid, ts, model = p.new_id("chatcmpl"), p.now(), ctx.model_name
    if not body.stream:
        results = await run.finish_all(request)
        choices = [p.ChatChoice(index=i, message=p.ChatResponseMessage(content=text),
                                finish_reason=final.finish_reason) for i, (text, final) in enumerate(results)]
        resp = p.ChatCompletionResponse(id=cid, created=ts, model=model, choices=choices,
                                        usage=_usage([r[1] for r in results], prompts=1))
        return JSONResponse(resp.model_dump(), headers=downscale_headers(note))
    first = await run.first_event(request)
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def frames() -> AsyncIterator[str]:
        try:
            for i in range(body.n):
                yield sse(p.chat_chunk(cid, ts, model, i, role=True, content="", with_usage_field=with_usage))
            event = first
            while event is not None:
                i, d = event
                if d.error:
                    yield sse(error_frame(d))
                    break
                if d.text or d.token_ids:  # token-only deltas too (no tokenizer, held-back UTF-8): clients time them
                    yield sse(p.chat_chunk(cid, ts, model, i, content=d.text, with_usage_field=with_usage))
                if d.finish_reason:
                    yield sse(p.chat_chunk(cid, ts, model, i, finish_reason=d.finish_reason,
                                           with_usage_field=with_usage))
                event = await run.next()
            if with_usage:
                u = _usage([f for f in run.finals if f is not None], prompts=1)
                yield sse(p.usage_chunk(cid, ts, model, "chat.completion.chunk", u))
            yield sse("[DONE]")
        finally:
            run.close()

    return stream_response(run, frames(), note)


@router.post("/v1/completions", response_model=p.CompletionResponse)
async def completions(body: p.CompletionRequest, request: Request, ctx: Ctx) -> Any:
    ctx.check_model(body.model)
    prompts = body.prompts()
    if not prompts:
        raise InputError("prompt must not be empty", "prompt")
    ids_list = [await ctx.tokens_of(prompt=pr, param="prompt") for pr in prompts]
    max_new, note = ctx.budget(ids_list, body.max_tokens, "max_tokens")
    # Choice index = prompt index * n + sample index (OpenAI's order).
    reqs = [GenerateRequest(input_ids=ids, params=body.sampling_params(max_new, j), rid=new_request_id("cmpl"))
            for ids in ids_list for j in range(body.n)]
    run = ctx.start(reqs, "/v1/completions")
    cid, ts, model = p.new_id("cmpl"), p.now(), ctx.model_name
    if not body.stream:
        results = await run.finish_all(request)
        choices = [p.CompletionChoice(index=i, text=text, finish_reason=final.finish_reason)
                   for i, (text, final) in enumerate(results)]
        u = _usage([r[1] for r in results], prompts=len(prompts), n=body.n)
        resp = p.CompletionResponse(id=cid, created=ts, model=model, choices=choices, usage=u)
        return JSONResponse(resp.model_dump(), headers=downscale_headers(note))
    first = await run.first_event(request)
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def frames() -> AsyncIterator[str]:
        try:
            event = first
            while event is not None:
                i, d = event
                if d.error:
                    yield sse(error_frame(d))
                    break
                if d.text or d.token_ids or d.finish_reason:  # token-only deltas too: clients time them
                    yield sse(p.completion_chunk(cid, ts, model, i, d.text, d.finish_reason, with_usage))
                event = await run.next()
            if with_usage:
                u = _usage([f for f in run.finals if f is not None], prompts=len(prompts), n=body.n)
                yield sse(p.usage_chunk(cid, ts, model, "text_completion", u))
            yield sse("[DONE]")
        finally:
            run.close()

    return stream_response(run, frames(), note)


def _usage(finals: list[Delta], prompts: int, n: int = 1) -> p.Usage:
    """Prompt tokens count once per prompt (not per sample); completion tokens sum over choices."""
    stats = [f.stats or RequestStats() for f in finals]
    per_prompt = stats[::n] if n > 1 else stats
    return p.usage(
        prompt_tokens=sum(s.prompt_tokens for s in per_prompt[:prompts]),
        completion_tokens=sum(s.completion_tokens for s in stats),
        cached_tokens=sum(s.cached_tokens for s in per_prompt[:prompts]),
    )
