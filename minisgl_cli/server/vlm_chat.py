"""Vision-language chat in transformers: the /v1/chat/completions requests that carry `image_url` parts while the
engine's model takes no images, served by the in-process VLM chat (vision/vlm.py: SmolVLM / Idefics3, or a Qwen VLM
beside another served model) in the same response shapes, usage and errors as text chat.

The chat route hands a request here when a user message holds an image and the engine cannot take it (a
Qwen2-VL / Qwen2.5-VL engine runs image chats itself, as text ones); text-only requests never come here.
Images are read under the server's `ImagePolicy` (data: URLs always; local paths and http(s) only where
allowed), off the event loop, and every refusal is a 400 naming the part it is about.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from minisgl_cli.admission import AdmissionError
from minisgl_cli.api import protocol as p
from minisgl_cli.server.context import ServerContext, chat_with_images
from minisgl_cli.server.deadline import Deadline, DeadlineExceeded
from minisgl_cli.server.errors import InputError, admission_error, engine_error, error_frame
from minisgl_cli.server.gate import downscale_headers
from minisgl_cli.server.runs import sse, stream_response, unless_disconnected
from minisgl_cli.server.settings import VisionSettings
from minisgl_cli.types import Delta, RequestStats, new_request_id
from minisgl_cli.vision.image_source import ImageError
from minisgl_cli.vision.vlm import (
    LoadedVlm,
    VlmLoadError,
    check_budget,
    prepare,
    refused_fields,
    stream,
)

log = logging.getLogger("minisgl.server")

ENDPOINT = "/v1/chat/completions"


def _refuse(body: p.ChatCompletionRequest) -> None:
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


class VisionRun:
    """One VLM generation as the HTTP side sees it: holds an inflight slot, ends in the metrics once, and
    stops the generation when closed (client gone, response done)."""

    def __init__(self, ctx: ServerContext, loaded: LoadedVlm, deltas: AsyncGenerator[Delta], cancel: threading.Event,
                 rid: str, deadline: Deadline):
        self.ctx, self.loaded, self.deltas, self.cancel, self.rid = ctx, loaded, deltas, cancel, rid
        self.deadline = deadline
        deadline.start()
        self.final: Delta | None = None
        self.closed = False

    async def next(self) -> Delta | None:
        if self.final is not None:
            return None
        try:
            d = await self.deadline.wait(self.deltas.__anext__())
        except DeadlineExceeded as exc:  # the generation stops when the run closes
            d = Delta(self.rid, error=str(exc), error_code=exc.code)
        if d.finished:
            self.final = d
        return d

    async def collect(self) -> tuple[str, Delta]:
        text = ""
        while (d := await self.next()) is not None:
            text += d.text
        assert self.final is not None
        return text, self.final

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.cancel.set()
        self.deadline.cancel()
        final = self.final
        if final is None:
            self.ctx.metrics.disconnect()
            log.info("rid=%s %s (VLM): client gone, generation stopped", self.rid, ENDPOINT)
        self.ctx.metrics.finish(final.stats if final else None,
                                (final.finish_reason if not final.error else None) if final else "abort", ENDPOINT)
        self.ctx.gate.release(1)


async def chat(body: p.ChatCompletionRequest, request: Request, ctx: ServerContext) -> Any:
    """/v1/chat/completions for a request with images (the route checked `body.has_images`)."""
    vlm = ctx.vlm
    if vlm is None:
        raise InputError("this request has image_url parts but the server has no vision-language model: start "
                         "`minisgl serve` with --vlm-model PATH (or set MINISGL_VLM_MODEL), or serve a Qwen2-VL / "
                         "Qwen2.5-VL model as --model", "messages", code="vlm_not_loaded")
    settings: VisionSettings = ctx.settings.vision or VisionSettings()
    if body.model and body.model.lower() not in ctx.aliases | {vlm.name.lower()}:
        raise InputError(f"model {body.model!r} does not exist; this server's vision-language model is "
                         f"{vlm.name!r}", "model", 404, "model_not_found")
    _refuse(body)
    deadline = ctx.deadline(body.timeout)  # bounds the generation (loading and preparing run as they must)
    loop = asyncio.get_running_loop()
    try:
        messages = await loop.run_in_executor(None, chat_with_images, body.messages, settings.images)
    except ImageError as exc:
        raise InputError(exc.message, exc.param) from None
    try:
        loaded = await loop.run_in_executor(None, vlm.load)
    except VlmLoadError as exc:
        raise InputError(str(exc), "model", 500, "vlm_unavailable") from None
    try:
        prepared = await loop.run_in_executor(None, prepare, loaded, messages)
        requested = check_budget(loaded, prepared, body.requested_max_tokens)
    except AdmissionError as exc:  # the context limit
        raise admission_error(exc) from None
    except ValueError as exc:  # the template or the processor refused the input
        raise InputError(str(exc), "messages") from None
    max_new = ctx.gate.downscale(requested)
    note = f"{requested}->{max_new}" if max_new < requested else None
    rid = new_request_id("vlm")
    ctx.gate.take(1)
    log.info("rid=%s %s admitted (VLM %s): prompt_tokens=%d images=%d max_new_tokens=%d", rid, ENDPOINT,
             loaded.name, prepared.prompt_tokens, prepared.images, max_new)
    cancel = threading.Event()
    deltas = stream(loaded, prepared, body.sampling_params(max_new), rid, cancel)
    run = VisionRun(ctx, loaded, deltas, cancel, rid, deadline)
    cid, ts, model = p.new_id("chatcmpl"), p.now(), loaded.name
    if not body.stream:
        try:
            text, final = await unless_disconnected(request, run.collect())
        finally:
            run.close()
        if final.error:
            raise engine_error(final)
        message = p.ChatResponseMessage(content=text)
        resp = p.ChatCompletionResponse(id=cid, created=ts, model=model, usage=_usage(final), choices=[
            p.ChatChoice(index=0, message=message, finish_reason=final.finish_reason)])
        return JSONResponse(resp.model_dump(), headers=downscale_headers(note))
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(**kw: Any) -> str:
        return sse(p.chat_chunk(cid, ts, model, 0, with_usage_field=with_usage, **kw))

    async def frames() -> AsyncIterator[str]:
        try:
            yield chunk(role=True, content="")
            while (d := await run.next()) is not None:
                if d.error:
                    yield sse(error_frame(d))
                    break
                if d.text or d.token_ids:
                    yield chunk(content=d.text)
                if d.finish_reason:
                    yield chunk(finish_reason=d.finish_reason)
            if with_usage and run.final is not None and not run.final.error:
                yield sse(p.usage_chunk(cid, ts, model, "chat.completion.chunk", _usage(run.final)))
            yield sse("[DONE]")
        finally:
            run.close()

    return stream_response(run, frames(), note)


def _usage(final: Delta) -> p.Usage:
    s = final.stats or RequestStats()
    return p.usage(s.prompt_tokens, s.completion_tokens, s.cached_tokens)
