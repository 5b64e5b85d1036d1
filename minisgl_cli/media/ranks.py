"""The processes of a media group (`--media-parallel`): rank 0 (the CLI's process or the media worker) spawns ranks
1..N-1, one a device, hands them each batch of jobs over a queue, and stops them; media/parallel.py is what each
rank's pipeline does inside a call.

Every collective is bounded (`TIMEOUT`): a rank that died makes the others fail instead of hanging; leaving the group
is bounded too (a probe once hung there at exit). The ranks die with rank 0 (`die_with_parent`) and skip Ctrl-C
(rank 0 stops them); NCCL's NVLink multicast is off in every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from minisgl_cli.distributed import free_port
from minisgl_cli.media.jobs import Cancelled, MediaError, ModelSpec, first_line
from minisgl_cli.media.pipelines import LoadedPipeline, load_pipeline

log = logging.getLogger("minisgl.media")

# A step (or a rank's compile of the DiT's blocks on its first call) must finish within this, at every collective
# (a benchmark with a short budget sets it lower before the group starts: every rank takes rank 0's).
TIMEOUT = datetime.timedelta(seconds=600)
START_TIMEOUT_S = 900.0  # the other ranks' imports and pipeline loads
CLOSE_TIMEOUT_S = 10.0


class RanksGone(MediaError):
    """The group cannot run another call (a rank died): the server's state, not the request's."""

    status = 503
    type = "server_error"
    code = "media_rank_gone"


def check(spec: ModelSpec) -> None:
    """What `load` would refuse before starting anything, for a server's start-up: the options for this machine,
    and the split of the model where its configs are at hand (a built-in one, or a dir already on disk)."""
    if spec.media_parallel is None:
        return
    from minisgl_cli.device import pick_device
    from minisgl_cli.media.pipelines import check_options

    check_options(spec, pick_device(spec.device))
    if spec.load_format == "dummy" or (spec.model_dir / "model_index.json").is_file():
        _check_model(spec)


def load(spec: ModelSpec) -> LoadedPipeline:
    """The pipeline for `spec`; for a parallel spec rank 0's, with the other ranks started and loaded beside it
    (one group a process: it stays up for later calls until `close`)."""
    global _group
    if spec.media_parallel is None:
        return load_pipeline(spec)
    from minisgl_cli.device import pick_device
    from minisgl_cli.media.pipelines import check_options

    with _lock:
        if _group is None:
            device = pick_device(spec.device)
            check_options(spec, device)  # nothing spawned for a bad option or a model that cannot be split so
            _check_model(spec)
            _group = (spec, Ranks.start(spec, device))
        elif _group[0] != spec:
            raise MediaError(f"this process already runs {_group[0].model} over {_group[0].media_parallel_size} "
                             f"ranks: one parallel pipeline a process", "media_parallel")
        loaded = load_pipeline(spec)  # after joining the group: its denoiser is split as the other ranks' are
        if loaded.ranks is None:
            _group[1].wait_ready()
            loaded.ranks = _group[1]
        return loaded


def close() -> None:
    """Stop this process's media group, if any (the CLI at exit, the media worker on its way out)."""
    global _group
    with _lock:
        if _group is not None:
            _group[1].close()
            _group = None


def _check_model(spec: ModelSpec) -> None:
    """parallel.check_model from the built-in config or the pipeline dir's configs, before any weights load."""
    from minisgl_cli.media import parallel

    if spec.load_format == "dummy":
        from minisgl_cli.media.configs import PIPELINES, builtin_kind

        builtin_kind(spec.model)
        _, pipeline_class, parts = PIPELINES[spec.model]
        transformer_class, transformer = parts["transformer"]
        parallel.check_model(spec, pipeline_class, transformer_class, transformer)
    else:
        from minisgl_cli.media.pipelines import ensure_model_dir

        parallel.check_model_dir(spec, ensure_model_dir(spec))


_group: tuple[ModelSpec, Ranks] | None = None
_lock = threading.Lock()


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th GPU after rank 0's (cuda:1 for rank 1 of a group on cuda:0), or the CPU."""
    if device.startswith("cuda"):
        return f"cuda:{int(device.partition(':')[2] or 0) + rank}"
    return device


def _join(rank: int, size: int, addr: str, device: str, timeout: datetime.timedelta) -> None:
    import torch
    import torch.distributed as dist

    url = f"tcp://{addr}"
    if device.startswith("cuda"):
        from minisgl_cli.distributed.comm import NO_MULTICAST

        for name, value in NO_MULTICAST.items():  # before NCCL starts: multicast can take a shared host down
            os.environ.setdefault(name, value)
        where = torch.device(device)
        if where.index is None:  # "cuda": the current one
            where = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(where)
        dist.init_process_group("nccl", init_method=url, world_size=size, rank=rank, timeout=timeout, device_id=where)
    else:
        dist.init_process_group("gloo", init_method=url, world_size=size, rank=rank, timeout=timeout)


def _leave_group() -> bool:
    from minisgl_cli.distributed.comm import close_tp

    return close_tp(CLOSE_TIMEOUT_S)


