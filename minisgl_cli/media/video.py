"""Text-to-video: a VideoJob through a loaded diffusers video pipeline (Wan, LTX, CogVideoX...)."""

from __future__ import annotations

from typing import Any

from minisgl_cli.media.jobs import VideoJob, VideoResult
from minisgl_cli.media.limits import check_job
from minisgl_cli.media.pipelines import LoadedPipeline, StepCallback


def _to_uint8_frames(video: Any) -> list[Any]:
    """One video from a pipeline's `.frames[0]`: float array in [0, 1], uint8 array, or PIL list."""
    import numpy as np

    if isinstance(video, (list, tuple)) and video and not isinstance(video[0], np.ndarray):
        return [np.asarray(f.convert("RGB")) for f in video]  # PIL images
    arr = np.asarray(video)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
    return list(arr)


def generate_video(loaded: LoadedPipeline, job: VideoJob, on_step: StepCallback | None = None) -> VideoResult:
    check_job(loaded.pipe, job)
    out, seed, elapsed_s = loaded.generate(job, {"num_frames": job.num_frames, "output_type": "np"}, on_step)
    return VideoResult(_to_uint8_frames(out.frames[0]), job.fps, seed, elapsed_s, loaded.model_dir)
