"""The BenchTarget contract every benchmarked stack implements (engine, HTTP server, HF, llama.cpp)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from minisgl_cli.bench.metrics import RequestTiming
from minisgl_cli.bench.workloads import BenchRequest, Case
from minisgl_cli.process_cpu import GcPauses

OnDone = Callable[[], None]  # called once per finished request (drives the progress bar)


@dataclass
class ClientCpu:
    """One client process's CPU over a timed run (user + system seconds), the run's wall time there, and its garbage
    collector's pauses meanwhile (a client that pauses holds back what it would send and read)."""

    cpu_s: float
    wall_s: float
    gc_s: float = 0.0
    gc_max_s: float = 0.0

    @property
    def core_share(self) -> float:
        """Its share of one core: near 1 the client, not the server, sets the pace."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0


class ClientClock:
    """This process's CPU, wall time and collector pauses from its making to `stop`: a client process's part of a
    timed run. `t0` is perf_counter's (the host's monotonic clock: every process reads the same one)."""

    def __init__(self) -> None:
        self._pauses = GcPauses.watch()
        self.started_at = time.time()
        self._cpu0, self.t0 = time.process_time(), time.perf_counter()

    def stop(self) -> ClientCpu:
        cpu, wall = time.process_time() - self._cpu0, time.perf_counter() - self.t0
        self._pauses.stop()
        return ClientCpu(cpu, wall, self._pauses.total_s, self._pauses.max_s)


@dataclass
class RunOutput:
    """One case run at one concurrency: every request's timing plus the wall-clock duration, and the CPU of each
    client process where the target measures it (the HTTP client, the offline one of an engine in other processes;
    empty where the client shares the engine's process)."""

    timings: list[RequestTiming]
    duration_s: float
    client_cpu: list[ClientCpu] = field(default_factory=list)
    started_at: float | None = None  # time.time() as duration_s began, where later than the call (client spawns)


class BenchTarget(Protocol):
    name: str  # the label in tables, JSON and plots
    # True when the target's concurrency is fixed (one request at a time): run once, not per level.
    sequential: bool

    def warmup(self, requests: list[BenchRequest]) -> None: ...

    def run(self, case: Case, concurrency: int, on_done: OnDone) -> RunOutput: ...

    def close(self) -> None: ...
