"""OpenAI-style media routes over the media worker (media/service.py): POST /v1/images/generations (plain or
streamed with partial images), POST /v1/videos/generations (the mp4 in the answer) and the Videos API (videos.py).

Mount it on any FastAPI app (the worker starts on the first media request and stops at the process's exit; pass your
own MediaService to stop it earlier with its `close`):

    app.include_router(build_media_router(MediaSettings(image_model_dir=...)))

Every field of the OpenAI images request is implemented or refused with a 400 naming it; ours beyond OpenAI's
(`seed`, `steps`, `guidance_scale`, `negative_prompt`) go in the client's extra_body.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from minisgl_cli import env
from minisgl_cli.api.protocol import error_response
from minisgl_cli.device import DeviceError
from minisgl_cli.media.jobs import (
    ImageJob,
    Kind,
    MediaError,
    ModelNotFoundError,
    ModelSpec,
    VideoJob,
    first_line,
    job_defaults,
    parse_size,
)
from minisgl_cli.media.service import MediaService, Refused, Ticket
from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.messages import MediaFailed, MediaPartial, MediaResult
from minisgl_cli.server.errors import Disconnected
from minisgl_cli.server.runs import sse, unless_disconnected
from minisgl_cli.server.videos import VideoRecord, VideoStore, follow, read_fields, video_job

log = logging.getLogger(__name__)
_IMAGE, _VIDEO = job_defaults(ImageJob), job_defaults(VideoJob)  # a request's defaults are its job's

# OpenAI's quality -> denoise steps, as a share of the image model's default steps (Z-Image-Turbo: 9):
# low 5, medium / standard / auto 9, high / hd 18.
QUALITY_STEPS = {"low": 0.5, "medium": 1.0, "standard": 1.0, "auto": 1.0, "high": 2.0, "hd": 2.0}
MAX_PARTIAL_IMAGES = 3


class ImageGenerationRequest(BaseModel):
    """OpenAI's images.generate body. A field outside this list is a 400 (extra="forbid"): complexity, svg,
    frame_count... are for models this server does not run."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = Field(None, description=f'"WIDTHxHEIGHT", multiples of 16, or "auto" '
                                                f'({_IMAGE["width"]}x{_IMAGE["height"]})')
    quality: str | None = Field(None, description="low / medium / high / auto (standard, hd): denoise steps")
    response_format: str | None = Field(None, description="b64_json only (url is not supported)")
    output_format: str | None = Field(None, description="png (default), jpeg or webp")
    output_compression: int | None = Field(None, description="jpeg / webp quality 0-100 (default 100)")
    background: str | None = Field(None, description="auto or opaque (transparent is refused)")
    stream: bool | None = None
    partial_images: int | None = Field(None, description="0-3 previews while streaming")
    moderation: str | None = Field(None, description="accepted; this server runs no moderation")
    style: str | None = Field(None, description="dall-e-3 only: refused")
    user: str | None = None
    safety_identifier: str | None = None
    # Extensions beyond OpenAI's fields (send them with the client's extra_body).
    seed: int | None = Field(None, description="image i of the request is drawn from seed + i")
    steps: int | None = Field(None, description=f"denoise steps (default {_IMAGE['steps']}; or give quality)")
    guidance_scale: float = _IMAGE["guidance_scale"]
    negative_prompt: str | None = None


class VideoGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = None
    size: str = Field(f'{_VIDEO["width"]}x{_VIDEO["height"]}', description='"WIDTHxHEIGHT", multiples of 16')
    num_frames: int = _VIDEO["num_frames"]
    fps: int = _VIDEO["fps"]
    steps: int = _VIDEO["steps"]
    guidance_scale: float = _VIDEO["guidance_scale"]
    seed: int | None = None
    negative_prompt: str | None = None
    response_format: Literal["b64_json", "frames"] = Field(
        "b64_json", description="b64_json: one base64 mp4; frames: base64 PNG per frame"
    )


