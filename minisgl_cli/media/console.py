"""Terminal side of the media commands: quiet library logs, live step progress with it/s, one-line errors."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import typer

from minisgl_cli.device import DeviceError
from minisgl_cli.media.jobs import ImageJob, MediaError, ModelSpec, VideoJob
from minisgl_cli.media.pipelines import LoadedPipeline, StepHook
from minisgl_cli.media.pipelines import quiet_libraries as quiet_libraries  # the fronts call it from here

Job = TypeVar("Job", ImageJob, VideoJob)
R = TypeVar("R")


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Bad input, a missing model or an unwritable output dir: one line on stderr and exit 1, no traceback
    (Ctrl-C: exit 130)."""
    try:
        yield
    except (MediaError, DeviceError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
        raise typer.Exit(1) from None
    except OSError as exc:  # the output dir: not writable, not a dir, disk full
        where = f" {exc.filename}" if exc.filename else ""
        typer.echo(f"error: cannot write{where}: {exc.strerror or exc}", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # Ctrl-C mid-generation: the shell's usual status, no traceback
        typer.echo("interrupted", err=True)
        raise typer.Exit(130) from None
    finally:  # the other ranks of a --media-parallel run stop with us, whatever happened
        from minisgl_cli.media import ranks

        ranks.close()


def writable_dir(path: os.PathLike | str) -> None:
    """Fail before minutes of generation, not after: the output dir exists (made now) and takes files."""
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise OSError(13, "permission denied", path)


class StepClock:
    """When each denoising step ended, as the pipeline's step-end callback reports it."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.marks: list[float] = []
        self.listener: Callable[[int, int], None] | None = None  # the live bar, on a terminal

    def on_step(self, done: int, total: int, latents: Any = None) -> None:  # a StepHook; the latents unused
        self.marks.append(time.perf_counter())
        if self.listener is not None:
            self.listener(done, total)

    def s_per_step(self) -> float | None:
        """Mean step time between the first and last step's end: the denoiser alone, no text encoder or VAE."""
        if len(self.marks) >= 2:
            return (self.marks[-1] - self.marks[0]) / (len(self.marks) - 1)
        return self.marks[0] - self.start if self.marks else None


def _bar(total: int, label: str):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class StepsPerSecond(ProgressColumn):
        def render(self, task: Any) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:.2f} it/s" if speed else "-- it/s", style="progress.data.speed")

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), StepsPerSecond(),
        TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        console=Console(stderr=True), transient=True,  # the summary line replaces it
    )


@contextlib.contextmanager
def step_progress(total: int, label: str) -> Iterator[StepClock]:
    """Times the steps; on a terminal also a live bar (steps, it/s, elapsed, ETA). Off a terminal nothing is drawn,
    so a log gets only the summary line."""
    from rich.console import Console

    clock = StepClock()
    if not Console(stderr=True).is_terminal:
        yield clock
        return
    with _bar(total, label) as progress:
        task = progress.add_task(label, total=total)
        clock.listener = lambda done, steps: progress.update(task, completed=done, total=steps)
        yield clock


def load_with_status(spec: ModelSpec) -> LoadedPipeline:
    """Load the pipeline under a spinner (drawn on a terminal only)."""
    from rich.console import Console

    from minisgl_cli.media import ranks

    over = f" over {spec.media_parallel_size} ranks ({spec.media_parallel})" if spec.media_parallel else ""
    with Console(stderr=True).status(f"loading {spec.model}{over}..."):
        return ranks.load(spec)


def where(loaded: LoadedPipeline) -> str:
    """The device a job runs on, as its lines name it: "cuda", or "cuda x2 (cfg)" for a --media-parallel run."""
    spec = loaded.spec
    if spec.media_parallel is None:
        return loaded.device
    return f"{loaded.device} x{spec.media_parallel_size} ({spec.media_parallel})"


def run_with_progress(loaded: LoadedPipeline, job: Job, generate: Callable[[LoadedPipeline, Job, StepHook], R],
                      what: str) -> tuple[R, StepClock]:
    """Run the job with step progress labelled "<what> on <device>"; returns its result and the step times."""
    with step_progress(job.steps, f"{what} on {where(loaded)}") as clock:
        return generate(loaded, job, clock.on_step), clock


def summary(what: str, device: str, steps: int, elapsed_s: float, clock: StepClock, seed: int,
            per: tuple[int, str] | None = None) -> str:
    """The line a run ends with: "<what> on <device>: 9 steps in 1.46 s (0.146 s/step, 6.85 it/s), seed 42"."""
    s_step = clock.s_per_step()
    rate = f" ({s_step:.3f} s/step, {1 / s_step:.2f} it/s)" if s_step else ""
    each = f", {elapsed_s / per[0]:.2f} s {per[1]}" if per and per[0] > 1 else ""
    return f"{what} on {device}: {steps} step{'s' * (steps != 1)} in {elapsed_s:.2f} s{rate}{each}, seed {seed}"