@dataclass
class FollowerStart:
    spec: ModelSpec  # its device: this rank's
    rank: int
    size: int
    addr: str
    jobs: Any  # mp.Queue: lists of jobs from rank 0, None to stop
    ready: Any  # mp.Queue: (rank, None) once loaded, or (rank, "one-line error")
    log_level: int
    timeout: datetime.timedelta  # of every collective


def _follow(start: FollowerStart) -> None:
    """A rank > 0: join the group, load the same pipeline on its device, then run each batch of jobs rank 0 sends."""
    from minisgl_cli.runtime.child import die_with_parent, leave, no_process_locks

    die_with_parent()
    no_process_locks()
    logging.basicConfig(level=start.log_level, format=f"%(asctime)s %(levelname)s media rank {start.rank}: "
                        "%(message)s", datefmt="%H:%M:%S")
    import torch

    device = start.spec.device or "cpu"
    if device.startswith("cpu"):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // start.size))  # the ranks share the cores
    from minisgl_cli.media.batch import generate
    from minisgl_cli.media.pipelines import quiet_libraries

    quiet_libraries()
    try:
        _join(start.rank, start.size, start.addr, device, start.timeout)
        loaded = load_pipeline(start.spec)
    except Exception as exc:  # noqa: BLE001 - any start-up failure is one line for rank 0
        log.debug("media rank %d failed to load", start.rank, exc_info=True)
        start.ready.put((start.rank, getattr(exc, "message", None) or f"{type(exc).__name__}: {first_line(exc)}"))
        start.ready.close()
        start.ready.join_thread()  # the line reaches rank 0 before leave()'s os._exit, which skips the queue's flush
        leave(1)
    start.ready.put((start.rank, None))
    code = 0
    while True:
        jobs = start.jobs.get()
        if jobs is None:
            break
        try:
            generate(loaded, jobs)
        except Cancelled:
            pass
        except BaseException:  # noqa: BLE001 - the group is broken (rank 0's collective fails too): out
            log.exception("media rank %d failed", start.rank)
            code = 1
            break
    _leave_group()
    leave(code)


class Ranks:
    """Rank 0's handle on ranks 1..N-1: their processes, the queues that hand them jobs."""

    def __init__(self, procs: list[Any], queues: list[Any], ready: Any):
        self.procs, self.queues, self.ready = procs, queues, ready
        self.closed = False

    @classmethod
    def start(cls, spec: ModelSpec, device: str) -> Ranks:
        """Spawn ranks 1..N-1 (each loads `spec` on its own device) and join the group as rank 0."""
        size = spec.media_parallel_size
        addr = f"127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")  # no fork of a process that holds torch and its threads
        ready, procs, queues = ctx.Queue(), [], []
        for rank in range(1, size):
            jobs = ctx.Queue()
            follower = dataclasses.replace(spec, device=rank_device(device, rank))
            start = FollowerStart(follower, rank, size, addr, jobs, ready, logging.getLogger().level, TIMEOUT)
            proc = ctx.Process(target=_follow, args=(start,), name=f"minisgl media rank {rank}", daemon=True)
            proc.start()
            procs.append(proc)
            queues.append(jobs)
        ranks = cls(procs, queues, ready)
        try:
            _join(0, size, addr, device, TIMEOUT)
        except BaseException:
            ranks.close()
            raise
        return ranks

    def wait_ready(self) -> None:
        """Every other rank loaded; a MediaError with the first failure's line otherwise."""
        pending = set(range(1, len(self.procs) + 1))
        deadline = time.monotonic() + START_TIMEOUT_S
        while pending:
            try:
                rank, error = self.ready.get(timeout=0.5)
            except queue.Empty:
                dead = next((p for p in self.procs if p.exitcode is not None), None)
                if dead is not None or time.monotonic() > deadline:
                    self.close()
                    why = (f"{dead.name} exited with code {dead.exitcode} while loading" if dead is not None else
                           f"ranks {sorted(pending)} not loaded after {START_TIMEOUT_S:.0f} s")
                    raise MediaError(f"media {why}", "media_parallel") from None
                continue
            if error is not None:
                self.close()
                raise MediaError(f"media rank {rank} failed to load: {error}", "media_parallel")
            pending.discard(rank)

    def submit(self, jobs: list[Any]) -> None:
        """The other ranks run `jobs` too (the same call, the same seeds); rank 0 runs them next."""
        dead = next((p for p in self.procs if p.exitcode is not None), None)
        if self.closed or dead is not None:
            raise RanksGone("a media rank process is gone: restart to run on several devices", "media_parallel")
        for q in self.queues:
            q.put(jobs)

    def close(self) -> None:
        """Stop the other ranks (each leaves the group), leave it ourselves; kill a rank that does not go in time."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + CLOSE_TIMEOUT_S  # for all of it: leaving the group, the ranks' exits
        for q in self.queues:
            with contextlib.suppress(Exception):
                q.put(None)
        _leave_group()
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        # The queues' named semaphores are unlinked when the queues are collected: the media worker leaves through
        # os._exit (no exit finalizers), which would leave them to the resource tracker's warning at the server's exit.
        for q in [*self.queues, self.ready]:
            with contextlib.suppress(Exception):
                q.close()
                q.join_thread()  # its feeder thread holds two of them
        self.queues, self.ready = [], None
