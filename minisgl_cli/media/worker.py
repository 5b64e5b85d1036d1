"""The media worker process: owns the loaded pipelines, takes jobs oldest first, runs compatible ones as one
pipeline call (media/batch.py), and sends each job's events back; jobs are dropped between denoise steps.

It runs under the runtime's supervisor (a `Child`: it dies with its parent), at a lower CPU priority and with
bounded torch threads on a CPU, so the text engine beside it keeps answering. Each job gets exactly one end event
(`MediaResult` or `MediaFailed`): the client's queue and in-flight counts always come back to zero.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq

from minisgl_cli.media.batch import Cancelled, batch_key, generate, preview, rows, spans, warm_up
from minisgl_cli.media.jobs import ImageJob, ImageResult, MediaError, VideoJob, first_line
from minisgl_cli.media.pipelines import compiles
from minisgl_cli.media.prompts import PromptLimit
from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.messages import (
    FromMediaWorker,
    MediaCancel,
    MediaFailed,
    MediaPartial,
    MediaProgress,
    MediaResult,
    MediaSubmit,
)
from minisgl_cli.runtime.child import Child, leave
from minisgl_cli.runtime.ipc import Endpoints, pull, push, recv, send

log = logging.getLogger("minisgl.media")

NICE = 10  # below the text engine's processes: a chat reply stays fast while media runs on the same CPU
STOP_GRACE_S = 2.0  # after SIGTERM: the step in progress ends the call; past this the process just exits
# The warm-up (batch.warm_up) starts once the queue has been empty this long. Started at once, it met each request a
# client sent on the last one's answer inside a warm-up step (a batch of 3 at 1024^2: ~0.3 s on an H200), which then
# gave way and started again at the next idle moment: every request of a one-at-a-time client paid for a step.
WARM_UP_IDLE_S = 2.0


@dataclass
class WorkerStart:
    settings: MediaSettings
    endpoints: Endpoints
    log_level: int


@dataclass
class Pending:
    msg: MediaSubmit
    job: ImageJob | VideoJob
    prompt_tokens: int


def run_media_worker(start: WorkerStart) -> None:
    """The process's entry point."""
    child = Child("media worker", "media", start.log_level, start.endpoints.launcher)
    worker = child.start(partial(MediaWorker, start))
    child.ready()
    worker.serve()
    from minisgl_cli.media import ranks

    ranks.close()  # a --media-parallel group's other ranks (they die with this process anyway)
    leave(0)


def share_cpu() -> None:
    """A lower priority, and on a CPU half the cores for torch: the text engine's steps come first."""
    import torch

    os.nice(NICE)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                      else os.cpu_count() or 2) // 2))


def preview_steps(partial_images: int, steps: int) -> list[int]:
    """The steps after which a job's `partial_images` previews are decoded: spread evenly, the last before the end
    where the steps allow (fewer when there are fewer steps than previews)."""
    return sorted({max(1, math.ceil(steps * (j + 1) / (partial_images + 1))) for j in range(partial_images)})


