"""The BenchTarget contract every benchmarked stack implements (engine, HTTP server, HF, llama.cpp)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from minisgl_cli.bench.metrics import RequestTiming
from minisgl_cli.bench.workloads import BenchRequest, Case

OnDone = Callable[[], None]  # called once per finished request (drives the progress bar)


@dataclass
class RunOutput:
    """One case run at one concurrency: every request's timing plus the wall-clock duration."""

    timings: list[RequestTiming]
    duration_s: float


class BenchTarget(Protocol):
    name: str  # the label in tables, JSON and plots
    # True when the target's concurrency is fixed (one request at a time): run once, not per level.
    sequential: bool

    def warmup(self, requests: list[BenchRequest]) -> None: ...

    def run(self, case: Case, concurrency: int, on_done: OnDone) -> RunOutput: ...

    def close(self) -> None: ...