def media_error(exc: Exception, kind: str = "media") -> JSONResponse:
    """An exception of a media request as its OpenAI error body."""
    if isinstance(exc, Refused):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code,
                              headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, MediaError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)
    if isinstance(exc, DeviceError):
        return error_response(500, f"server media device: {exc}", "server_error", None, "device_unavailable")
    log.exception("%s generation failed", kind)
    return error_response(500, f"{kind} generation failed: {first_line(exc) or type(exc).__name__}", "server_error",
                          None, "generation_failed")


def _refuse(param: str, message: str) -> MediaError:
    return MediaError(message, param)


def image_job(body: ImageGenerationRequest) -> ImageJob:
    """The job a request asks for; MediaError (400, naming the field) for what this server does not do."""
    if body.response_format not in (None, "b64_json"):
        raise _refuse("response_format", f"response_format {body.response_format!r} is not supported: this server "
                                         "returns images inline, use 'b64_json'")
    if body.output_format not in (None, "png", "jpeg", "webp"):
        raise _refuse("output_format", f"output_format {body.output_format!r} is not supported: png, jpeg or webp")
    if body.output_compression is not None:
        if body.output_format not in ("jpeg", "webp"):
            raise _refuse("output_compression", "output_compression is for output_format jpeg or webp")
        if not 0 <= body.output_compression <= 100:
            raise _refuse("output_compression", f"output_compression must be in [0, 100], got "
                                                f"{body.output_compression}")
    if body.background not in (None, "auto", "opaque"):
        raise _refuse("background", f"background {body.background!r} is not supported: the image models here "
                                    "draw opaque images (use 'auto' or 'opaque')")
    if body.style is not None:
        raise _refuse("style", "style is a dall-e-3 option this server's models do not have")
    if body.moderation not in (None, "auto", "low"):
        raise _refuse("moderation", f"moderation must be 'auto' or 'low', got {body.moderation!r}")
    if body.partial_images is not None:
        if not 0 <= body.partial_images <= MAX_PARTIAL_IMAGES:
            raise _refuse("partial_images", f"partial_images must be in [0, {MAX_PARTIAL_IMAGES}], "
                                            f"got {body.partial_images}")
        if body.partial_images and not body.stream:
            raise _refuse("partial_images", "partial_images needs stream: true")
    steps = body.steps
    if body.quality not in (None, "auto"):
        if body.quality not in QUALITY_STEPS:
            raise _refuse("quality", f"quality {body.quality!r} is not supported: low, medium, high or auto")
        if steps is not None:
            raise _refuse("quality", "give quality or steps, not both")
        steps = max(1, round(_IMAGE["steps"] * QUALITY_STEPS[body.quality]))
    w, h = parse_size(body.size) if body.size not in (None, "auto") else (_IMAGE["width"], _IMAGE["height"])
    return ImageJob(body.prompt, w, h, steps or _IMAGE["steps"], body.guidance_scale, body.n, body.seed,
                    body.negative_prompt)


def check_model(settings: MediaSettings, kind: Kind, requested: str | None) -> ModelSpec:
    if not settings.serves(kind, requested):
        served = settings.image_model if kind == "image" else settings.video_model
        raise ModelNotFoundError(
            f"model {requested!r} is not served here; this server's {kind} model is {served!r}", "model"
        )
    spec = settings.spec(kind)
    if not settings.available(kind):
        var = env.IMAGE_MODEL_DIR if kind == "image" else env.VIDEO_MODEL_DIR
        raise ModelNotFoundError(
            f"{kind} model {spec.model!r} is not available on this server: {spec.model_dir} has no model_index.json. "
            f"Start `minisgl serve` with --{kind}-model-dir DIR (or set {var}) pointing to a diffusers pipeline dir; "
            f"`minisgl {kind} --model-dir DIR` downloads the weights there.",
            "model",
        )
    return spec


