"""Images a request names -> checked RGB PIL images: `data:` URLs always, local files only under an allowed
directory, http(s) only when allowed; every source under one byte cap and one pixel cap.

The server never fetches an arbitrary URL by default (`ImagePolicy.allow_remote` is off): a chat request
must not make it a proxy into the network it sits in. Every refusal is a `ImageError` (a 400 on the
server, a one-line error in the REPL) whose message says what was wrong and which flag allows it.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse


class ImageError(Exception):
    """An image a request names that cannot be read; `param` names the offending input (a 400, OpenAI style)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


DEFAULT_MAX_BYTES = 20 * 1024 * 1024  # OpenAI's own limit per image
# The server's body cap (--max-body-bytes): room for a chat with one image at DEFAULT_MAX_BYTES (27 MiB as base64).
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_PIXELS = 25_000_000  # 5000 x 5000: far past what any VLM processor keeps, short of a decompression bomb


@dataclass(frozen=True)
class ImagePolicy:
    """Where images may come from and how large they may be."""

    local_dir: Path | None = None  # local paths (and file:// URLs) only under it; None: no local paths
    allow_remote: bool = False  # http(s) URLs: off by default
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    timeout_s: float = 10.0  # a remote fetch, connect to last byte


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def decode_image(data: bytes, policy: ImagePolicy, what: str, param: str | None = None) -> Any:
    """Bytes -> an RGB PIL image, or a ImageError saying why not (too large, too many pixels, not an image)."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > policy.max_bytes:
        raise ImageError(f"{what} is {_mib(len(data))}; the limit is {_mib(policy.max_bytes)}", param)
    if not data:
        raise ImageError(f"{what} is empty", param)
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only: the size is known before any pixel
        w, h = image.size
        if w * h > policy.max_pixels:
            raise ImageError(f"{what} is {w}x{h} = {w * h:,} pixels; the limit is {policy.max_pixels:,}", param)
        image.load()
        return image.convert("RGB")
    except ImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        reason = "not an image format PIL can read" if isinstance(exc, UnidentifiedImageError) else str(exc)
        raise ImageError(f"{what} could not be decoded: {reason}", param) from None


def load_image_file(path: str | Path, policy: ImagePolicy, param: str | None = None) -> Any:
    """A local image file (no directory check: the caller decided this path may be read)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ImageError(f"no image file at {p}", param)
    size = p.stat().st_size
    if size > policy.max_bytes:
        raise ImageError(f"image file {p} is {_mib(size)}; the limit is {_mib(policy.max_bytes)}", param)
    return decode_image(p.read_bytes(), policy, f"image file {p}", param)


def load_image_url(url: str, policy: ImagePolicy, param: str | None = None) -> Any:
    """The image an OpenAI `image_url.url` names: a data: URL, a local path / file:// URL under
    `policy.local_dir`, or an http(s) URL when `policy.allow_remote`."""
    url = url.strip()
    if url.startswith("data:"):
        return decode_image(_data_url_bytes(url, param), policy, "the data: URL's image", param)
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https"):
        if not policy.allow_remote:
            raise ImageError("remote image URLs are not fetched by this server (start `minisgl serve` with "
                             "--allow-remote-images to allow them); send the image inline as a "
                             "data:image/...;base64,... URL", param)
        return decode_image(_fetch(url, policy, param), policy, f"the image at {url}", param)
    if scheme == "file" or url.startswith(("/", "~", ".")) or scheme == "":
        path = unquote(urlparse(url).path) if scheme == "file" else url
        return load_image_file(_local_path(path, policy, param), policy, param)
    raise ImageError(f"unsupported image URL scheme {scheme!r}: use a data: URL (or http(s) / a local path where "
                     "the server allows them)", param)


def _data_url_bytes(url: str, param: str | None) -> bytes:
    """The payload of `data:[<mime>][;base64],<data>`; only base64 image payloads are images."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("malformed data: URL: no ',' before the payload", param)
    mime, *flags = head.removeprefix("data:").split(";")
    if mime and not mime.lower().startswith("image/"):
        raise ImageError(f"the data: URL holds {mime!r}, not an image", param)
    if "base64" not in (f.lower() for f in flags):
        raise ImageError("data: URL images must be base64 (data:image/png;base64,...)", param)
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: URL's base64 payload is not valid base64", param) from None


def _local_path(path: str, policy: ImagePolicy, param: str | None) -> Path:
    """The path, resolved (symlinks and '..' followed), if it lies under the allowed directory."""
    if policy.local_dir is None:
        raise ImageError("local image paths are not read by this server (start `minisgl serve` with "
                         "--allow-local-images DIR to allow paths under DIR); send the image inline as a "
                         "data:image/...;base64,... URL", param)
    root = policy.local_dir.expanduser().resolve()
    p = Path(path).expanduser()
    resolved = (p if p.is_absolute() else root / p).resolve()
    if not resolved.is_relative_to(root):
        raise ImageError(f"image path {path!r} is outside the allowed directory {root}", param)
    return resolved


def _fetch(url: str, policy: ImagePolicy, param: str | None) -> bytes:
    """GET url (3 redirects at most), never reading more than the byte cap."""
    import httpx

    try:
        with httpx.Client(follow_redirects=True, max_redirects=3, timeout=policy.timeout_s) as client:
            with client.stream("GET", url) as r:
                if r.status_code != 200:
                    raise ImageError(f"fetching {url} gave HTTP {r.status_code}", param)
                declared = int(r.headers.get("content-length") or 0)
                if declared > policy.max_bytes:
                    raise ImageError(f"the image at {url} is {_mib(declared)}; the limit is "
                                     f"{_mib(policy.max_bytes)}", param)
                body = bytearray()
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > policy.max_bytes:
                        raise ImageError(f"the image at {url} is larger than the limit of "
                                         f"{_mib(policy.max_bytes)}", param)
                return bytes(body)
    except httpx.HTTPError as exc:
        raise ImageError(f"could not fetch {url}: {type(exc).__name__}: {exc}", param) from None
