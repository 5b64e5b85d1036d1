"""A process's CPU: its user + system seconds, from /proc/<pid>/stat (Linux; elsewhere unknown), the cores it may
use, its startup heap kept out of the garbage collector's way once it serves, and the collector's pauses."""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_times(pid: int) -> tuple[float, float] | None:
    """User and system CPU seconds the process has used so far; None where it is gone or /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The name (field 2) is in parentheses and may hold spaces: the fields that follow start after the last ")".
    fields = stat[stat.rindex(b")") + 2:].split()
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process has used so far; None where it is gone or /proc is not there."""
    times = cpu_times(pid)
    return None if times is None else sum(times)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask on Linux, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def freeze_startup_heap() -> None:
    """Once a serving process is ready: what it made while starting (imports, the model, the app; ~200k objects where
    torch is imported) out of the cyclic GC's full collections. It allocates per token from then on, and each full
    collection walked that whole heap: ~0.2 s a time, a third of the detokenizer's CPU and a tenth of the API
    process's (examples/fronts_cpu.py, a tiny model on the CPU). Its garbage is collected first, so none is kept."""
    gc.collect()
    gc.freeze()



@dataclass
class GcPauses:
    """The cyclic garbage collector's pauses in this process (every generation) while watched: how many, their
    seconds together and the longest. A pause stops the whole process: in a stage of a pipeline it stalls the stages
    before it too, once their sends fill the queue between (ZMQ's high-water mark)."""

    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    _started: float = 0.0

    def _timed(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.count += 1
        self.total_s += took
        self.max_s = max(self.max_s, took)

    @classmethod
    def watch(cls) -> GcPauses:
        """Start counting (a `gc.callbacks` entry of its own, so watchers do not disturb each other)."""
        pauses = cls()
        gc.callbacks.append(pauses._timed)
        return pauses

    def stop(self) -> GcPauses:
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        return self
