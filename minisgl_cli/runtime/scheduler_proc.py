"""One scheduler rank's process: its engine on its device, its scheduler loop, and its ZMQ / rank traffic.

Rank 0 reads requests from the tokenizer workers, hands each step's messages to the other ranks (so
every rank schedules exactly alike and their collectives meet), and sends step outputs to the
detokenizer, with a heartbeat about once a second. Ranks 1.. only follow rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass

import zmq

from minisgl_cli.distributed import DistConfig
from minisgl_cli.distributed.comm import broadcast_bytes, init_tp
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.messages import Failed, FromScheduler, Heartbeat, RankBatch, Ready, ToScheduler, decode, encode
from minisgl_cli.runtime.ipc import Endpoints, die_with_parent, pull, push, recv, send
from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("minisgl.runtime")

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


def run_rank(job: RankJob) -> None:
    """Process entry point: report Ready (or Failed) to the launcher, then serve until killed."""
    die_with_parent()
    logging.basicConfig(level=job.log_level, format=f"%(asctime)s %(levelname)s rank{job.rank} %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    ctx = zmq.Context()
    launcher = push(ctx, job.endpoints.launcher)
    name = f"scheduler rank {job.rank}"
    try:
        scheduler, tp, receive, stop = _start(job, ctx)
    except BaseException as exc:  # noqa: BLE001 - any start-up failure is reported as one line
        log.debug("start-up failed:\n%s", traceback.format_exc())
        send(launcher, Failed(name, f"{type(exc).__name__}: {exc}".strip()))
        launcher.close(linger=2000)
        raise SystemExit(1) from None
    from minisgl_cli.client.local import engine_info

    e = scheduler.engine
    send(launcher, Ready(name, engine_info(e, scheduler) if tp.rank == 0 else None,
                         f"{e.device} {str(e.dtype).removeprefix('torch.')}, {e.pool.num_pages * e.pool.page_size:,} "
                         f"KV tokens, loaded in {e.loaded.load_s:.1f}s"))
    scheduler.run_forever(stop, receive)
    if e.compiling:  # an interpreter exit would wait for the compile thread or abort in it: leave at once
        logging.shutdown()
        os._exit(0)


def _start(job: RankJob, ctx: zmq.Context):
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
    if engine.loaded.model_dir is not None:
        from minisgl_cli.tokenizer import Tokenizer

        eos = Tokenizer(engine.loaded.model_dir).eos_token_ids
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

