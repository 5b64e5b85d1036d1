"""The OpenAI Videos API's jobs (its routes are in media.py): a create request read into a VideoJob, each job's
record kept up to date from the worker's events, and the store that holds them (GET /v1/videos/{id}, its content,
DELETE).

Finished videos wait in a bounded store (MAX_VIDEOS and MAX_BYTES, the oldest evicted first). The official client
posts multipart form data (`client.videos.create`); a JSON body works too. Beyond OpenAI's fields: `num_frames`,
`fps`, `steps`, `guidance_scale`, `seed`, `negative_prompt` (the client's extra_body).
"""

from __future__ import annotations

import collections
import email.parser
import email.policy
import json
import time
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from minisgl_cli.media.jobs import MediaError, VideoJob, job_defaults, parse_size
from minisgl_cli.media.service import Ticket
from minisgl_cli.messages import MediaFailed, MediaProgress, MediaResult

MAX_VIDEOS = 16
MAX_BYTES = 512 * 1024 * 1024
_VIDEO = job_defaults(VideoJob)
FIELDS = {"prompt", "model", "seconds", "size", "num_frames", "fps", "steps", "guidance_scale", "seed",
          "negative_prompt"}


@dataclass
class VideoRecord:
    id: str
    prompt: str
    model: str
    size: str
    seconds: str
    created_at: int
    ticket: Ticket | None
    status: str = "queued"
    progress: int = 0
    completed_at: int | None = None
    error: dict[str, Any] | None = None
    data: bytes | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": None, "prompt": self.prompt, "remixed_from_video_id": None, "seconds": self.seconds,
                "size": self.size, "error": self.error}


class VideoStore:
    """Every video job of this server by id; finished ones capped in count and bytes (oldest evicted first)."""

    def __init__(self, max_videos: int = MAX_VIDEOS, max_bytes: int = MAX_BYTES):
        self.max_videos, self.max_bytes = max_videos, max_bytes
        self.records: collections.OrderedDict[str, VideoRecord] = collections.OrderedDict()

    def add(self, record: VideoRecord) -> None:
        self.records[record.id] = record

    def finished(self, record: VideoRecord) -> None:
        """`record` just ended: evict the oldest ended records past the caps (never `record` itself)."""
        ended = [r for r in self.records.values() if r.status in ("completed", "failed") and r is not record]
        while ended and (len(ended) + 1 > self.max_videos
                         or sum(len(r.data or b"") for r in ended) + len(record.data or b"") > self.max_bytes):
            self.records.pop(ended.pop(0).id, None)


def _form(body: bytes, content_type: str) -> dict[str, Any]:
    """A multipart/form-data body's fields (text values; a file part is kept as bytes)."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        f"Content-Type: {content_type}\r\n\r\n".encode() + body)
    fields: dict[str, Any] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True)
        payload = payload if isinstance(payload, bytes) else b""
        fields[str(name)] = payload if part.get_filename() else payload.decode()
    return fields


async def read_fields(request: Request) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "")
    body = await request.body()
    if content_type.startswith("multipart/form-data"):
        return _form(body, content_type)
    try:
        data = json.loads(body or b"{}")
    except json.JSONDecodeError as exc:
        raise MediaError(f"malformed JSON body: {exc}", None) from None
    if not isinstance(data, dict):
        raise MediaError("the body must be a JSON object", None)
    return data


def _number(fields: dict[str, Any], name: str, cast: type, default: Any) -> Any:
    value = fields.get(name)
    if value is None or value == "":
        return default
    try:
        return cast(value)
    except (TypeError, ValueError):
        raise MediaError(f"{name} must be a number, got {value!r}", name) from None


def video_job(fields: dict[str, Any]) -> tuple[VideoJob, str]:
    """The job a create request asks for, and its `seconds` as the API reports them."""
    if "input_reference" in fields:
        raise MediaError("input_reference (image-to-video) is not supported: this server makes videos from text",
                         "input_reference")
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise MediaError(f"unknown field {unknown[0]!r}", unknown[0])
    prompt = fields.get("prompt")
    if not isinstance(prompt, str):
        raise MediaError("prompt is required", "prompt")
    fps = _number(fields, "fps", int, _VIDEO["fps"])
    seconds = fields.get("seconds")
    frames = _number(fields, "num_frames", int, None)
    if seconds is not None and frames is not None:
        raise MediaError("give seconds or num_frames, not both", "seconds")
    if seconds is not None:
        frames = _number(fields, "seconds", int, 0) * fps + 1  # Wan makes 4k + 1 frames
    frames = frames or _VIDEO["num_frames"]
    w, h = parse_size(str(fields.get("size") or f'{_VIDEO["width"]}x{_VIDEO["height"]}'))
    job = VideoJob(prompt, w, h, frames, fps, _number(fields, "steps", int, _VIDEO["steps"]),
                   _number(fields, "guidance_scale", float, _VIDEO["guidance_scale"]),
                   _number(fields, "seed", int, None), fields.get("negative_prompt") or None)
    return job, str(seconds) if seconds is not None else f"{(frames - 1) / fps:g}"


async def follow(record: VideoRecord, store: VideoStore) -> None:
    """Keep a record up to date with its job's events, to its end."""
    assert record.ticket is not None
    async for event in record.ticket.stream():
        if isinstance(event, MediaProgress):
            record.status = "in_progress"
            record.progress = min(99, round(100 * event.step / max(1, event.steps)))
        elif isinstance(event, MediaResult):
            record.status, record.progress, record.data = "completed", 100, event.items[0]
        elif isinstance(event, MediaFailed):
            record.status = "failed"
            record.error = {"code": event.code or "generation_failed", "message": event.message}
    record.completed_at = int(time.time())
    record.ticket = None
    store.finished(record)
