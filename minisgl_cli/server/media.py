"""OpenAI-style media routes: POST /v1/images/generations and /v1/videos/generations over the pipelines of media/.

Mount it on any FastAPI app:

    app.include_router(build_media_router(MediaSettings(image_model_dir=...)))
    # or: app.state.media_settings = MediaSettings(...); app.include_router(media.router)

Pipelines load lazily on the first request and stay cached; generation runs in a worker thread
so the event loop keeps serving other requests.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
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
    job_defaults,
    parse_size,
)
from minisgl_cli.media.settings import MediaSettings

log = logging.getLogger(__name__)
_IMAGE, _VIDEO = job_defaults(ImageJob), job_defaults(VideoJob)  # a request's defaults are its job's


class ImageGenerationRequest(BaseModel):
    """OpenAI images.generate body; unknown OpenAI fields (quality, style, user...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    prompt: str
    model: str | None = None
    n: int = 1
    size: str | None = Field(None, description=f'"WIDTHxHEIGHT", multiples of 16; default '
                                                f'{_IMAGE["width"]}x{_IMAGE["height"]}')
    response_format: str | None = Field(None, description="b64_json only (url is not supported)")
    output_format: str | None = Field(None, description="png only")
    seed: int | None = None
    # Extensions beyond OpenAI's fields (send them with the client's extra_body).
    steps: int = _IMAGE["steps"]
    guidance_scale: float = _IMAGE["guidance_scale"]
    negative_prompt: str | None = None


class VideoGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

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


def _media_error(exc: MediaError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)


def _handle(kind: str, exc: Exception) -> JSONResponse:
    if isinstance(exc, MediaError):
        return _media_error(exc)
    if isinstance(exc, DeviceError):
        return error_response(500, f"server media device: {exc}", "server_error", None, "device_unavailable")
    log.exception("%s generation failed", kind)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return error_response(500, f"{kind} generation failed: {first}", "server_error", None, "generation_failed")


def _image_job(body: ImageGenerationRequest) -> ImageJob:
    if body.response_format not in (None, "b64_json"):
        raise MediaError(
            f"response_format {body.response_format!r} is not supported: this server returns images inline, "
            "use 'b64_json'",
            "response_format",
        )
    if body.output_format not in (None, "png"):
        raise MediaError(f"output_format {body.output_format!r} is not supported, use 'png'", "output_format")
    w, h = parse_size(body.size) if body.size not in (None, "auto") else (_IMAGE["width"], _IMAGE["height"])
    return ImageJob(body.prompt, w, h, body.steps, body.guidance_scale, body.n, body.seed, body.negative_prompt)


def _check_model(settings: MediaSettings, kind: Kind, requested: str | None) -> ModelSpec:
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


def _generate_image_b64(spec: ModelSpec, job: ImageJob) -> list[str]:
    from minisgl_cli.media.encode import png_bytes
    from minisgl_cli.media.image import generate_images
    from minisgl_cli.media.pipelines import load_pipeline

    result = generate_images(load_pipeline(spec), job)
    return [base64.b64encode(png_bytes(im)).decode("ascii") for im in result.images]


def _generate_video_payload(spec: ModelSpec, job: VideoJob, as_frames: bool) -> tuple[dict[str, Any], int]:
    from minisgl_cli.media.encode import frame_png_bytes, mp4_bytes
    from minisgl_cli.media.pipelines import load_pipeline
    from minisgl_cli.media.video import generate_video

    result = generate_video(load_pipeline(spec), job)
    if as_frames:
        frames = [base64.b64encode(frame_png_bytes(f)).decode("ascii") for f in result.frames]
        return {"frames": frames, "mime_type": "image/png"}, len(result.frames)
    data = base64.b64encode(mp4_bytes(result.frames, result.fps)).decode("ascii")
    return {"b64_json": data, "mime_type": "video/mp4"}, len(result.frames)


def build_media_router(settings: MediaSettings | None = None) -> APIRouter:
    """The media routes. Settings: the argument, else `app.state.media_settings`, else the environment."""
    router = APIRouter(tags=["media"])

    def current(request: Request) -> MediaSettings:
        return settings or getattr(request.app.state, "media_settings", None) or MediaSettings.from_env()

    @router.post("/v1/images/generations")
    async def create_image(body: ImageGenerationRequest, request: Request) -> Any:
        try:
            job = _image_job(body)
            spec = _check_model(current(request), "image", body.model)
            images = await asyncio.get_running_loop().run_in_executor(None, _generate_image_b64, spec, job)
        except Exception as exc:
            return _handle("image", exc)
        return {
            "created": int(time.time()),
            "data": [{"b64_json": b64, "revised_prompt": None} for b64 in images],
            "output_format": "png",
            "size": f"{job.width}x{job.height}",
            "seed": job.seed,
        }

    @router.post("/v1/videos/generations")
    async def create_video(body: VideoGenerationRequest, request: Request) -> Any:
        try:
            w, h = parse_size(body.size)
            job = VideoJob(
                body.prompt, w, h, body.num_frames, body.fps, body.steps, body.guidance_scale, body.seed,
                body.negative_prompt,
            )
            spec = _check_model(current(request), "video", body.model)
            item, frames = await asyncio.get_running_loop().run_in_executor(
                None, _generate_video_payload, spec, job, body.response_format == "frames"
            )
        except Exception as exc:
            return _handle("video", exc)
        return {
            "created": int(time.time()),
            "data": [item],
            "size": f"{w}x{h}",
            "num_frames": frames,
            "fps": job.fps,
            "seed": job.seed,
        }

    return router


# Reads its settings per request from app.state.media_settings or the environment.
router = build_media_router()
