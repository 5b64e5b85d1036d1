"""Start, watch and stop the runtime's processes: detokenizer, tokenizer workers, one scheduler per TP rank.

`launch()` starts every child of this node, prints a line as each starts and as each is ready, and
returns the API side's `RemoteClient`. A watcher thread notices any child that dies: it logs one line
naming it and calls `on_death` (the server then exits non-zero). Children are killed with their
parent whatever happens to it (see `ipc.die_with_parent`); `shutdown` stops all of them within 5 s.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import cast

import zmq

from minisgl_cli.distributed import DistConfig
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.messages import Failed, Ready
from minisgl_cli.runtime.client import RemoteClient
from minisgl_cli.runtime.ipc import Endpoints, pull, recv
from minisgl_cli.runtime.scheduler_proc import RankJob, run_rank
from minisgl_cli.runtime.tokenizer_proc import WorkerJob, run_worker
from minisgl_cli.scheduler.scheduler import SchedulerConfig

log = logging.getLogger("minisgl.runtime")

START_TIMEOUT_S = 900.0  # loading an 8B checkpoint and capturing CUDA graphs takes minutes on a slow disk
STOP_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class RuntimeConfig:
    """How the engine runs: in this process or as processes, and across how many ranks and nodes."""

    dist: DistConfig = field(default_factory=DistConfig)
    num_tokenizer: int = 0  # 0: the detokenizer also tokenizes

    def __post_init__(self) -> None:
        if self.num_tokenizer < 0:
            raise ValueError("--num-tokenizer must be >= 0")


class Runtime:
    """This node's child processes and their private ipc directory."""

    def __init__(self, on_death: Callable[[str], None] | None = None):
        self.root = tempfile.mkdtemp(prefix="minisgl-")
        os.chmod(self.root, 0o700)  # the sockets are the engine's doors: this user only
        self.endpoints = Endpoints(self.root)
        self.procs: dict[str, BaseProcess] = {}  # spawn-context processes
        self.on_death = on_death
        self.stopping = False
        self.dead: str | None = None

    def start(self, name: str, target: Callable, job: object) -> None:
        proc = mp.get_context("spawn").Process(target=target, args=(job,), name=f"minisgl {name}", daemon=False)
        proc.start()
        self.procs[name] = proc

    def wait_ready(self, progress: Callable[[str], None], t0: float) -> dict[str, Ready]:
        """Every child's Ready, printing a line per child; RuntimeError (children stopped) on any failure."""
        ctx = zmq.Context()
        sock = pull(ctx, self.endpoints.launcher)
        ready: dict[str, Ready] = {}
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(ready) < len(self.procs):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the runtime did not start within {START_TIMEOUT_S:.0f}s")
                if sock.poll(200):
                    msg = recv(sock)
                    if isinstance(msg, Failed):
                        raise RuntimeError(f"{msg.proc} failed to start: {msg.error}")
                    ready[msg.proc] = msg
                    progress(
                        f"{msg.proc} ready{': ' + msg.detail if msg.detail else ''} ({time.monotonic() - t0:.1f}s)"
                    )
                for name, proc in self.procs.items():
                    if name not in ready and proc.exitcode is not None:
                        raise RuntimeError(f"{name} exited with code {proc.exitcode} while starting")
        except BaseException:
            self.shutdown()
            raise
        finally:
            ctx.destroy(linger=0)
        return ready

    def watch(self) -> None:
        """A thread that reports the first child to die (unless we are stopping them)."""

        def run() -> None:
            sentinels = {p.sentinel: name for name, p in self.procs.items()}
            ready = multiprocessing.connection.wait(list(sentinels))
            if self.stopping:
                return
            name = sentinels[cast(int, ready[0])]  # wait() returns the sentinels it was given
            self.dead = f"{name} (pid {self.procs[name].pid}) exited with code {self.procs[name].exitcode}"
            log.error("minisgl runtime: %s; stopping", self.dead)
            if self.on_death is not None:
                self.on_death(self.dead)

        threading.Thread(target=run, name="minisgl-watch", daemon=True).start()

    def alive(self) -> bool:
        return self.dead is None and all(p.exitcode is None for p in self.procs.values())

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL what is left after STOP_TIMEOUT_S; remove the ipc directory."""
        self.stopping = True
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()  # SIGTERM; a child that is already gone is skipped
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        shutil.rmtree(self.root, ignore_errors=True)


def model_dir_of(cfg: EngineConfig) -> str | None:
    """The HF dir the tokenizer workers load (None for a built-in dummy config): resolved once, here."""
    if cfg.load_format == "dummy":
        from minisgl_cli.loader.configs import builtin_config

        try:
            builtin_config(cfg.model or "smollm2-135m")
            return None
        except KeyError:
            pass
    from minisgl_cli.loader.resolve import resolve_model

    return str(resolve_model(cfg.model).path)


def launch(engine: EngineConfig, scheduler: SchedulerConfig, rt: RuntimeConfig,
           progress: Callable[[str], None] = lambda line: None,
           on_death: Callable[[str], None] | None = None) -> RemoteClient | Runtime:
    """Start this node's processes. Node 0 gets the RemoteClient; other nodes (ranks only) the Runtime."""
    t0 = time.monotonic()
    model_dir = model_dir_of(engine)
    if model_dir is not None:
        engine = dataclasses.replace(engine, model=model_dir)  # children skip resolving again
    runtime = Runtime(on_death)
    ep = runtime.endpoints
    level = logging.getLogger("minisgl").getEffectiveLevel()
    head = rt.dist.node_rank == 0
    try:
        if head:
            runtime.start("detokenizer", run_worker, WorkerJob(-1, model_dir, ep, rt.num_tokenizer == 0, True, level))
            for i in range(rt.num_tokenizer):
                runtime.start(f"tokenizer {i}", run_worker, WorkerJob(i, model_dir, ep, True, False, level))
        first = rt.dist.local_ranks()[0]
        for rank in rt.dist.local_ranks():
            runtime.start(f"scheduler rank {rank}", run_rank,
                          RankJob(rank, rank - first, engine, scheduler, rt.dist, ep, level))
    except BaseException:
        runtime.shutdown()
        raise
    for name, proc in runtime.procs.items():
        progress(f"starting {name} (pid {proc.pid})")
    ready = runtime.wait_ready(progress, t0)
    runtime.watch()
    if not head:
        return runtime
    info = ready["scheduler rank 0"].info
    assert info is not None
    return RemoteClient(info, ep, rt.num_tokenizer, runtime.alive, runtime.shutdown)
