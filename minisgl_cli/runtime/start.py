"""start_client(): where the engine runs — in the caller's process or as the multi-process runtime — chosen here, once,
for every caller (`LLM`, every command).

In this process, the scheduler runs on a thread beside the caller's own work and shares its GIL: a fast GPU then waits
on whatever the caller does per token. As processes (tokenizer / detokenizer workers, one scheduler per TP rank), the
caller holds only the client. The hf and mlx engines always run in this process (they have no scheduler to move).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from minisgl_cli import backends
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from minisgl_cli.client.protocol import EngineClient
    from minisgl_cli.runtime.supervisor import Runtime


def runs_as_processes(engine: EngineConfig, runtime: RuntimeConfig, by_default: bool) -> bool:
    """Whether `engine` runs as the multi-process runtime: `runtime.mode` (`by_default`: the caller's choice for
    auto; --tp, --dp, --nnodes > 1 always), never for the hf and mlx engines."""
    return backends.resolve(engine.engine) not in backends.SERIAL and runtime.processes(by_default)


def start_client(engine: EngineConfig, scheduler: SchedulerConfig | None = None, runtime: RuntimeConfig | None = None,
                 *, by_default: bool = False, progress: Callable[[str], None] = lambda line: None,
                 stop: threading.Event | None = None, per_replica_cap: int | None = None) -> EngineClient | Runtime:
    """The engine's client: a LocalClient (or the hf / mlx engine's) in this process, or the multi-process runtime's
    RemoteClient, an EnginePool over --dp replicas (`per_replica_cap`: requests in flight per replica at most), as
    `runs_as_processes` says. On a node other than 0 (`node_rank`), the Runtime of this node's ranks.

    Processes: a line to `progress` as each child starts and is ready; `stop` set abandons the start
    (KeyboardInterrupt); every child is stopped by the client's close(), and killed with the thread that started
    it (call this from a thread that outlives the client: the main thread)."""
    scheduler = scheduler or SchedulerConfig()
    runtime = runtime or RuntimeConfig()
    if not runs_as_processes(engine, runtime, by_default):
        return backends.in_process_client(engine, scheduler)
    from minisgl_cli.runtime.launch import launch

    return launch(engine, scheduler, runtime, progress=progress, stop=stop, per_replica_cap=per_replica_cap)
