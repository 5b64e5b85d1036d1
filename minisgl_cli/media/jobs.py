"""Typed media jobs and results (what a front asks a pipeline for, what comes back); torch-free."""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

DEFAULT_IMAGE_MODEL = "Tongyi-MAI/Z-Image-Turbo"
DEFAULT_VIDEO_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
CACHE_ROOT = Path("~/.cache/mini-sglang")
DEFAULT_IMAGE_MODEL_DIR = CACHE_ROOT / "z-image-turbo"

DEFAULT_IMAGE_PROMPT = (
    "A young woman in flowing red and gold Hanfu stands in a misty bamboo courtyard at dawn, "
    "intricate embroidery, hairpins of jade, soft rim light, shallow depth of field, photorealistic portrait"
)

# Sizes near one megapixel; every side is a multiple of 16 (VAE stride 8 x patch 2).
ASPECTS: dict[str, tuple[int, int]] = {  # aspect -> (width, height)
    "1:1": (1024, 1024),
    "16:9": (1344, 768),
    "9:16": (768, 1344),
    "4:3": (1152, 864),
    "3:4": (864, 1152),
}
SIZE_MULTIPLE = 16
MAX_SIDE = 4096
# Checked before tokenizing: the pipelines read at most 512 tokens, and no token of theirs is 64 bytes long.
MAX_PROMPT_BYTES = 32 * 1024

Kind = Literal["image", "video"]


class MediaError(Exception):
    """A media request that cannot be served; `param` names the offending input (OpenAI style)."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_value"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def first_line(exc: Exception, limit: int = 120) -> str:
    """An exception's message cut to one line ("" when it has none): library errors run to paragraphs."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


class Cancelled(Exception):
    """Raised from a step hook to end the pipeline call there (every job of the batch was dropped, or a stop)."""


