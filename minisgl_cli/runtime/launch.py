"""launch(): start this node's processes — detokenizer, tokenizer workers, one scheduler per TP rank.

It prints a line as each child starts and as each is ready, and returns the API side's `RemoteClient`
(on node 0; other nodes run ranks only and get their `Runtime`, see supervisor.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.runtime.client import RemoteClient
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.runtime.scheduler_proc import RankJob, run_rank
from minisgl_cli.runtime.supervisor import Runtime
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
           stop: threading.Event | None = None) -> RemoteClient | Runtime:
    """Start this node's processes. Node 0 gets the RemoteClient; other nodes (ranks only) the Runtime.

    Call it from the thread that outlives the runtime (the main thread): children are killed when the
    thread that started them ends (PR_SET_PDEATHSIG). Setting `stop` abandons the start (KeyboardInterrupt)."""
    t0 = time.monotonic()
    # Resolve here, once: a GGUF is converted before any child starts, so the children only find its cache.
    model_dir = model_dir_of(engine)
    runtime = Runtime()
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
    ready = runtime.wait_ready(progress, t0, stop)
    runtime.watch()
    if not head:
        return runtime
    info = ready["scheduler rank 0"].info
    assert info is not None
    return RemoteClient(info, ep, rt.num_tokenizer, runtime)
