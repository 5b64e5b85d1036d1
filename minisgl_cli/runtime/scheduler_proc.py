"""One scheduler rank's process: its engine on its device, its scheduler loop, and its ZMQ / rank traffic.

Rank 0 reads requests from the tokenizer workers, hands each step's messages to the other ranks (so
every rank schedules exactly alike and their collectives meet), and sends step outputs to the
detokenizer, with a heartbeat about once a second. Ranks 1.. only follow rank 0.

Stopping (SIGTERM, what the runtime's shutdown sends): rank 0 finishes its step, hands the other ranks a stop in
place of the next step's messages, and every rank leaves its loop there, through the scheduler's clean-up (pages
handed back, the grammar build joined), and exits 0. Ranks 1.. on rank 0's node ignore the signal itself: one that
left on its own would leave rank 0 waiting in a collective (a hung rank 0 is killed by the shutdown after its 5 s).
On another node (--node-rank > 0) the signal ends a rank at once, as that node stops alone.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from minisgl_cli import notice
from minisgl_cli.distributed import DistConfig, TPInfo
from minisgl_cli.distributed.comm import broadcast_bytes, close_tp, describe_all_reduce, init_tp
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.messages import AddRequest, FromScheduler, Heartbeat, RankBatch, ToScheduler, decode, encode
from minisgl_cli.runtime.child import Child, leave
from minisgl_cli.runtime.ipc import Endpoints, pull, push, recv, send
from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig
from minisgl_cli.vision import pixels

HEARTBEAT_S = 1.0
log = logging.getLogger("minisgl.runtime")


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
    """Process entry point: report Ready (or Failed) to the launcher, serve until stopped (SIGTERM on rank 0, rank
    0's word on the others), stop through the scheduler's clean-up, exit 0."""
    child = Child(f"scheduler rank {job.rank}", f"rank{job.rank}", job.log_level, job.endpoints.launcher)
    rank = child.start(functools.partial(_start, job))
    scheduler, tp = rank.scheduler, rank.tp
    if tp.rank == 0:
        signal.signal(signal.SIGTERM, lambda *_: rank.ask_stop())
    elif job.dist.node_rank == 0:  # rank 0's stop comes (a node of ranks only stops alone: the signal ends it)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    info = scheduler.model_info()
    summed = describe_all_reduce(scheduler.engine.tp)
    child.ready(info if tp.rank == 0 else None,
                f"{info.device} {info.dtype}, {info.kv_tokens:,} KV tokens, loaded in {info.load_s:.1f}s"
                + (f", all-reduce {summed}" if summed else ""))
    try:
        scheduler.run_forever(rank.stop, rank.receive)
    except Exception:
        if tp.size == 1:
            raise
        # A collective failed: another rank died (the runtime's one line names it); this rank's side is for -v.
        log.info("%s: its TP group broke", child.name, exc_info=True)
        leave(1)
    s = scheduler.snapshot()
    log.info("%s stopped: %d of %d KV tokens free", child.name, s.tokens_free, s.tokens_total)
    if tp.size > 1:
        close_tp()
    leave()


@dataclass
class _Rank:
    """One rank's scheduler, where it belongs in its TP group, and how its loop gets messages and a stop."""

    scheduler: Scheduler
    tp: TPInfo
    receive: Callable[[bool], list[ToScheduler]]
    stop: threading.Event  # its loop's: set only inside `receive`, so every rank leaves at the same step
    asked: threading.Event = dataclasses.field(default_factory=threading.Event)  # rank 0: SIGTERM came

    def ask_stop(self) -> None:
        """Rank 0's SIGTERM handler: stop at the next receive (woken if idle)."""
        self.asked.set()
        self.scheduler.inbox.put(None)


def _start(job: RankJob, ctx: zmq.Context):
    if job.notices and job.rank == 0:
        notice.show()
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
    stop, asked = threading.Event(), threading.Event()
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
            if job.dist.nnodes > 1:  # ranks on other hosts cannot read this host's shared memory
                _inline_pixels(msgs)
            if asked.is_set():  # what came with the stop is dropped: the runtime's shutdown ends every stream
                msgs = []
                stop.set()
            if tp.size > 1:
                broadcast_bytes(encode(RankBatch(msgs, stop.is_set())) if msgs or stop.is_set() else None, tp)
            return msgs
    else:
        scheduler = Scheduler(engine, job.scheduler, lambda msg: None, eos_token_ids=eos)

        def receive(block: bool) -> list[ToScheduler]:
            data = broadcast_bytes(None, tp)
            if not data:
                return []
            batch: RankBatch = decode(data)
            if batch.stop:
                stop.set()
            return batch.msgs

    return _Rank(scheduler, tp, receive, stop, asked)


def _inline_pixels(msgs: list[ToScheduler]) -> None:
    """Multi-node TP: the pixels of each new request's images go with the rank batch (a segment already gone stays
    a reference: every rank then fails that request alike)."""
    for msg in msgs:
        if isinstance(msg, AddRequest):
            for img in msg.images:
                if img.shm is not None and img.data is None:
                    img.data = pixels.read_bytes(img.shm)


def _feed_inbox(ctx: zmq.Context, addr: str, inbox: queue.SimpleQueue) -> None:
    """A thread that moves messages from rank 0's socket into its scheduler's inbox (zmq waits without the GIL)."""
    sock = pull(ctx, addr)

    def pump() -> None:
        while True:
            inbox.put(recv(sock))

    threading.Thread(target=pump, name="minisgl-sched-recv", daemon=True).start()

