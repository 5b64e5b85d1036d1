"""What a loaded pipeline can make (largest sides, frame counts), read from its configs; jobs checked or fitted to it.

A DiT's rotary table has a fixed number of positions per axis, so a size past it fails deep in the model
(an IndexError in Z-Image, a shape error in Wan). These checks turn that into a one-line MediaError up front.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, TypeVar

from minisgl_cli.media.jobs import SIZE_MULTIPLE, ImageJob, MediaError, VideoJob

Job = TypeVar("Job", ImageJob, VideoJob)


@dataclass(frozen=True)
class Limits:
    """None where the configs do not say (an unknown pipeline): no limit is checked then."""

    max_width: int | None = None
    max_height: int | None = None
    frame_stride: int | None = None  # num_frames must be frame_stride * k + 1 (a temporal VAE)
    max_frames: int | None = None
    max_prompt_tokens: int | None = None  # past it the caption's positions would overflow the rotary table
    why: str = ""  # where the size limit comes from, for the error message


def _config(module: Any) -> dict[str, Any]:
    return dict(getattr(module, "config", None) or {})


def caption_tokens(transformer_config: dict[str, Any]) -> int | None:
    """The longest caption a DiT's rotary table holds; None where its config names no such limit. Z-Image: the
    caption, padded to 32 tokens, comes first on axis 0 of `axes_lens`, the image after it."""
    axes: list[Any] = list(transformer_config.get("axes_lens") or ())
    return (int(axes[0]) - 2) // 32 * 32 if len(axes) == 3 else None


def pipeline_limits(pipe: Any) -> Limits:
    denoiser = getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)
    cfg = _config(denoiser)
    spatial = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None)
    temporal = getattr(pipe, "vae_scale_factor_temporal", None)
    patch = cfg.get("patch_size") or cfg.get("all_patch_size")
    if isinstance(patch, int):
        pt, ph, pw = 1, patch, patch
    elif isinstance(patch, (list, tuple)) and len(patch) == 3:
        pt, ph, pw = patch
    elif isinstance(patch, (list, tuple)) and len(patch) >= 1:  # Z-Image: one (square) patch size per entry
        pt, ph, pw = 1, patch[0], patch[0]
    else:
        pt = ph = pw = 1
    if "rope_max_seq_len" in cfg:  # Wan: one table length for every axis
        pos_t = pos_h = pos_w = int(cfg["rope_max_seq_len"])
        table = f"rope_max_seq_len {pos_h}"
    elif len(cfg.get("axes_lens") or ()) == 3:  # Z-Image: (caption/frame, height, width)
        pos_t, pos_h, pos_w = (int(n) for n in cfg["axes_lens"])
        table = f"axes_lens {pos_h}x{pos_w}"
    else:
        return Limits(frame_stride=temporal)
    if not spatial:
        return Limits(frame_stride=temporal)
    max_frames, max_prompt = None, caption_tokens(cfg)
    if temporal:  # latent frames (n - 1) / stride + 1, each patched by pt, must fit the table
        max_frames = (pos_t * pt - 1) * temporal + 1
    return Limits(
        max_width=pos_w * pw * spatial, max_height=pos_h * ph * spatial, frame_stride=temporal, max_frames=max_frames,
        max_prompt_tokens=max_prompt,
        why=f"{table} x patch {ph} x VAE {spatial}",
    )


def prompt_kwargs(pipe: Any) -> dict[str, Any]:
    """`max_sequence_length` lowered to what the rotary table holds, where the pipeline's own default is more
    (the pipeline truncates a longer prompt there, as it does at its default)."""
    lim = pipeline_limits(pipe)
    param = inspect.signature(pipe.__call__).parameters.get("max_sequence_length")
    if lim.max_prompt_tokens is None or param is None or not isinstance(param.default, int):
        return {}
    return {"max_sequence_length": lim.max_prompt_tokens} if lim.max_prompt_tokens < param.default else {}


def fit_size(limits: Limits, width: int, height: int) -> tuple[int, int]:
    """The largest size of this aspect within the limits, sides rounded down to SIZE_MULTIPLE."""
    scale = min(1.0, (limits.max_width or width) / width, (limits.max_height or height) / height)
    if scale == 1.0:
        return width, height
    snap = lambda v: max(SIZE_MULTIPLE, int(v * scale) // SIZE_MULTIPLE * SIZE_MULTIPLE)  # noqa: E731
    return snap(width), snap(height)


def fit_frames(limits: Limits, num_frames: int) -> int:
    """The longest valid frame count up to num_frames."""
    n = min(num_frames, limits.max_frames or num_frames)
    if limits.frame_stride:
        n = (n - 1) // limits.frame_stride * limits.frame_stride + 1
    return n


def check_job(pipe: Any, job: ImageJob | VideoJob) -> None:
    """A MediaError when the job asks for more than the pipeline can make (instead of a traceback inside it)."""
    lim = pipeline_limits(pipe)
    name = type(pipe).__name__
    if (lim.max_width and job.width > lim.max_width) or (lim.max_height and job.height > lim.max_height):
        raise MediaError(
            f"{job.width}x{job.height} is too large for this {name}: at most {lim.max_width}x{lim.max_height} "
            f"({lim.why})", "size",
        )
    if isinstance(job, VideoJob):
        stride = lim.frame_stride
        if stride and job.num_frames % stride != 1 % stride:
            below = (job.num_frames - 1) // stride * stride + 1
            raise MediaError(
                f"num_frames must be {stride}k+1 for {name} (e.g. {below} or {below + stride}), got {job.num_frames}",
                "num_frames",
            )
        if lim.max_frames and job.num_frames > lim.max_frames:
            raise MediaError(f"num_frames {job.num_frames} is too many for this {name}: at most {lim.max_frames}",
                             "num_frames")


def fit_defaults(pipe: Any, job: Job, size: bool, frames: bool = False) -> tuple[Job, str | None]:
    """The job with the sides (`size`) and frame count (`frames`) the user left at their defaults shrunk to what
    the pipeline can make; a note saying so, or None when nothing changed. Explicit values are left to check_job."""
    lim = pipeline_limits(pipe)
    w, h = fit_size(lim, job.width, job.height) if size else (job.width, job.height)
    changes: dict[str, Any] = {}
    if (w, h) != (job.width, job.height):
        changes.update(width=w, height=h)
    if frames and isinstance(job, VideoJob) and (n := fit_frames(lim, job.num_frames)) != job.num_frames:
        changes["num_frames"] = n
    if not changes:
        return job, None
    fitted = dataclasses.replace(job, **changes)
    was = f"{job.width}x{job.height}" + (f"x{job.num_frames}" if isinstance(job, VideoJob) else "")
    now = f"{fitted.width}x{fitted.height}" + (f"x{fitted.num_frames}" if isinstance(fitted, VideoJob) else "")
    return fitted, f"the default {was} is more than this {type(pipe).__name__} can make ({lim.why}): using {now}"
