"""Text-to-image: an ImageJob through a loaded diffusers pipeline (Z-Image or any other)."""

from __future__ import annotations

import time
from pathlib import Path

from minisgl_cli.media.encode import unique_path
from minisgl_cli.media.jobs import ImageJob, ImageResult
from minisgl_cli.media.limits import check_job, prompt_kwargs
from minisgl_cli.media.pipelines import LoadedPipeline, StepCallback


def generate_images(loaded: LoadedPipeline, job: ImageJob, on_step: StepCallback | None = None) -> ImageResult:
    check_job(loaded.pipe, job)
    kwargs = {"num_images_per_prompt": job.num_images, "output_type": "pil", **prompt_kwargs(loaded.pipe)}
    out, seed, elapsed_s = loaded.generate(job, kwargs, on_step)
    return ImageResult([im.convert("RGB") for im in out.images], seed, elapsed_s, loaded.model_dir)


def save_images(result: ImageResult, output_dir: str | Path, stem: str = "image") -> list[Path]:
    """PNG files named <stem>_<time>_s<seed>_<i>.png in output_dir."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    paths = []
    for i, image in enumerate(result.images):
        path = unique_path(output_dir, f"{stem}_{stamp}_s{result.seed}_{i}", ".png")
        image.save(path)
        paths.append(path)
    return paths
