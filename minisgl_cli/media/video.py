"""Text-to-video: a VideoJob through a loaded diffusers video pipeline (Wan, LTX, CogVideoX...)."""

from __future__ import annotations

from minisgl_cli.media.batch import generate
from minisgl_cli.media.jobs import VideoJob, VideoResult
from minisgl_cli.media.pipelines import LoadedPipeline, StepHook


def generate_video(loaded: LoadedPipeline, job: VideoJob, on_step: StepHook | None = None) -> VideoResult:
    """One job as one call (media/batch.py)."""
    return generate(loaded, [job], on_step)[0]