async def finished(request: Request, service: MediaService, ticket: Ticket) -> MediaResult:
    """The ticket's result; its job cancelled if the client hangs up first (Disconnected)."""
    try:
        return await unless_disconnected(request, ticket.result())
    finally:
        if not ticket.done:
            service.cancel(ticket.jid)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def server_timing(result: MediaResult, since: float) -> dict[str, str]:
    """The `Server-Timing` header of a job's response (ms): the pipeline call, the encoding, and the whole of it in
    this server since the request was admitted; `total` less the other two is the queue and the hand-offs."""
    total = time.perf_counter() - since
    parts = (("generate", result.elapsed_s), ("encode", result.encode_s), ("total", total))
    return {"Server-Timing": ", ".join(f"{name};dur={1e3 * s:.1f}" for name, s in parts)}


def _usage(tokens: int) -> dict[str, Any]:
    """OpenAI's image usage: the prompt's text tokens in (as the pipeline counts them); no image tokens."""
    return {"input_tokens": tokens, "output_tokens": 0, "total_tokens": tokens,
            "input_tokens_details": {"image_tokens": 0, "text_tokens": tokens}}


def _image_stream(service: MediaService, ticket: Ticket, body: ImageGenerationRequest, job: ImageJob,
                  fmt: str) -> AsyncIterator[str]:
    common = {"background": "opaque", "output_format": fmt, "quality": body.quality or "auto",
              "size": f"{job.width}x{job.height}"}

    async def events() -> AsyncIterator[str]:
        try:
            async for event in ticket.stream():
                now = int(time.time())
                if isinstance(event, MediaPartial):
                    yield _event("image_generation.partial_image", {
                        "type": "image_generation.partial_image", "b64_json": _b64(event.data), "created_at": now,
                        "partial_image_index": event.index, **common})
                elif isinstance(event, MediaResult):
                    for item in event.items:
                        yield _event("image_generation.completed", {
                            "type": "image_generation.completed", "b64_json": _b64(item), "created_at": now,
                            "usage": _usage(event.prompt_tokens), **common})
                elif isinstance(event, MediaFailed):
                    yield _event("error", {"error": {"message": event.message, "type": "server_error"
                                                     if event.status >= 500 else "invalid_request_error",
                                                     "param": event.param, "code": event.code}})
        finally:  # the client hung up (the response task is cancelled) or the stream ended
            if not ticket.done:
                service.cancel(ticket.jid)

    return events()


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\n{sse(data)}"


def build_media_router(settings: MediaSettings | None = None, service: MediaService | None = None) -> APIRouter:
    """The media routes over `service` (else one of their own on `settings`, else on the environment's)."""
    settings = settings or (service.settings if service is not None else MediaSettings.from_env())
    service = service or MediaService(settings)
    router = APIRouter(tags=["media"])

    @router.post("/v1/images/generations")
    async def create_image(body: ImageGenerationRequest, request: Request, response: Response) -> Any:
        since = time.perf_counter()
        try:
            job = image_job(body)
            check_model(settings, "image", body.model)
            fmt = body.output_format or "png"
            ticket = service.admit("image", job, fmt, body.output_compression, body.partial_images or 0)
            await service.submit(ticket)
            if body.stream:
                return StreamingResponse(_image_stream(service, ticket, body, job, fmt),
                                         media_type="text/event-stream")
            result = await finished(request, service, ticket)
        except Disconnected:
            return Response(status_code=499)
        except Exception as exc:
            return media_error(exc, "image")
        response.headers.update(server_timing(result, since))
        return {
            "created": int(time.time()),
            "data": [{"b64_json": _b64(item), "revised_prompt": None} for item in result.items],
            "background": "opaque",
            "output_format": fmt,
            "quality": body.quality or "auto",
            "size": f"{job.width}x{job.height}",
            "usage": _usage(result.prompt_tokens),
            "seed": job.seed,
        }

    @router.post("/v1/videos/generations")
    async def create_video(body: VideoGenerationRequest, request: Request, response: Response) -> Any:
        since = time.perf_counter()
        try:
            w, h = parse_size(body.size)
            job = VideoJob(body.prompt, w, h, body.num_frames, body.fps, body.steps, body.guidance_scale, body.seed,
                           body.negative_prompt)
            check_model(settings, "video", body.model)
            as_frames = body.response_format == "frames"
            ticket = service.admit("video", job, "frames" if as_frames else "mp4")
            await service.submit(ticket)
            result = await finished(request, service, ticket)
        except Disconnected:
            return Response(status_code=499)
        except Exception as exc:
            return media_error(exc, "video")
        response.headers.update(server_timing(result, since))
        if as_frames:
            item: dict[str, Any] = {"frames": [_b64(f) for f in result.items], "mime_type": "image/png"}
        else:
            item = {"b64_json": _b64(result.items[0]), "mime_type": "video/mp4"}
        return {
            "created": int(time.time()),
            "data": [item],
            "size": f"{w}x{h}",
            "num_frames": job.num_frames,
            "fps": job.fps,
            "seed": job.seed,
        }

    _videos_api(router, settings, service)
    return router