class MediaWorker:
    def __init__(self, start: WorkerStart, ctx: zmq.Context):
        from minisgl_cli.media.console import quiet_libraries

        share_cpu()
        quiet_libraries()
        self.settings = start.settings
        self.inbox = pull(ctx, start.endpoints.media)
        self.out = push(ctx, start.endpoints.media_events)
        self._send_lock = threading.Lock()  # both threads send; a zmq socket is not thread-safe
        self.cond = threading.Condition()
        self.queue: collections.deque[Pending] = collections.deque()
        self.running: set[str] = set()
        self.cancelled: set[str] = set()
        self.stopping = False
        self.batches = 0
        self.warmed = False  # batched graphs compiled (or under way): see batch.warm_up
        self.warm_next: ImageJob | VideoJob | None = None
        self._limits: dict[str, PromptLimit] = {}
        signal.signal(signal.SIGTERM, self._on_sigterm)
        threading.Thread(target=self._receive, name="minisgl-media-recv", daemon=True).start()

    def _on_sigterm(self, *_: Any) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        threading.Timer(STOP_GRACE_S, leave).start()  # a load or a long step in progress: out anyway

    def emit(self, msg: FromMediaWorker) -> None:
        with self._send_lock:
            send(self.out, msg)

    # --- the receiving thread ------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            msg = recv(self.inbox)
            if isinstance(msg, MediaSubmit):
                self._admit(msg)
            elif isinstance(msg, MediaCancel):
                self._cancel(msg.jid)

    def _admit(self, msg: MediaSubmit) -> None:
        """Queue a job, or refuse it now: a prompt longer than the pipeline reads is a 400 before any model work."""
        try:
            job = _job(msg)
            limit = self._limit(msg.kind)
            tokens = limit.check(job.prompt)
            limit.check(job.negative_prompt, "negative_prompt")
        except MediaError as exc:
            self.emit(MediaFailed(msg.jid, exc.message, exc.status, exc.param, exc.code))
            return
        except Exception as exc:  # noqa: BLE001 - a pipeline dir the tokenizer cannot read: that job's 500
            log.exception("reading the prompt limit failed")
            self.emit(MediaFailed(msg.jid, f"{type(exc).__name__}: {exc}", 500, None, "generation_failed"))
            return
        with self.cond:
            self.queue.append(Pending(msg, job, tokens))
            self.cond.notify()

    def _limit(self, kind: str) -> PromptLimit:
        """Read without loading weights: this thread must stay free to take cancels while a pipeline loads."""
        if kind not in self._limits:
            from minisgl_cli.media.pipelines import ensure_model_dir

            spec = self.settings.spec("image" if kind == "image" else "video")
            self._limits[kind] = (PromptLimit.builtin(spec.model) if spec.load_format == "dummy"
                                  else PromptLimit.load(ensure_model_dir(spec)))
        return self._limits[kind]

    def _cancel(self, jid: str) -> None:
        with self.cond:
            waiting = next((p for p in self.queue if p.msg.jid == jid), None)
            if waiting is not None:
                self.queue.remove(waiting)
            elif jid in self.running:
                self.cancelled.add(jid)  # dropped at its batch's next step end
                return
            else:
                return  # already ended: its end event is on its way
        self.emit(MediaFailed(jid, "cancelled", 499, None, "cancelled"))

    # --- the main thread -----------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            with self.cond:
                if not self.queue and not self.stopping and self.warm_next is not None:
                    self.cond.wait_for(lambda: self.queue or self.stopping, WARM_UP_IDLE_S)
                if not self.queue and not self.stopping and self.warm_next is not None:
                    like, self.warm_next = self.warm_next, None
                    self.cond.release()
                    try:
                        self._warm_up(like)
                    finally:
                        self.cond.acquire()
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                batch = self._take()
                self.running = {p.msg.jid for p in batch}
            try:
                self._run(batch)
            finally:
                with self.cond:
                    self.cancelled -= self.running
                    self.running = set()

    def _take(self) -> list[Pending]:
        """The oldest job, and the queued jobs compatible with it (oldest first) while the batch has room."""
        first = self.queue.popleft()
        batch, size, key = [first], rows(first.job), batch_key(first.job)
        for p in list(self.queue):
            if batch_key(p.job) == key and size + rows(p.job) <= self.settings.max_batch:
                self.queue.remove(p)
                batch.append(p)
                size += rows(p.job)
        return batch

    def _run(self, batch: list[Pending]) -> None:
        from minisgl_cli.media.ranks import load as load_pipeline  # with the other ranks under --media-parallel

        first = batch[0]
        live = {p.msg.jid for p in batch}
        try:
            loaded = load_pipeline(self.settings.spec("image" if first.msg.kind == "image" else "video"))
        except Exception as exc:  # noqa: BLE001 - a load failure ends these jobs, not the worker
            self._fail(live, exc)
            return
        self.batches += 1
        size = sum(rows(p.job) for p in batch)
        if not self.warmed and self.settings.max_batch >= 2 and compiles(loaded.spec, loaded.device):
            self.warmed, self.warm_next = True, first.job  # batched graphs, once the queue is idle
        steps = first.job.steps
        for p in batch:
            self.emit(MediaProgress(p.msg.jid, 0, steps, self.batches, size))
        plans = {p.msg.jid: set(preview_steps(p.msg.partial_images, steps)) for p in batch}
        where = {p.msg.jid: (span, p.msg) for p, span in zip(batch, spans([p.job for p in batch]), strict=True)}
        sent = collections.Counter[str]()
        last = time.perf_counter()

        def on_step(done: int, total: int, latents: Any) -> None:
            nonlocal last
            now = time.perf_counter()
            step_s, last = now - last, now
            with self.cond:
                dropped = live & self.cancelled
                stopping = self.stopping
            for jid in dropped:  # a dropped job's rows still run with the others: just discarded
                live.discard(jid)
                self.emit(MediaFailed(jid, "cancelled", 499, None, "cancelled"))
            if stopping or not live:
                raise Cancelled
            for jid in live:
                self.emit(MediaProgress(jid, done, total, step_s=step_s))
                if done in plans[jid] and latents is not None:
                    self._previews(loaded, latents, *where[jid], sent)
                    last = time.perf_counter()  # the decode is not the step's

        try:
            results = generate(loaded, [p.job for p in batch], on_step)
        except Cancelled:
            self._fail(live, MediaError("the media worker is stopping", None), status=503, code="shutting_down")
            return
        except Exception as exc:  # noqa: BLE001 - one failed call ends its jobs, not the worker
            self._fail(live, exc)
            return
        for p, result in zip(batch, results, strict=True):
            if p.msg.jid not in live:
                continue
            start = time.perf_counter()
            try:
                items = _encode(p.msg, result)
            except Exception as exc:  # noqa: BLE001 - e.g. no mp4 writer: this job's error
                self._fail({p.msg.jid}, exc)
                continue
            self.emit(MediaResult(p.msg.jid, items, result.seed, result.elapsed_s, p.prompt_tokens,
                                  time.perf_counter() - start))

    def _warm_up(self, like: ImageJob | VideoJob) -> None:
        from minisgl_cli.media.ranks import load as load_pipeline

        def idle() -> bool:
            with self.cond:
                return not self.queue and not self.stopping

        try:
            done = warm_up(load_pipeline(self.settings.spec("image" if isinstance(like, ImageJob) else "video")),
                           like, self.settings.max_batch, idle)
        except Exception as exc:  # noqa: BLE001 - a warm-up that fails costs a compile later, not the worker
            log.warning("warm-up skipped: %s", first_line(exc))
            return
        if not done:  # a job came first: the rest at the next idle moment (what compiled is kept)
            with self.cond:
                self.warm_next = like

    def _previews(self, loaded: Any, latents: Any, span: slice, msg: MediaSubmit,
                  sent: collections.Counter[str]) -> None:
        from minisgl_cli.media.encode import image_bytes

        try:
            images = preview(loaded, latents, span)
        except Exception:  # noqa: BLE001 - a pipeline whose latents its VAE cannot read as they are: no previews
            log.warning("no partial images: this pipeline's latents do not decode as they are", exc_info=True)
            return
        for i, image in enumerate(images):
            self.emit(MediaPartial(msg.jid, i, sent[msg.jid], image_bytes(image, msg.output_format, msg.quality)))
        sent[msg.jid] += 1

    def _fail(self, jids: set[str], exc: Exception, status: int | None = None, code: str | None = None) -> None:
        if isinstance(exc, MediaError):
            status, param, code, message = status or exc.status, exc.param, code or exc.code, exc.message
        else:
            status, param, code, message = failure(exc)
        for jid in jids:
            self.emit(MediaFailed(jid, message, status, param, code))


