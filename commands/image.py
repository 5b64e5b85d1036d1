"""`minisgl image`: text-to-image with Z-Image-Turbo (or any diffusers pipeline), saved as PNGs."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from commands import common as c
from minisgl_cli.media.jobs import DEFAULT_IMAGE_MODEL, DEFAULT_IMAGE_MODEL_DIR, DEFAULT_IMAGE_PROMPT

app = typer.Typer()
setup = c.in_panel(c.MODEL_PANEL)  # the model and how it runs
MODEL, MODEL_DIR = c.pipeline_options("MINISGL_IMAGE_MODEL", "Z_IMAGE_MODEL_DIR",
                                      f"{DEFAULT_IMAGE_MODEL_DIR} for the default --model")
COMPILE, ATTENTION, QUANTIZATION, MEDIA_CACHE, LOAD_FORMAT, NO_GRAPHS = c.media_speed_options()
PARALLEL, PARALLEL_SIZE = c.media_parallel_options()


class Aspect(str, Enum):
    square = "1:1"
    wide = "16:9"
    tall = "9:16"
    landscape = "4:3"
    portrait = "3:4"


@app.command("image", cls=c.Command,
             help="Generate images from a prompt with Z-Image-Turbo or any diffusers text-to-image model.")
def image(
    prompt: Annotated[
        str, typer.Option("-p", "--prompt", help="What to draw.", show_default="a Hanfu portrait")
    ] = DEFAULT_IMAGE_PROMPT,
    aspect: Annotated[
        Aspect, typer.Option(metavar="<ratio>", help="1:1, 16:9, 9:16, 4:3 or 3:4 (about 1 MP).")
    ] = Aspect.square,
    height: Annotated[Optional[int], typer.Option(help="Height in pixels, a multiple of 16.")] = None,
    width: Annotated[Optional[int], typer.Option(help="Width in pixels, a multiple of 16.")] = None,
    steps: Annotated[int, typer.Option(help="Denoising steps (Turbo: 9).")] = 9,
    guidance_scale: Annotated[float, typer.Option(help="CFG scale; 0 disables it (Turbo).")] = 0.0,
    num_images: Annotated[int, typer.Option("-n", "--num-images", help="Images per prompt, made in one batch.")] = 1,
    seed: Annotated[Optional[int], typer.Option(help="Seed; same seed, same pixels. Random if unset.")] = None,
    negative_prompt: Annotated[Optional[str], typer.Option(help="What to avoid (used when CFG is on).")] = None,
    device: Annotated[
        str, setup(envvar="MINISGL_DEVICE", help="auto (mps, cuda, cpu), mps, cuda[:N], cpu.")
    ] = "auto",
    model: Annotated[str, MODEL] = DEFAULT_IMAGE_MODEL,
    model_dir: Annotated[Optional[Path], MODEL_DIR] = None,
    output_dir: Annotated[Path, typer.Option(envvar="MINISGL_OUTPUT_DIR", help="Where PNGs go.")] = Path("outputs"),
    cpu_offload: Annotated[bool, setup(
        "--cpu-offload", help="Keep idle sub-models on the CPU (CUDA only).")] = False,
    compile: Annotated[Optional[bool], COMPILE] = None,
    attention_backend: Annotated[c.MediaAttention, ATTENTION] = c.MediaAttention.auto,
    quantization: Annotated[c.MediaQuantization, QUANTIZATION] = c.MediaQuantization.none,
    media_cache: Annotated[Optional[str], MEDIA_CACHE] = None,
    load_format: Annotated[c.MediaLoadFormat, LOAD_FORMAT] = c.MediaLoadFormat.auto,
    disable_cuda_graph: Annotated[bool, NO_GRAPHS] = False,
    media_parallel: Annotated[Optional[c.MediaParallel], PARALLEL] = None,
    media_parallel_size: Annotated[int, PARALLEL_SIZE] = 2,
) -> None:
    from minisgl_cli.media import console
    from minisgl_cli.media.image import generate_images, save_images
    from minisgl_cli.media.jobs import ImageJob, ModelSpec, resolve_size
    from minisgl_cli.media.limits import fit_defaults

    console.quiet_libraries()
    with console.cli_errors():
        w, h = resolve_size(aspect.value, width, height)
        job = ImageJob(prompt, w, h, steps, guidance_scale, num_images, seed, negative_prompt)  # checked before loading
        console.writable_dir(output_dir)
        spec = ModelSpec.create("image", model, model_dir, device=device, cpu_offload=cpu_offload,
                                **c.speed_options(compile, attention_backend, quantization, media_cache, load_format,
                                                  disable_cuda_graph),
                                **c.media_parallel(media_parallel, media_parallel_size, guidance_scale))
        loaded = console.load_with_status(spec)
        job, note = fit_defaults(loaded.pipe, job, size=width is None and height is None)
        if note:
            typer.echo(f"note: {note}", err=True)
        what = f"{job.width}x{job.height}" + (f" x{job.num_images}" if job.num_images > 1 else "")
        result, clock = console.run_with_progress(loaded, job, generate_images, what)
        paths = save_images(result, output_dir, "image")
    typer.echo(console.summary(what, console.where(loaded), job.steps, result.elapsed_s, clock, result.seed,
                               per=(job.num_images, "an image")), err=True)
    for path in paths:
        typer.echo(str(path))
