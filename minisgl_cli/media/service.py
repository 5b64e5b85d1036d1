"""MediaService: the server's side of the media worker: admission caps, submitting jobs, each job's events on its
event loop, cancelling, stopping the worker, and the media figures of /metrics.

The worker process starts on the first job (importing torch and diffusers takes seconds that a text-only server
never pays), from a thread of this service that lives as long as the worker (a child dies with the thread that
started it) and reads the worker's events. Admission happens here, before anything reaches the worker:

- a job alone past `max_work` megapixel-steps: 400 (it could never run);
- `max_queue` jobs already waiting: 429;
- the work admitted and not finished plus this job's past `max_work`: 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from minisgl_cli.media.jobs import ImageJob, MediaError, VideoJob
from minisgl_cli.media.settings import MediaSettings
from minisgl_cli.messages import (
    FromMediaWorker,
    MediaCancel,
    MediaFailed,
    MediaProgress,
    MediaResult,
    MediaSubmit,
)
from minisgl_cli.runtime.ipc import pull, push, recv, send
from minisgl_cli.runtime.supervisor import STOP_TIMEOUT_S, Runtime

log = logging.getLogger("minisgl.media")

SEND_TIMEOUT_MS = 10_000


class Refused(MediaError):
    """Admission said no for now (429 / 503): `retry_after_s` goes out as Retry-After."""

    def __init__(self, message: str, status: int, code: str, retry_after_s: int):
        super().__init__(message, None)
        self.status = status
        self.type = "rate_limit_error" if status == 429 else "server_error"
        self.code = code
        self.retry_after_s = retry_after_s


def work_of(job: ImageJob | VideoJob) -> float:
    """Megapixel-steps: width x height x steps x images (or x frames)."""
    count = job.num_images if isinstance(job, ImageJob) else job.num_frames
    return job.width * job.height * job.steps * count / 1e6


@dataclass
class Ticket:
    """One admitted job: its events arrive on `events` (on the loop that submitted it) until its end event."""

    jid: str
    kind: str
    work: float
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    msg: MediaSubmit | None = None  # what `submit` sends
    started: bool = False
    step: int = 0
    steps: int = 0
    done: bool = False

    async def stream(self) -> AsyncIterator[FromMediaWorker]:
        """The job's events, its end event last."""
        while True:
            event = await self.events.get()
            yield event
            if isinstance(event, MediaResult | MediaFailed):
                return

    async def result(self) -> MediaResult:
        """The job's result; MediaError for its failure (status and param as the worker said)."""
        async for event in self.stream():
            if isinstance(event, MediaResult):
                return event
            if isinstance(event, MediaFailed):
                exc = MediaError(event.message, event.param)
                exc.status, exc.code = event.status, event.code or exc.code
                exc.type = "invalid_request_error" if event.status < 500 else "server_error"
                raise exc
        raise AssertionError("unreachable: a stream ends with its end event")


@dataclass
class MediaCounts:
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    refused: collections.Counter = field(default_factory=collections.Counter)  # by status
    steps: int = 0
    step_s_sum: float = 0.0
    step_s_last: float = 0.0
    job_s_sum: float = 0.0
    batches: collections.Counter = field(default_factory=collections.Counter)  # by images in the call
    batch_last: int = 0
    last_batch_id: int = 0


