"""The media worker's device memory, known before it loads anything: its pipelines' weights plus the activations of
its largest call. `serve` asks the text engine on the same GPU to leave that free (engine/kv_budget.py).

Weights: a model dir's safetensors headers (each tensor's element count, at the dtype the pipeline loads in: bf16 on
CUDA), or a built-in config's parameter count (`--media-load-format dummy`; media/configs.py). FP8 halves the DiT.

Activations, measured on the meta device (every op's output counted while it is referenced, bf16, eager,
diffusers 0.42): the peak of an image call is its VAE decode, ~1.5 KiB an output pixel (1.5 GiB at 1024x1024 for the
FLUX VAE of Z-Image; the DiT's denoise step peaks at ~0.5 KiB a pixel), and a batch decodes in one call, so it
scales with the images. A video's peak is also its VAE decode: Wan's decodes frame by frame with a cache, 4.4 GiB at
832x480 whether 33 or 81 frames (~11 KiB a frame pixel; the DiT's step, 1.5 GiB at 81 frames, is less). The largest
call sized for is `--media-max-batch` rows (the worker's batches) of the job's default size: what a server busy with
default requests runs. A larger job (n past the batch cap, a larger size) may still run out of memory: its 503 says
so and the worker takes the next job. A quarter more covers the caching allocator's fragmentation, and 2 GiB the
worker's CUDA context, the cuBLAS / cuDNN workspaces and torch.compile's autotuning. An image pipeline whose DiT blocks
are graphed (media/pipelines.py's block_stacks; media/graphs.py) holds a denoise step's activations once more in the
graphs' pool, plus each captured shape's input and output buffers (~64 B a pixel for Z-Image: the 3,840-wide rows of
one token per 16x16 pixels, in and out, bf16), sized as GRAPH_BYTES_PER_PIXEL a row and pixel.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from minisgl_cli.device import DeviceError, pick_device
from minisgl_cli.engine.config import KeepFree
from minisgl_cli.media.jobs import ImageJob, Kind, ModelSpec, VideoJob, job_defaults
from minisgl_cli.media.pipelines import block_stacks, denoiser_class
from minisgl_cli.media.settings import MediaSettings

KINDS: tuple[Kind, ...] = ("image", "video")
BYTES_PER_PIXEL: dict[Kind, int] = {"image": 1536, "video": 11 * 1024}  # a call's peak, per row and output pixel
GRAPH_BYTES_PER_PIXEL: dict[Kind, int] = {"image": 1024, "video": 0}  # the graphs' pool and buffers (no video graphs)
ALLOCATOR_MARGIN = 1.25
WORKER_OVERHEAD = 2 << 30
GIB = 1 << 30
REMEDY = ("serve a smaller text or media model, lower --media-max-batch, or size the KV pool with --mem-fraction or "
          "--max-total-tokens (media jobs may then run out of memory)")
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class MediaMemory:
    """What the media worker takes on its device: each pipeline's weights (by built-in name or dir name), and the
    activations of its largest call plus its own overhead (the worker runs one call at a time)."""

    weights: dict[str, int]
    activations: int
    largest_call: str  # what the activations are sized for, e.g. "4 images of 1024x1024"

    @property
    def total(self) -> int:
        return sum(self.weights.values()) + self.activations

    def describe(self) -> str:
        weights = " + ".join(f"{name} {n / GIB:.1f}" for name, n in self.weights.items())
        return f"{weights} GiB of weights + {self.activations / GIB:.1f} GiB for a batch of {self.largest_call}"


def estimate(settings: MediaSettings, kinds: Iterable[Kind], itemsize: int = 2) -> MediaMemory:
    """The device memory of the media worker serving `kinds` under `settings`, its weights held at `itemsize`
    bytes a parameter (2: bf16, the dtype on CUDA)."""
    weights, calls = {}, []
    for kind in kinds:
        spec = settings.spec(kind)
        weights[spec.model if spec.load_format == "dummy" else spec.model_dir.name] = _weights(spec, itemsize)
        defaults = job_defaults(ImageJob if kind == "image" else VideoJob)
        width, height = defaults["width"], defaults["height"]
        graphed = block_stacks(spec, "cuda", denoiser_class(spec))
        per_pixel = BYTES_PER_PIXEL[kind] + (GRAPH_BYTES_PER_PIXEL[kind] if graphed else 0)
        nbytes = settings.max_batch * width * height * per_pixel * ALLOCATOR_MARGIN
        calls.append((int(nbytes), f"{settings.max_batch} {kind}s of {width}x{height}"))
    nbytes, largest = max(calls, default=(0, "nothing"))
    return MediaMemory(weights, nbytes + WORKER_OVERHEAD, largest)


def keep_free(settings: MediaSettings, engine_device: str) -> KeepFree | None:
    """What a text engine on `engine_device` (its type is enough: the engine compares indices) leaves free for the
    media worker: None unless both run on CUDA and the worker has a pipeline it can load."""
    if not engine_device.startswith("cuda"):
        return None
    try:
        device = pick_device(settings.device)
    except DeviceError:  # the worker says so on its first job
        return None
    kinds = loadable(settings)
    if not (device.startswith("cuda") and kinds):
        return None
    media = estimate(settings, kinds)
    return KeepFree(device, media.total, f"the media worker ({media.describe()})", REMEDY)


def loadable(settings: MediaSettings) -> list[Kind]:
    """The kinds whose pipeline the worker would load for a request: a built-in config of that kind (dummy), or a
    pipeline dir on disk (a download is never started for a request)."""
    from minisgl_cli.media.configs import PIPELINES

    def found(spec: ModelSpec) -> bool:
        if spec.load_format == "dummy":
            return PIPELINES.get(spec.model, ("",))[0] == spec.kind
        return (spec.model_dir / "model_index.json").is_file()

    return [kind for kind in KINDS if found(settings.spec(kind))]


def _weights(spec: ModelSpec, itemsize: int) -> int:
    """Bytes of the pipeline's weights on the device, by component (the DiT at one byte a parameter under FP8)."""
    if spec.load_format == "dummy":
        from minisgl_cli.media.configs import parameter_counts

        parts = {part: n * itemsize for part, n in parameter_counts(spec.model).items()}
    else:
        parts = _dir_weights(spec.model_dir, itemsize)
    if spec.quantization == "fp8":
        parts = {part: n // 2 if part in ("transformer", "unet") else n for part, n in parts.items()}
    return sum(parts.values())


def _dir_weights(model_dir: Path, itemsize: int) -> dict[str, int]:
    """Bytes by component dir of a diffusers pipeline dir: its safetensors' tensors, floating ones at `itemsize`;
    a component with no safetensors by the size of its other weight files."""
    parts: dict[str, int] = {}
    for path in sorted(model_dir.rglob("*.safetensors")):
        part = path.relative_to(model_dir).parts[0]
        try:
            nbytes = _safetensors_bytes(path, itemsize)
        except (OSError, ValueError, KeyError, TypeError, struct.error):  # unreadable: the worker's load will say so
            nbytes = path.stat().st_size
        parts[part] = parts.get(part, 0) + nbytes
    for pattern in ("*.bin", "*.pt", "*.pth"):
        for path in model_dir.rglob(pattern):
            part = path.relative_to(model_dir).parts[0]
            if not any(path.parent.glob("*.safetensors")):
                parts[part] = parts.get(part, 0) + path.stat().st_size
    return parts


def _safetensors_bytes(path: Path, itemsize: int) -> int:
    """A safetensors file's tensors in bytes, read from its header alone (floating tensors at `itemsize`)."""
    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    total = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry["dtype"]
        size = itemsize if dtype in ("F64", "F32", "F16", "BF16") else _ITEMSIZE.get(dtype, 1)
        total += math.prod(entry["shape"]) * size
    return total
