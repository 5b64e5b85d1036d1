"""Text-to-video: a VideoJob through a loaded diffusers video pipeline (Wan, LTX, CogVideoX...)."""

from __future__ import annotations

from minisgl_cli.media.batch import generate
from minisgl_cli.media.jobs import VideoJob, VideoResult
from minisgl_cli.media.pipelines import LoadedPipeline, StepCallback


def generate_video(loaded: LoadedPipeline, job: VideoJob, on_step: StepCallback | None = None) -> VideoResult:
    """One job as one call (media/batch.py)."""
    hook = None if on_step is None else (lambda done, total, latents: on_step(done, total))
    return generate(loaded, [job], hook)[0]
