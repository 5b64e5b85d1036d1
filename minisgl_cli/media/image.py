"""Text-to-image: an ImageJob through a loaded diffusers pipeline (Z-Image or any other)."""

from __future__ import annotations

import time
from pathlib import Path

from minisgl_cli.media.batch import generate
from minisgl_cli.media.encode import unique_path
from minisgl_cli.media.jobs import ImageJob, ImageResult
from minisgl_cli.media.pipelines import LoadedPipeline, StepHook


def generate_images(loaded: LoadedPipeline, job: ImageJob, on_step: StepHook | None = None) -> ImageResult:
    """One job as one call (media/batch.py: image i from the seed `seed + i`)."""
    return generate(loaded, [job], on_step)[0]


def save_images(result: ImageResult, output_dir: str | Path, stem: str = "image") -> list[Path]:
    """PNG files named <stem>_<time>_s<seed>_<i>.png in output_dir."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = []
    for i, image in enumerate(result.images):
        path = unique_path(output_dir, f"{stem}_{stamp}_s{result.seed}_{i}", ".png")
        image.save(path)
        paths.append(path)
    return paths
