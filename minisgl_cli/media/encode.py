"""Encoding generated media to files and bytes: PNG, mp4 (imageio-ffmpeg, else OpenCV), frame dirs."""

from __future__ import annotations

import functools
import io
import os
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from minisgl_cli.media.jobs import MediaError


def unique_path(out_dir: str | Path, stem: str, suffix: str = "") -> Path:
    """out_dir/<stem><suffix>, with -1, -2... appended when taken: a run never overwrites a file."""
    out_dir = Path(out_dir).expanduser()
    out_dir.mkdir(parents=True, exist_ok=True)
    path, n = out_dir / f"{stem}{suffix}", 1
    while path.exists():
        path, n = out_dir / f"{stem}-{n}{suffix}", n + 1
    return path


PNG_LEVEL = 1  # zlib's fastest: 1024x1024 in ~90 ms on one core at PIL's adaptive filter, ~430 at its default 6
PNG_PIECE = 256 << 10  # the least a thread deflates: below it, threads cost more than they save
PNG_THREADS = min(8, os.cpu_count() or 1)
_COLOR_TYPE = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (grey, grey + alpha, RGB, RGBA)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


def _deflate(data: memoryview, level: int) -> bytes:
    """One zlib stream of `data`, its pieces deflated on threads as pigz does: each piece primed with the 32 KB before
    it (so the ratio stays near one stream's), all but the last ended on a byte boundary (a sync flush), the pieces'
    raw streams concatenated under one header and one Adler-32 of the whole."""
    pieces = max(1, min(PNG_THREADS, len(data) // PNG_PIECE))
    bounds = [len(data) * i // pieces for i in range(pieces + 1)]

    def piece(i: int) -> bytes:
        start, end = bounds[i], bounds[i + 1]
        prime = bytes(data[max(0, start - 32768):start])
        c = zlib.compressobj(level, zlib.DEFLATED, -15, zdict=prime) if prime else \
            zlib.compressobj(level, zlib.DEFLATED, -15)
        return c.compress(data[start:end]) + c.flush(zlib.Z_FINISH if i == pieces - 1 else zlib.Z_SYNC_FLUSH)

    body = b"".join(_pool().map(piece, range(pieces))) if pieces > 1 else piece(0)
    return b"\x78\x01" + body + struct.pack(">I", zlib.adler32(data))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=PNG_THREADS, thread_name_prefix="minisgl-png")


def png_bytes(image: Any, level: int = PNG_LEVEL) -> bytes:
    """`image` (PIL or a uint8 array, HxW or HxWxC) as a lossless PNG, made here rather than by PIL so that its
    deflate runs on several cores (zlib lets go of the GIL): every row "Up"-filtered (a row less the one above it, one
    numpy subtraction; PIL tries five filters a row), then deflated in pieces (`_deflate`). 1024x1024 RGB: ~90 ms on
    one core through PIL at level 1, a fraction of that over a GPU host's cores, the same pixels."""
    import numpy as np

    arr = np.ascontiguousarray(np.asarray(image, dtype=np.uint8))
    height, width = arr.shape[:2]
    channels = 1 if arr.ndim == 2 else arr.shape[2]
    rows = arr.reshape(height, width * channels)
    lines = np.empty((height, 1 + width * channels), np.uint8)
    lines[:, 0] = 2  # the Up filter
    lines[0, 1:] = rows[0]  # the first row's "above" is zeros
    np.subtract(rows[1:], rows[:-1], out=lines[1:, 1:])  # uint8 wraps modulo 256, as PNG's filters do
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPE[channels], 0, 0, 0)
    idat = _deflate(memoryview(lines.reshape(-1).data), level)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}  # the API's output_format -> PIL's


def image_bytes(image: Any, fmt: str = "png", quality: int | None = None) -> bytes:
    """`image` as png, jpeg or webp; `quality` (1-100, the lossy two only; default 100 as OpenAI's)."""
    if fmt == "png":
        return png_bytes(image)
    buf = io.BytesIO()
    image.save(buf, format=IMAGE_FORMATS[fmt], quality=100 if quality is None else quality)
    return buf.getvalue()


def frame_png_bytes(frame: Any) -> bytes:
    return png_bytes(frame)


def write_mp4(frames: list[Any], fps: int, path: str | Path) -> Path:
    """H.264 via imageio-ffmpeg when installed; otherwise OpenCV's mp4v (the GPU box has only OpenCV)."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    h, w = frames[0].shape[:2]
    try:
        import imageio_ffmpeg
    except ImportError:
        imageio_ffmpeg = None
    if imageio_ffmpeg is not None:
        writer = imageio_ffmpeg.write_frames(
            str(path), (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv420p", quality=8, macro_block_size=1,
            ffmpeg_log_level="error",
        )
        writer.send(None)  # start the ffmpeg process
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        return path
    try:
        import cv2
    except ImportError:
        raise MediaError(
            "writing mp4 needs imageio-ffmpeg or opencv-python (pip install imageio-ffmpeg)", "format"
        ) from None
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    if not writer.isOpened():
        raise MediaError(f"OpenCV could not open an mp4 writer for {path}", "format")
    for frame in frames:
        writer.write(cv2.cvtColor(np.ascontiguousarray(frame), cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def mp4_bytes(frames: list[Any], fps: int) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return write_mp4(frames, fps, Path(tmp) / "video.mp4").read_bytes()


def write_frames(frames: list[Any], out_dir: str | Path) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, frame in enumerate(frames):
        p = out_dir / f"frame_{i:05d}.png"
        p.write_bytes(frame_png_bytes(frame))
        paths.append(p)
    return paths
