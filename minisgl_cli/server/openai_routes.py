"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models (and a 400 for /v1/embeddings) —
handlers that only translate; tool calls are parsed by `tools.py`; chat requests with `image_url` parts run on the
engine where its model takes images (Qwen2-VL / Qwen2.5-VL), else on the transformers VLM beside it (`vlm_chat.py`:
`ServerContext.start_chat` decides).

Protocol models in, engine requests out (through `ServerContext`), engine deltas back as OpenAI
responses or SSE `chunk` frames ending in `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from minisgl_cli.api import protocol as p
from minisgl_cli.server import tools
from minisgl_cli.server.choices import ChoiceStream
from minisgl_cli.server.context import Ctx
from minisgl_cli.server.errors import InputError, error_frame
from minisgl_cli.server.gate import downscale_headers
from minisgl_cli.server.runs import EngineRun, sse, stream_response, templated
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
    ctx.gate.check(body.n, "n")  # a 429 or 413 costs no tokenizing, no image decoding
    chat = await ctx.start_chat(body, "/v1/chat/completions", "chat", body.user or body.safety_identifier)
    run, how, names, note = chat.run, chat.how, chat.names, chat.note
    cid, ts, model = p.new_id("chatcmpl"), p.now(), chat.model
    if not body.stream:
        results = await run.finish_all(request)
        choices = []
        for i, (text, final) in enumerate(results):
            thoughts, content, calls = chat.reply(text, body.parallel_tool_calls)
            message = p.ChatResponseMessage(content=content, reasoning_content=thoughts,
                                            tool_calls=[c.to_tool_call() for c in calls] or None)
            choices.append(p.ChatChoice(index=i, message=message, finish_reason=_finish(final, calls),
                                        logprobs=p.chat_logprobs(run.logprobs[i]) if body.logprobs else None))
        resp = p.ChatCompletionResponse(id=cid, created=ts, model=model, choices=choices,
                                        usage=_usage([r[1] for r in results], prompts=1))
        return JSONResponse(resp.model_dump(), headers=downscale_headers(note))
    first = await run.first_event(request)
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(i: int, **kw: Any) -> str:
        return sse(p.chat_chunk(cid, ts, model, i, with_usage_field=with_usage, **kw))

    timed = not ctx.client.info.has_tokenizer
    streams = [ChoiceStream(how, names, body.parallel_tool_calls, timed, chat.split()) for _ in range(body.n)]

    def content_only(i: int) -> Callable[[str], str]:
        """Choice i's usual chunk (content alone): its JSON made once, the text put in."""
        return templated(lambda text: chunk(i, content=text))

    plain = [content_only(i) for i in range(body.n)]

    def frames(i: int, d: Delta) -> list[str]:
        return [plain[i](kw["content"]) if kw.keys() == {"content"} else chunk(i, **kw) for kw in streams[i].feed(d)]

    def usage() -> str:
        u = _usage([f for f in run.finals if f is not None], prompts=1)
        return sse(p.usage_chunk(cid, ts, model, "chat.completion.chunk", u))

    head = [chunk(i, role=True, content="") for i in range(body.n)]
    return stream_response(run, _sse_body(run, first, frames, usage if with_usage else None, head), note)


def _finish(final: Delta, calls: list[tools.Call]) -> str | None:
    return "tool_calls" if calls and final.finish_reason == "stop" else final.finish_reason


@router.post("/v1/completions", response_model=p.CompletionResponse)
async def completions(body: p.CompletionRequest, request: Request, ctx: Ctx) -> Any:
    ctx.check_model(body.model)
    deadline = ctx.deadline(body.timeout)
    prompts = body.prompts()
    if not prompts:
        raise InputError("prompt must not be empty", "prompt")
    ctx.gate.check(len(prompts) * body.n, "n" if body.n > 1 else "prompt")  # a 429 or 413 costs no tokenizing
    tokenized = [await ctx.prompt_of(deadline, prompt=pr, param="prompt") for pr in prompts]
    max_new, note = ctx.budget(tokenized, body.max_tokens, "max_tokens")
    extra = dict(logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0, stream_text=bool(body.stream),
                 **body.structured())
    vocab = ctx.client.info.vocab_size
    # Choice index = prompt index * n + sample index (OpenAI's order).
    reqs = [GenerateRequest(tokenized=pr, params=body.sampling_params(max_new, j, vocab, extra),
                            rid=new_request_id("cmpl"), prompt_param="prompt")
            for pr in tokenized for j in range(body.n)]
    run = ctx.start(reqs, "/v1/completions", deadline, body.user)
    cid, ts, model = p.new_id("cmpl"), p.now(), ctx.model_name
    with_lp = body.logprobs is not None
    if not body.stream:
        results = await run.finish_all(request)
        choices = [p.CompletionChoice(index=i, text=text, finish_reason=final.finish_reason,
                                      logprobs=p.completion_logprobs(run.logprobs[i]) if with_lp else None)
                   for i, (text, final) in enumerate(results)]
        u = _usage([r[1] for r in results], prompts=len(prompts), n=body.n)
        resp = p.CompletionResponse(id=cid, created=ts, model=model, choices=choices, usage=u)
        return JSONResponse(resp.model_dump(), headers=downscale_headers(note))
    first = await run.first_event(request)
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    offsets = [0] * len(reqs)
    timed = not ctx.client.info.has_tokenizer  # as ChoiceStream.token_only

    def text_only(i: int) -> Callable[[str], str]:
        """Choice i's usual chunk (text, no end, no logprobs): its JSON made once, the text put in."""
        return templated(lambda text: sse(p.completion_chunk(cid, ts, model, i, text, None, with_usage)))

    plain = [text_only(i) for i in range(len(reqs))]

    def frames(i: int, d: Delta) -> list[str]:
        if not (d.text or d.finish_reason or (timed and d.token_ids)):  # no empty chunk, unless tokens are all
            return []
        if d.finish_reason is None and not with_lp:
            return [plain[i](d.text)]
        lp = p.completion_logprobs(d.logprobs or [], offsets[i]) if with_lp else None
        offsets[i] += len(d.text)
        return [sse(p.completion_chunk(cid, ts, model, i, d.text, d.finish_reason, with_usage, lp))]

    def usage() -> str:
        u = _usage([f for f in run.finals if f is not None], prompts=len(prompts), n=body.n)
        return sse(p.usage_chunk(cid, ts, model, "text_completion", u))

    return stream_response(run, _sse_body(run, first, frames, usage if with_usage else None), note)


async def _sse_body(run: EngineRun, first: tuple[int, Delta] | None, frames: Callable[[int, Delta], list[str]],
                    usage: Callable[[], str] | None, head: list[str] | None = None) -> AsyncIterator[str]:
    """A streamed route's body: `head`, each event's `frames` (an engine error ends the events with its error
    frame), the usage chunk when one is asked for, then [DONE]; the run is closed however the stream ends."""
    try:
        for frame in head or []:
            yield frame
        event = first
        while event is not None:
            i, d = event
            if d.error:
                yield sse(error_frame(d))
                break
            for frame in frames(i, d):
                yield frame
            event = await run.next()
        if usage is not None:
            yield usage()
        yield sse("[DONE]")
    finally:
        run.close()


@router.post("/v1/embeddings", response_model=p.ErrorResponse)
async def embeddings(ctx: Ctx) -> Any:
    raise InputError(f"/v1/embeddings is not served: {ctx.model_name} is a generative model. Use /v1/chat/completions "
                     "or /v1/completions to generate text (with logprobs if you need token scores); for embeddings, "
                     "serve an embedding model with an embedding server", "model", 400, "embeddings_not_supported")


def _usage(finals: list[Delta], prompts: int, n: int = 1) -> p.Usage:
    """Prompt tokens count once per prompt (not per sample); completion tokens sum over choices."""
    stats = [f.stats or RequestStats() for f in finals]
    per_prompt = stats[::n] if n > 1 else stats
    return p.usage(
        prompt_tokens=sum(s.prompt_tokens for s in per_prompt[:prompts]),
        completion_tokens=sum(s.completion_tokens for s in stats),
        cached_tokens=sum(s.cached_tokens for s in per_prompt[:prompts]),
    )