class MediaService:
    def __init__(self, settings: MediaSettings, log_level: int = logging.WARNING):
        self.settings = settings
        self.log_level = log_level
        self._lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}
        self._ids = itertools.count()
        self._counts = MediaCounts()
        self._ready: concurrent.futures.Future | None = None  # the worker's start, once asked for
        self._runtime: Runtime | None = None
        self._out: zmq.Socket | None = None
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    # --- admission -----------------------------------------------------------------------------
    def admit(self, kind: str, job: ImageJob | VideoJob, output_format: str, quality: int | None = None,
              partial_images: int = 0) -> Ticket:
        """A ticket for `job` (not yet sent: `submit` sends it), or Refused / MediaError past a cap."""
        s = self.settings
        work = work_of(job)
        with self._lock:
            if work > s.max_work:
                self._counts.refused[400] += 1
                raise MediaError(
                    f"this request is {work:.1f} megapixel-steps (width x height x steps x "
                    f"{'n' if kind == 'image' else 'num_frames'}); this server takes at most {s.max_work:g} "
                    "(--media-max-work)", "n" if kind == "image" else "num_frames")
            queued = sum(not t.started for t in self._tickets.values())
            if queued >= s.max_queue:
                self._counts.refused[429] += 1
                raise Refused(f"{queued} media jobs are waiting (--media-max-queue {s.max_queue}): retry later",
                              429, "too_many_requests", self._retry_after())
            admitted = sum(t.work for t in self._tickets.values())
            if admitted + work > s.max_work:
                self._counts.refused[503] += 1
                raise Refused(f"the media worker has {admitted:.1f} of {s.max_work:g} megapixel-steps in flight; this "
                              f"request needs {work:.1f}: retry later", 503, "overloaded", self._retry_after())
            jid = f"{kind[:3]}_{next(self._ids)}_{int(time.time() * 1000) % 10**8}"
            ticket = Ticket(jid, kind, work, asyncio.get_running_loop(), steps=job.steps)
            self._tickets[jid] = ticket
        assert job.seed is not None
        ticket.msg = MediaSubmit(
            jid, kind, job.prompt, job.negative_prompt, job.width, job.height, job.steps, job.guidance_scale,
            job.seed, num_images=job.num_images if isinstance(job, ImageJob) else 1,
            num_frames=job.num_frames if isinstance(job, VideoJob) else 0,
            fps=job.fps if isinstance(job, VideoJob) else 0,
            output_format=output_format, quality=quality, partial_images=partial_images,
        )
        return ticket

    def _retry_after(self) -> int:
        """Seconds until the work now admitted is likely done: its steps left at the mean step time (at least 1)."""
        c = self._counts
        mean = c.step_s_sum / c.steps if c.steps else 1.0
        left = sum(t.steps - t.step for t in self._tickets.values())
        return max(1, math.ceil(mean * left))

    async def submit(self, ticket: Ticket) -> None:
        """Send an admitted ticket's job to the worker, starting the worker first if it is not running."""
        assert ticket.msg is not None
        try:
            await asyncio.wrap_future(self._start())
            self._send(ticket.msg)
        except BaseException:
            self._end(ticket.jid)
            raise

    def cancel(self, jid: str) -> None:
        """Drop a job (queued: at once; running: at its next step end). Its end event still comes."""
        with self._lock:
            live = jid in self._tickets
        if live:
            self._send(MediaCancel(jid))

    def _send(self, msg: MediaSubmit | MediaCancel) -> None:
        with self._send_lock:
            if self._out is None:
                raise MediaError("the media worker is not running", None)
            try:
                send(self._out, msg)
            except zmq.Again:
                raise MediaError("the media worker does not take jobs (gone or wedged)", None) from None

    # --- the worker ----------------------------------------------------------------------------
    def _start(self) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.set_exception(MediaError("the server is stopping", None))
                return fut
            if self._ready is None:
                self._ready = concurrent.futures.Future()
                self._thread = threading.Thread(target=self._own_worker, args=(self._ready,), name="minisgl-media",
                                                daemon=True)
                self._thread.start()
            return self._ready

    def _own_worker(self, ready: concurrent.futures.Future) -> None:
        """Start the worker, then read its events until it stops (this thread is the worker's parent)."""
        from minisgl_cli.media.worker import WorkerStart, run_media_worker
        from minisgl_cli.notice import notice

        runtime = Runtime()
        ctx = zmq.Context()
        inbox = pull(ctx, runtime.endpoints.media_events)
        try:
            runtime.start("media worker", run_media_worker, WorkerStart(self.settings, runtime.endpoints,
                                                                        self.log_level))
            notice(f"starting media worker (pid {runtime.procs['media worker'].pid})")
            runtime.wait_ready(notice, time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - its one line is every waiting request's 503
            ctx.destroy(linger=0)
            err = MediaError(f"the media worker failed to start: {exc}", None)
            err.status, err.code, err.type = 503, "media_unavailable", "server_error"
            with self._lock:
                self._ready = None  # the next request tries again
            ready.set_exception(err)
            return
        # At the interpreter's exit, before multiprocessing's own hook (registered earlier, run later) waits for it.
        atexit.register(self.close)
        died = threading.Event()
        runtime.on_death(lambda reason: died.set())
        runtime.watch()
        with self._send_lock:
            self._out = push(ctx, runtime.endpoints.media, timeout_ms=SEND_TIMEOUT_MS)
        with self._lock:
            self._runtime = runtime
        ready.set_result(None)
        while not self._closed and not died.is_set():
            if inbox.poll(100):
                try:
                    self._handle(recv(inbox))
                except Exception:  # this thread feeds every job: one bad message is dropped, not the end of them
                    log.exception("the media client dropped a message it could not read")
        runtime.shutdown()  # SIGTERM: the worker ends its call at the next step end (SIGKILL past 5 s)
        reason = runtime.dead or "the server is stopping"
        with self._send_lock:
            self._out = None
        with self._lock:
            self._runtime = None
            self._ready = None  # a worker that died is started again by the next job
            orphans = list(self._tickets)
        for jid in orphans:  # their worker is gone: their end comes from here
            self._handle(MediaFailed(jid, f"the media worker stopped: {reason}", 503, None, "media_unavailable"))
        ctx.destroy(linger=0)

    def _handle(self, msg: FromMediaWorker) -> None:
        c = self._counts
        with self._lock:
            ticket = self._tickets.get(msg.jid)
            if ticket is None:
                return
            if isinstance(msg, MediaProgress):
                if msg.step == 0:
                    ticket.started = True
                    if msg.batch > c.last_batch_id:
                        c.last_batch_id, c.batch_last = msg.batch, msg.batch_size
                        c.batches[msg.batch_size] += 1
                else:
                    ticket.step = msg.step
                    c.steps += 1
                    c.step_s_sum += msg.step_s
                    c.step_s_last = msg.step_s
            elif isinstance(msg, MediaResult):
                c.completed += 1
                c.job_s_sum += msg.elapsed_s
            elif isinstance(msg, MediaFailed):
                if msg.code == "cancelled":
                    c.cancelled += 1
                elif msg.status < 500:
                    c.refused[msg.status] += 1
                else:
                    c.failed += 1
            if isinstance(msg, MediaResult | MediaFailed):
                self._end_locked(msg.jid)
        try:
            ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, msg)
        except RuntimeError:  # its event loop has closed: nobody waits for it
            pass

    def _end(self, jid: str) -> None:
        with self._lock:
            self._end_locked(jid)

    def _end_locked(self, jid: str) -> None:
        ticket = self._tickets.pop(jid, None)
        if ticket is not None:
            ticket.done = True

    def progress(self, jid: str) -> tuple[bool, int, int] | None:
        """(started, steps done, steps) of a job not yet ended; None once it has."""
        with self._lock:
            t = self._tickets.get(jid)
            return None if t is None else (t.started, t.step, t.steps)

    def metrics(self) -> dict[str, Any]:
        """The media part of /metrics."""
        s, c = self.settings, self._counts
        with self._lock:
            tickets = list(self._tickets.values())
            runtime = self._runtime
            batches = sum(c.batches.values())
            return {
                "worker_pid": runtime.procs["media worker"].pid if runtime is not None else None,
                "queued": sum(not t.started for t in tickets),
                "running": sum(t.started for t in tickets),
                "work_in_flight": round(sum(t.work for t in tickets), 6),
                "max_queue": s.max_queue,
                "max_batch": s.max_batch,
                "max_work": s.max_work,
                "jobs": {"completed": c.completed, "cancelled": c.cancelled, "failed": c.failed,
                         "refused": {str(k): v for k, v in sorted(c.refused.items())}},
                "batches": {"count": batches, "last_size": c.batch_last,
                            "mean_size": round(sum(k * v for k, v in c.batches.items()) / batches, 3) if batches else 0,
                            "sizes": {str(k): v for k, v in sorted(c.batches.items())}},
                "steps": c.steps,
                "step_ms": {"last": round(c.step_s_last * 1000, 3),
                            "mean": round(c.step_s_sum / c.steps * 1000, 3) if c.steps else 0.0},
            }

    def close(self) -> None:
        """Stop the worker (SIGTERM; SIGKILL past 5 s) and end every job still open (a 503 each)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(STOP_TIMEOUT_S + 2)
