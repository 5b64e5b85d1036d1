"""The reference stack's /generate route: prompt, messages or input_ids in; JSON lines (or one JSON reply) out.

A stream is `{"text_delta": ...}` lines (with `logprobs` when `return_logprob` is on), then one `GenerateDone`
line (`{"event": "done", ...}` with the request's token counts and timings), or an `{"event": "error", "error":
{...}}` line if the engine fails.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from minisgl_cli.api import protocol as p
from minisgl_cli.server.context import Ctx
from minisgl_cli.server.errors import InputError, error_frame
from minisgl_cli.server.gate import downscale_headers
from minisgl_cli.server.runs import stream_response, templated
from minisgl_cli.types import Delta, GenerateRequest, RequestStats, TokenLogprob, new_request_id

router = APIRouter(tags=["reference"], responses=p.ERROR_RESPONSES)


@router.post("/generate", response_model=p.GenerateDone)
async def generate(body: p.GenerateBody, request: Request, ctx: Ctx) -> Any:
    given = sum(x is not None for x in (body.prompt, body.messages, body.input_ids))
    if given != 1:
        raise InputError("give exactly one of prompt, messages, input_ids", "prompt")
    field = "messages" if body.messages is not None else "prompt" if body.prompt is not None else "input_ids"
    ctx.gate.check(1)  # a 429 costs no tokenizing
    deadline = ctx.deadline(body.timeout)
    if body.messages is not None:
        prompt = await ctx.prompt_of(deadline, messages=body.messages, param=field)
    else:
        prompt = await ctx.prompt_of(deadline, prompt=body.prompt if body.prompt is not None else body.input_ids,
                                     param=field)
    max_new, note = ctx.budget([prompt], body.max_new_tokens, "max_new_tokens", field)
    params = body.sampling_params(max_new, vocab_size=ctx.client.info.vocab_size, extra=dict(
        logprobs=body.return_logprob, top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
        **body.structured()))
    req = GenerateRequest(tokenized=prompt, params=params, rid=new_request_id("gen"), prompt_param=field)
    run = ctx.start([req], "/generate", deadline)
    if not body.stream:
        [(text, final)] = await run.finish_all(request)
        done = _done(final, note, text)
        if body.return_logprob:
            done.logprobs = _logprobs(run.logprobs[0])
        return JSONResponse(done.model_dump(), headers=downscale_headers(note))
    first = await run.first_event(request)
    text_line = templated(lambda text: json.dumps({"text_delta": text}, ensure_ascii=False) + "\n")

    async def lines() -> AsyncIterator[str]:
        try:
            event = first
            while event is not None:
                _, d = event
                if d.error:
                    yield json.dumps({"event": "error", **error_frame(d)}) + "\n"
                    break
                if d.logprobs:
                    line = {"text_delta": d.text, "logprobs": _logprobs(d.logprobs)}
                    yield json.dumps(line, ensure_ascii=False) + "\n"
                elif d.text:  # the usual line: its JSON made once
                    yield text_line(d.text)
                if d.finish_reason:
                    yield _done(d, note).model_dump_json(exclude_none=True) + "\n"
                event = await run.next()
        finally:
            run.close()

    return stream_response(run, lines(), note, media_type="application/x-ndjson")


def _logprobs(lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Each token's id, text and logprob, with its top candidates (`top`: [[id, text, logprob], ...])."""
    return [{"token_id": t.token_id, "token": t.token, "logprob": p.json_logprob(t.logprob),
             "top": [[c.token_id, c.token, p.json_logprob(c.logprob)] for c in t.top]} for t in lps]


def _done(final: Delta, note: str | None, text: str | None = None) -> p.GenerateDone:
    s = final.stats or RequestStats()
    return p.GenerateDone(
        rid=final.rid, text=text, finish_reason=final.finish_reason, prompt_tokens=s.prompt_tokens,
        cached_tokens=s.cached_tokens, completion_tokens=s.completion_tokens, ttft_ms=round(s.ttft_s * 1000, 3),
        latency_ms=round(s.latency_s * 1000, 3), decode_tok_s=round(s.decode_tok_s, 3),
        max_new_tokens_downscaled=note,
    )