def _videos_api(router: APIRouter, settings: MediaSettings, service: MediaService) -> None:
    """The OpenAI Videos API's routes (videos.py: its jobs and their store)."""
    store = VideoStore()
    tasks: set[asyncio.Task] = set()

    def missing(video_id: str) -> Response:
        return error_response(404, f"no video {video_id!r} (unknown, deleted, or evicted)", "invalid_request_error",
                              "video_id", "not_found")

    @router.post("/v1/videos")
    async def create(request: Request) -> Any:
        try:
            fields = await read_fields(request)
            job, seconds = video_job(fields)
            check_model(settings, "video", fields.get("model"))
            ticket = service.admit("video", job, "mp4")
            await service.submit(ticket)
        except Exception as exc:
            return media_error(exc, "video")
        record = VideoRecord(f"video_{secrets.token_hex(12)}", job.prompt, fields.get("model") or settings.video_model,
                             f"{job.width}x{job.height}", seconds, int(time.time()), ticket)
        store.add(record)
        task = asyncio.get_running_loop().create_task(follow(record, store))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return record.to_json()

    @router.get("/v1/videos")
    async def list_videos(limit: int = 20, order: str = "desc", after: str | None = None) -> Any:
        records = list(store.records.values())
        if order == "desc":
            records.reverse()
        if after is not None:
            ids = [r.id for r in records]
            records = records[ids.index(after) + 1:] if after in ids else []
        page = records[:max(1, min(limit, 100))]
        return {"object": "list", "data": [r.to_json() for r in page], "has_more": len(records) > len(page),
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}

    @router.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str) -> Any:
        record = store.records.get(video_id)
        return record.to_json() if record is not None else missing(video_id)

    @router.get("/v1/videos/{video_id}/content")
    async def content(video_id: str, variant: str = "video") -> Any:
        record = store.records.get(video_id)
        if record is None:
            return missing(video_id)
        if variant != "video":
            return error_response(400, f"variant {variant!r} is not supported: 'video' (the mp4) only",
                                  "invalid_request_error", "variant", "invalid_value")
        if record.data is None:
            return error_response(409 if record.status != "failed" else 400,
                                  f"video {video_id} is {record.status}: no content yet" if record.status != "failed"
                                  else f"video {video_id} failed: no content", "invalid_request_error", None,
                                  "video_not_ready")
        return Response(record.data, media_type="video/mp4")

    @router.delete("/v1/videos/{video_id}")
    async def delete(video_id: str) -> Any:
        record = store.records.pop(video_id, None)
        if record is None:
            return missing(video_id)
        if record.ticket is not None:
            service.cancel(record.ticket.jid)
        return {"id": video_id, "object": "video.deleted", "deleted": True}
