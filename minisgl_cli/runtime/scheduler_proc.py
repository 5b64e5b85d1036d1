"""One scheduler rank's process: its engine on its device, its scheduler loop, and its ZMQ / rank traffic.

Rank 0 reads requests from the tokenizer workers, hands each step's messages to the other ranks (so
every rank schedules exactly alike and their collectives meet), and sends step outputs to the
detokenizer, with a heartbeat about once a second. Ranks 1.. only follow rank 0.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq

from minisgl_cli import notice
from minisgl_cli.distributed import DistConfig
from minisgl_cli.distributed.comm import broadcast_bytes, init_tp
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.messages import FromScheduler, Heartbeat, RankBatch, ToScheduler, decode, encode
from minisgl_cli.runtime.child import Child
from minisgl_cli.runtime.ipc import Endpoints, pull, push, recv, send
from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig

HEARTBEAT_S = 1.0


@dataclass(frozen=True)
class RankJob:
    """What a scheduler process needs to start (pickled to the child)."""

    rank: int
    device_index: int  # its GPU among those visible on this node (each --dp replica has its own slice)
    engine: EngineConfig
    scheduler: SchedulerConfig
    dist: DistConfig
    endpoints: Endpoints
    log_level: int = logging.WARNING
    cpu_threads: int | None = None  # CPU: torch threads (this rank's share of the host's cores)
    notices: bool = False  # print notices (minisgl_cli/notice.py): its command does


def run_rank(job: RankJob) -> None:
    """Process entry point: report Ready (or Failed) to the launcher, then serve until killed."""
    child = Child(f"scheduler rank {job.rank}", f"rank{job.rank}", job.log_level, job.endpoints.launcher)
    scheduler, tp, receive, stop = child.start(functools.partial(_start, job))
    info = scheduler.model_info()
    child.ready(info if tp.rank == 0 else None,
                f"{info.device} {info.dtype}, {info.kv_tokens:,} KV tokens, loaded in {info.load_s:.1f}s")
    scheduler.run_forever(stop, receive)


def _no_process_locks() -> None:
    """Give tqdm a thread lock before anything draws a bar (torch.compile's tracer does, even hidden): its default
    is a multiprocessing lock, a named semaphore that this process, stopped by SIGTERM, would leave behind for
    the resource tracker to warn about at the server's exit. No bar here is shared with another process."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _start(job: RankJob, ctx: zmq.Context):
    if job.notices and job.rank == 0:
        notice.show()
    _no_process_locks()
    import torch

    device = job.engine.resolved_device()
    if device.type == "cuda":
        if job.device_index >= torch.cuda.device_count():
            raise RuntimeError(f"needs GPU {job.device_index} but {torch.cuda.device_count()} are visible "
                               "(--dp x --tp GPUs per host; CUDA_VISIBLE_DEVICES)")
        device = torch.device("cuda", job.device_index)
        torch.cuda.set_device(device)
    tp = init_tp(job.rank, job.dist, device)
    torch.manual_seed(job.engine.seed)  # every rank's torch RNG alike (sampling itself uses counter-based streams)
    cfg = dataclasses.replace(job.engine, device=str(device),
                              num_threads=job.cpu_threads if device.type == "cpu" else job.engine.num_threads)
    from minisgl_cli.engine.engine import Engine

    engine = Engine(cfg, tp, own_process=True)
    eos: frozenset[int] = frozenset()
    if engine.spec.model_dir is not None:
        from minisgl_cli.tokenizer import Tokenizer

        eos = Tokenizer(engine.spec.model_dir).eos_token_ids
    stop = threading.Event()
    if tp.rank == 0:
        out = push(ctx, job.endpoints.detokenizer)
        last_beat = [0.0]

        def emit(msg: FromScheduler) -> None:
            send(out, msg)

        scheduler = Scheduler(engine, job.scheduler, emit, eos_token_ids=eos)
        _feed_inbox(ctx, job.endpoints.scheduler, scheduler.inbox)

        def receive(block: bool) -> list[ToScheduler]:
            now = time.monotonic()
            if now - last_beat[0] >= HEARTBEAT_S:
                last_beat[0] = now
                send(out, Heartbeat(time.time()))
            msgs = scheduler.drain(block)
            if tp.size > 1:
                broadcast_bytes(encode(RankBatch(msgs)) if msgs else None, tp)
            return msgs
    else:
        scheduler = Scheduler(engine, job.scheduler, lambda msg: None, eos_token_ids=eos)

        def receive(block: bool) -> list[ToScheduler]:
            data = broadcast_bytes(None, tp)
            return decode(data).msgs if data else []

    return scheduler, tp, receive, stop


def _feed_inbox(ctx: zmq.Context, addr: str, inbox: queue.SimpleQueue) -> None:
    """A thread that moves messages from rank 0's socket into its scheduler's inbox (zmq waits without the GIL)."""
    sock = pull(ctx, addr)

    def pump() -> None:
        while True:
            inbox.put(recv(sock))

    threading.Thread(target=pump, name="minisgl-sched-recv", daemon=True).start()

