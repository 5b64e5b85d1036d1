"""Per-step measurement of the scheduler: StepProfiler (torch.profiler over a window of busy steps, one table per
rank) and StepTrace (one line per step's launch, for the timeline of a whole run).

Set MINISGL_TORCH_PROFILER_DIR (and optionally MINISGL_PROFILE_SKIP / MINISGL_PROFILE_STEPS): after SKIP steps
that ran a batch, the next STEPS are profiled (CPU and, on CUDA, kernels) and `<dir>/<tag>-steps.txt` gets the
wall time and the device's busy time per step, then the ops by device time and by CPU time. The split answers
the first question of a slow step: is the device busy, or waiting for the host?
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from pathlib import Path

import torch

from minisgl_cli import env
from minisgl_cli.process_cpu import GcPauses

log = logging.getLogger("minisgl.profile")
_made = itertools.count()  # a process's schedulers (a benchmark may make one per draw): one trace file each


class StepProfiler:
    def __init__(self, out_dir: Path | None, tag: str, device: torch.device):
        self.out_dir, self.tag, self.device = out_dir, tag, device
        self.skip, self.count = env.profile_steps()
        self._seen = 0
        self._prof: torch.profiler.profile | None = None
        self._t0 = 0.0

    @classmethod
    def from_env(cls, device: torch.device) -> StepProfiler:
        """Off unless MINISGL_TORCH_PROFILER_DIR is set; the tag names this process's TP rank."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return cls(env.torch_profiler_dir(), f"rank{rank}", device)

    def busy_step_done(self) -> None:
        """Call after each step that ran a batch."""
        if self.out_dir is None:
            return
        self._seen += 1
        if self._seen == self.skip:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities)
            self._prof.__enter__()
            self._t0 = time.perf_counter()
        elif self._seen == self.skip + self.count and self._prof is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self._write(wall)
            self._prof, self.out_dir = None, None  # once

    def _write(self, wall_s: float) -> None:
        assert self._prof is not None and self.out_dir is not None
        events = self._prof.key_averages()
        device_us = sum(e.self_device_time_total for e in events)
        n = self.count
        lines = [f"{self.tag}: {n} busy steps after {self.skip}: wall {wall_s / n * 1e3:.3f} ms/step, device busy "
                 f"{device_us / n / 1e3:.3f} ms/step (kernels' own time)", ""]
        if self.device.type == "cuda":
            lines += ["by device time:", events.table(sort_by="self_device_time_total", row_limit=30), ""]
        lines += ["by CPU time:", events.table(sort_by="cpu_time_total", row_limit=30)]
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.tag}-steps.txt"
        path.write_text("\n".join(lines))
        log.warning("profile of %d steps written to %s", n, path)


class StepTrace:
    """MINISGL_STEP_TRACE_DIR: one TSV line per launched step (time.time(), mode, rows, tokens, running, waiting,
    and the ms this process spent in garbage collection since the last launch), written every 1,000 steps and when
    idle; the gaps between launches are the steps' wall times. Off: `record` is never called (the scheduler holds
    None)."""

    FLUSH = 1000

    def __init__(self, path: Path):
        self.path = path
        self._rows: list[str] = []
        self._gc = GcPauses.watch()
        self._gc_seen = 0.0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("time\tmode\trows\ttokens\trunning\twaiting\tgc_ms\n")

    @classmethod
    def from_env(cls) -> StepTrace | None:
        out = env.step_trace_dir()
        if out is None:
            return None
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return cls(out / f"rank{rank}-{os.getpid()}-{next(_made)}-trace.tsv")

    def record(self, mode: str, rows: int, tokens: int, running: int, waiting: int) -> None:
        gc_ms, self._gc_seen = (self._gc.total_s - self._gc_seen) * 1e3, self._gc.total_s
        self._rows.append(f"{time.time():.6f}\t{mode}\t{rows}\t{tokens}\t{running}\t{waiting}\t{gc_ms:.1f}\n")
        if len(self._rows) >= self.FLUSH:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        with self.path.open("a") as f:
            f.writelines(self._rows)
        self._rows.clear()

    def close(self) -> None:
        """The rest on disk; the collector no longer watched for it."""
        self.flush()
        self._gc.stop()
