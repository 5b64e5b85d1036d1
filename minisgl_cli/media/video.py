"""Text-to-video: a VideoJob through a loaded diffusers video pipeline (Wan, LTX, CogVideoX...)."""

from __future__ import annotations

import time
from typing import Any

from minisgl_cli.media.jobs import VideoJob, VideoResult
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
    import torch

    assert job.seed is not None  # VideoJob.__post_init__ resolved it
    generator = torch.Generator("cpu").manual_seed(job.seed)
    start = time.perf_counter()
    out = loaded.run(
        {
            "prompt": job.prompt,
            "negative_prompt": job.negative_prompt,
            "height": job.height,
            "width": job.width,
            "num_frames": job.num_frames,
            "num_inference_steps": job.steps,
            "guidance_scale": job.guidance_scale,
            "generator": generator,
            "output_type": "np",
        },
        job.steps,
        on_step,
    )
    frames = _to_uint8_frames(out.frames[0])
    return VideoResult(frames, job.fps, job.seed, time.perf_counter() - start, loaded.model_dir)
