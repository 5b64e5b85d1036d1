"""launch(): start this node's processes — detokenizer, tokenizer workers, one scheduler per TP rank — once
per data-parallel replica.

It prints a line as each child starts and as each is ready, and returns the API side's client on node 0:
the replica's `RemoteClient`, or with --dp > 1 an `EnginePool` over one per replica (other nodes run ranks
only and get their `Runtime`, see supervisor.py).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from minisgl_cli import notice
from minisgl_cli.client.protocol import EngineClient
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.process_cpu import usable_cores
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.runtime.pool import EnginePool
from minisgl_cli.runtime.remote import RemoteClient
from minisgl_cli.runtime.scheduler_proc import RankJob, run_rank
from minisgl_cli.runtime.supervisor import Runtime, wait_ready
from minisgl_cli.runtime.tokenizer_proc import WorkerJob, run_worker
from minisgl_cli.scheduler.scheduler import SchedulerConfig


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
           stop: threading.Event | None = None, per_replica_cap: int | None = None) -> EngineClient | Runtime:
    """Start this node's processes. Node 0 gets its client — a RemoteClient, or with --dp > 1 an EnginePool over
    one per replica (`per_replica_cap`: MAX_INFLIGHT_PER_ENGINE); other nodes (ranks only) get their Runtime.

    Call it from the thread that outlives the runtime (the main thread): children are killed when the
    thread that started them ends (PR_SET_PDEATHSIG). Setting `stop` abandons the start (KeyboardInterrupt)."""
    t0 = time.monotonic()
    # Resolve here, once: a GGUF is converted before any child starts, so the children only find its cache.
    model_dir = model_dir_of(engine)
    runtimes: list[Runtime] = []
    try:
        for replica in range(rt.dp_size):  # every replica's children start side by side
            runtimes.append(_start(engine, scheduler, rt, replica, model_dir))
            for name, proc in runtimes[-1].procs.items():
                progress(f"starting {runtimes[-1].label}{name} (pid {proc.pid})")
    except BaseException:
        for runtime in runtimes:
            runtime.shutdown()
        raise
    ready = wait_ready(runtimes, progress, t0, stop)
    for runtime in runtimes:
        runtime.watch()
    if rt.dist.node_rank != 0:
        return runtimes[0]
    clients = []
    for runtime, replica_ready in zip(runtimes, ready):
        info = replica_ready["scheduler rank 0"].info
        assert info is not None
        # --dp: the pool routes by the prompts' ids, so they come back from the workers (not kept there)
        clients.append(RemoteClient(info, runtime.endpoints, rt.num_tokenizer, runtime, keep_prompts=rt.dp_size == 1))
    if rt.dp_size == 1:
        return clients[0]
    pool = EnginePool(clients, rt.dispatch, per_replica_cap)
    for i, client in enumerate(clients):  # a replica that dies is taken out at once (its streams already ended)
        client.runtime.on_death(functools.partial(pool.take_out, i))
    return pool


def _start(engine: EngineConfig, scheduler: SchedulerConfig, rt: RuntimeConfig, replica: int,
           model_dir: str | None) -> Runtime:
    """Start one replica's children on this node: detokenizer and tokenizer workers (node 0), its TP ranks."""
    runtime = Runtime(f"replica {replica} " if rt.dp_size > 1 else "")
    ep = runtime.endpoints
    level = logging.getLogger("minisgl").getEffectiveLevel()
    dist = rt.replica_dist(replica)
    # CPU: the ranks sharing this host split its cores instead of each running torch's all-core default.
    share = rt.dp_size * dist.ranks_per_node
    threads = max(1, usable_cores() // share) if share > 1 and engine.num_threads is None else engine.num_threads
    try:
        if dist.node_rank == 0:
            runtime.start("detokenizer", run_worker, WorkerJob(-1, model_dir, ep, rt.num_tokenizer == 0, True, level,
                                                                rt.stream_interval))
            for i in range(rt.num_tokenizer):
                runtime.start(f"tokenizer {i}", run_worker, WorkerJob(i, model_dir, ep, True, False, level))
        first = dist.local_ranks()[0]
        for rank in dist.local_ranks():
            device = replica * dist.ranks_per_node + rank - first  # replica i: its own slice of the devices
            runtime.start(f"scheduler rank {rank}", run_rank,
                          RankJob(rank, device, engine, scheduler, dist, ep, level, threads, notice.shown()))
    except BaseException:
        runtime.shutdown()
        raise
    return runtime
