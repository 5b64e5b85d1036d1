"""Terminal side of the media commands: quiet library logs, a rich step progress bar, one-line errors."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import typer

from minisgl_cli.device import DeviceError
from minisgl_cli.media.jobs import ImageJob, MediaError, ModelSpec, VideoJob
from minisgl_cli.media.pipelines import LoadedPipeline, StepCallback, load_pipeline

Job = TypeVar("Job", ImageJob, VideoJob)
R = TypeVar("R")


def quiet_libraries() -> None:
    """Our own bar and messages replace diffusers/transformers' tqdm bars and info logs."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from diffusers.utils import logging as dlog
    from huggingface_hub.utils import logging as hlog
    from transformers.utils import logging as tlog

    for log in (dlog, tlog):
        log.set_verbosity_error()
        log.disable_progress_bar()
    hlog.set_verbosity_error()  # its retry warnings would add lines to the one-line error


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Bad input or a missing model: one line on stderr and exit 1, no traceback."""
    try:
        yield
    except (MediaError, DeviceError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(1) from None


@contextlib.contextmanager
def step_progress(total: int, label: str) -> Iterator[StepCallback]:
    """A rich progress bar on stderr, advanced by the pipeline's step-end callback."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as progress:
        task = progress.add_task(label, total=total)

        def on_step(done: int, steps: int) -> None:
            progress.update(task, completed=done, total=steps)

        yield on_step


def loading_status(what: str):
    from rich.console import Console

    return Console(stderr=True).status(f"loading {what}...")


def generate_with_progress(spec: ModelSpec, job: Job, generate: Callable[[LoadedPipeline, Job, StepCallback], R],
                           what: str) -> R:
    """Load the pipeline under a spinner, then run the job under a progress bar labelled "<what> on <device>"."""
    with loading_status(spec.model):
        loaded = load_pipeline(spec)
    with step_progress(job.steps, f"{what} on {loaded.device}") as on_step:
        return generate(loaded, job, on_step)