class ModelNotFoundError(MediaError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


def check_size(width: int, height: int, param: str = "size") -> tuple[int, int]:
    for name, v in (("width", width), ("height", height)):
        if not (SIZE_MULTIPLE <= v <= MAX_SIDE) or v % SIZE_MULTIPLE:
            raise MediaError(
                f"{name} must be a multiple of {SIZE_MULTIPLE} between {SIZE_MULTIPLE} and {MAX_SIDE}, got {v}", param
            )
    return width, height


def resolve_size(aspect: str | None, width: int | None, height: int | None) -> tuple[int, int]:
    """Explicit --width/--height win; a missing side is derived from the aspect ratio."""
    if aspect is not None and aspect not in ASPECTS:
        raise MediaError(f"unknown aspect {aspect!r}: use one of {', '.join(ASPECTS)}", "aspect")
    aw, ah = ASPECTS[aspect or "1:1"]
    if width is None:
        if height is None:
            width, height = aw, ah
        else:
            width = round(height * aw / ah / SIZE_MULTIPLE) * SIZE_MULTIPLE
    elif height is None:
        height = round(width * ah / aw / SIZE_MULTIPLE) * SIZE_MULTIPLE
    return check_size(width, height, "width/height")


def parse_size(size: str) -> tuple[int, int]:
    """OpenAI "WxH" -> (width, height)."""
    try:
        w, h = (int(p) for p in size.lower().split("x"))
    except ValueError:
        raise MediaError(f"size must look like '1024x1024' (WIDTHxHEIGHT), got {size!r}", "size") from None
    return check_size(w, h)


def resolve_seed(seed: int | None) -> int:
    """A concrete seed for every job, so any result can be reproduced from what it reports."""
    if seed is None:
        return random.randrange(2**31)
    if not 0 <= seed < 2**63:
        raise MediaError(f"seed must be in [0, 2**63), got {seed}", "seed")
    return seed


@dataclass(frozen=True)
class ModelSpec:
    """Which pipeline to load and how. `model` is a hub repo id or a local dir; `model_dir` is
    where its weights live (downloaded there on first use when `allow_download`)."""

    kind: Kind
    model: str
    model_dir: Path
    device: str | None = None  # None/"auto": mps -> cuda -> cpu
    cpu_offload: bool = False
    compile: bool | None = None  # None: on for CUDA (regional compile of the DiT's blocks), off on CPU / MPS
    attention_backend: str = "auto"  # media/pipelines.py ATTENTION_BACKENDS
    allow_download: bool = True
    quantization: str | None = None  # "fp8": the DiT's linear weights in FP8 e4m3 (CUDA)
    media_cache: str | None = None  # cache-dit's step cache (approximate, opt-in): media/step_cache.py's MODE[:k=v,..]
    load_format: str = "auto"  # "dummy": `model` names a built-in config, built with random weights (speed work)
    # One job over several devices (media/parallel.py): "cfg" or "ulysses" ("auto" is resolved before), on this many
    # ranks; None: one device.
    media_parallel: str | None = None
    media_parallel_size: int = 2
    cuda_graphs: bool = True  # CUDA graphs of the short passes on CUDA (media/graphs.py); False: --disable-cuda-graph

    @classmethod
    def create(cls, kind: Kind, model: str | None, model_dir: str | os.PathLike | None, **kw: Any) -> ModelSpec:
        default_model = DEFAULT_IMAGE_MODEL if kind == "image" else DEFAULT_VIDEO_MODEL
        model = model or default_model
        if model_dir is None:
            if Path(model).expanduser().is_dir():
                model_dir = Path(model)
            elif model == DEFAULT_IMAGE_MODEL:
                model_dir = DEFAULT_IMAGE_MODEL_DIR
            else:  # one cache dir per repo, so a non-default --model never reuses the Z-Image dir
                model_dir = CACHE_ROOT / model.rstrip("/").split("/")[-1].lower()
        return cls(kind=kind, model=model, model_dir=Path(model_dir).expanduser(), **kw)


def _check_range(what: str, value: int, lo: int, hi: int, param: str) -> None:
    if not lo <= value <= hi:
        raise MediaError(f"{what} must be in [{lo}, {hi}], got {value}", param)


def _check_common(prompt: str, width: int, height: int, steps: int, guidance_scale: float) -> None:
    """The checks every generation job shares: a prompt, a valid size, steps, guidance."""
    if not prompt or not prompt.strip():
        raise MediaError("prompt must not be empty", "prompt")
    if len(prompt.encode()) > MAX_PROMPT_BYTES:
        raise MediaError(f"prompt is {len(prompt.encode())} bytes; the limit is {MAX_PROMPT_BYTES}", "prompt")
    check_size(width, height)
    _check_range("steps", steps, 1, 1000, "steps")
    if guidance_scale < 0:
        raise MediaError("guidance_scale must be >= 0", "guidance_scale")


@dataclass
class ImageJob:
    prompt: str
    width: int = 1024
    height: int = 1024
    steps: int = 9  # Z-Image-Turbo is distilled to 8 NFEs
    guidance_scale: float = 0.0  # Turbo runs without CFG
    num_images: int = 1
    seed: int | None = None
    negative_prompt: str | None = None

    def __post_init__(self) -> None:
        _check_common(self.prompt, self.width, self.height, self.steps, self.guidance_scale)
        _check_range("the number of images", self.num_images, 1, 16, "n")
        self.seed = resolve_seed(self.seed)


@dataclass
class VideoJob:
    prompt: str
    width: int = 832
    height: int = 480
    num_frames: int = 33
    fps: int = 16
    steps: int = 30
    guidance_scale: float = 5.0
    seed: int | None = None
    negative_prompt: str | None = None

    def __post_init__(self) -> None:
        _check_common(self.prompt, self.width, self.height, self.steps, self.guidance_scale)
        _check_range("num_frames", self.num_frames, 1, 1024, "num_frames")
        _check_range("fps", self.fps, 1, 120, "fps")
        self.seed = resolve_seed(self.seed)


def job_defaults(job: type[ImageJob] | type[VideoJob]) -> dict[str, Any]:
    """A job's defaults by field name: where the HTTP request models (server/media.py) take theirs from."""
    return {f.name: f.default for f in dataclasses.fields(job) if f.default is not dataclasses.MISSING}


@dataclass
class ImageResult:
    images: list[Any]  # PIL.Image.Image, RGB
    seed: int
    elapsed_s: float
    model_dir: Path


@dataclass
class VideoResult:
    frames: list[Any]  # numpy uint8 arrays, H x W x 3
    fps: int
    seed: int
    elapsed_s: float
    model_dir: Path