def failure(exc: Exception) -> tuple[int, str | None, str, str]:
    """(status, param, code, message) of a job that raised: out of device memory is the server's state (a 503 that
    says what to change, the cached blocks given back for the next job), anything else a 500 logged with its trace."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return 503, None, "out_of_memory", (
            f"out of GPU memory for this job ({first_line(exc)[:160]}): ask for fewer images or a smaller size; beside "
            "a text engine on the same GPU, `minisgl serve` leaves room for a batch of --media-max-batch images of "
            "the default size unless --mem-fraction or --max-total-tokens says otherwise: raise --media-max-batch, "
            "or give the KV pool less with a smaller --mem-fraction")
    log.exception("media generation failed")
    return 500, None, "generation_failed", f"generation failed: {first_line(exc) or type(exc).__name__}"


def _job(msg: MediaSubmit) -> ImageJob | VideoJob:
    if msg.kind == "image":
        return ImageJob(msg.prompt, msg.width, msg.height, msg.steps, msg.guidance_scale, msg.num_images, msg.seed,
                        msg.negative_prompt)
    return VideoJob(msg.prompt, msg.width, msg.height, msg.num_frames, msg.fps, msg.steps, msg.guidance_scale,
                    msg.seed, msg.negative_prompt)


def _encode(msg: MediaSubmit, result: Any) -> list[bytes]:
    """A result as the job asked for it; here, in the worker, off the server's event loop."""
    from minisgl_cli.media.encode import frame_png_bytes, image_bytes, mp4_bytes

    if isinstance(result, ImageResult):
        return [image_bytes(im, msg.output_format, msg.quality) for im in result.images]
    if msg.output_format == "frames":
        return [frame_png_bytes(f) for f in result.frames]
    return [mp4_bytes(result.frames, result.fps)]
