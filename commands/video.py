"""`minisgl video`: text-to-video with a diffusers pipeline (Wan, LTX, CogVideoX...), saved as mp4 or PNG frames."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from commands import common as c
from minisgl_cli.media.jobs import DEFAULT_VIDEO_MODEL

MODEL, MODEL_DIR = c.pipeline_options("MINISGL_VIDEO_MODEL", "MINISGL_VIDEO_MODEL_DIR",
                                      "~/.cache/mini-sglang/<repo name>")
COMPILE, ATTENTION, QUANTIZATION, MEDIA_CACHE, LOAD_FORMAT, NO_GRAPHS = c.media_speed_options()
PARALLEL, PARALLEL_SIZE = c.media_parallel_options()

app = typer.Typer()
setup = c.in_panel(c.MODEL_PANEL)  # the model and how it runs


class VideoFormat(str, Enum):
    mp4 = "mp4"
    frames = "frames"


@app.command("video", cls=c.Command, help="Generate a short video from a prompt with a diffusers text-to-video model.")
def video(
    prompt: Annotated[str, typer.Option("-p", "--prompt", help="What happens in the clip.")],
    num_frames: Annotated[Optional[int], typer.Option(
        help="Frames to generate (Wan: 4k+1).", show_default="33, fewer if the model's limit is lower")] = None,
    fps: Annotated[int, typer.Option(help="Frames per second of the mp4.")] = 16,
    height: Annotated[Optional[int], typer.Option(
        help="Height in pixels, a multiple of 16.", show_default="480, less if the model's limit is lower")] = None,
    width: Annotated[Optional[int], typer.Option(
        help="Width in pixels, a multiple of 16.", show_default="832, less if the model's limit is lower")] = None,
    steps: Annotated[int, typer.Option(help="Denoising steps.")] = 30,
    guidance_scale: Annotated[float, typer.Option(help="CFG scale.")] = 5.0,
    seed: Annotated[Optional[int], typer.Option(help="Seed; same seed, same frames. Random if unset.")] = None,
    negative_prompt: Annotated[Optional[str], typer.Option(help="What to avoid (used when CFG is on).")] = None,
    format: Annotated[VideoFormat, typer.Option(
        "--format", metavar="<str>", help="mp4 (a file) or frames (a dir of PNGs).")] = VideoFormat.mp4,
    model: Annotated[str, MODEL] = DEFAULT_VIDEO_MODEL,
    model_dir: Annotated[Optional[Path], MODEL_DIR] = None,
    device: Annotated[
        str, setup(envvar="MINISGL_DEVICE", help="auto (mps, cuda, cpu), mps, cuda[:N], cpu.")
    ] = "auto",
    output_dir: Annotated[Path, typer.Option(envvar="MINISGL_OUTPUT_DIR", help="Where videos go.")] = Path("outputs"),
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
    import time

    from minisgl_cli.media import console
    from minisgl_cli.media.encode import unique_path, write_frames, write_mp4
    from minisgl_cli.media.jobs import ModelSpec, VideoJob, job_defaults
    from minisgl_cli.media.limits import fit_defaults
    from minisgl_cli.media.video import generate_video

    console.quiet_libraries()
    default = job_defaults(VideoJob)
    with console.cli_errors():
        given = lambda value, name: default[name] if value is None else value  # noqa: E731
        job = VideoJob(prompt, given(width, "width"), given(height, "height"), given(num_frames, "num_frames"),
                       fps, steps, guidance_scale, seed, negative_prompt)  # checked before loading
        console.writable_dir(output_dir)
        spec = ModelSpec.create("video", model, model_dir, device=device, cpu_offload=cpu_offload,
                                **c.speed_options(compile, attention_backend, quantization, media_cache, load_format,
                                                  disable_cuda_graph),
                                **c.media_parallel(media_parallel, media_parallel_size, guidance_scale))
        loaded = console.load_with_status(spec)
        job, note = fit_defaults(loaded.pipe, job, size=width is None and height is None, frames=num_frames is None)
        if note:
            typer.echo(f"note: {note}", err=True)
        what = f"{job.width}x{job.height}x{job.num_frames}"
        result, clock = console.run_with_progress(loaded, job, generate_video, what)
        stem = f"video_{time.strftime('%Y%m%d-%H%M%S')}_s{result.seed}"
        if format is VideoFormat.mp4:
            out = write_mp4(result.frames, result.fps, unique_path(output_dir, stem, ".mp4"))
        else:
            out = unique_path(output_dir, stem + "_frames")
            write_frames(result.frames, out)
    typer.echo(console.summary(what, console.where(loaded), job.steps, result.elapsed_s, clock, result.seed), err=True)
    typer.echo(str(out))
