"""The router processes' figures in shared memory, so that /metrics from any of them reports the whole router.

One row of int64s per router process: its pid, its requests in flight, and for each worker the requests it routed
there and its load there. A process writes only its own row (one writer a row: no lock) each time its figures
change; any process reads every row. A row read while its process writes it may mix old and new figures for an
instant: fine for metrics, and nothing routes by another process's row.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray


@dataclass(frozen=True)
class ProcessFigures:
    """One router process's row."""

    pid: int
    inflight: int
    routed: tuple[int, ...]  # requests routed to each worker so far
    load: tuple[int, ...]  # requests at each worker now

    @property
    def requests(self) -> int:
        return sum(self.routed)

    @classmethod
    def whole(cls, rows: Sequence[ProcessFigures]) -> ProcessFigures:
        """Every process's figures added up, per worker (the whole router's; pid 0: no one process)."""
        return cls(0, sum(r.inflight for r in rows), tuple(map(sum, zip(*(r.routed for r in rows)))),
                   tuple(map(sum, zip(*(r.load for r in rows)))))


class Tally:
    """Every router process's figures (made by the parent, passed to each child as it starts; `claim` its row)."""

    def __init__(self, processes: int, workers: int):
        self.processes, self.workers = processes, workers
        self.width = 2 + 2 * workers
        self.array = RawArray(ctypes.c_int64, processes * self.width)
        self.row = 0

    def claim(self, row: int) -> None:
        """This process writes row `row` from now on."""
        self.row = row
        self.array[row * self.width] = os.getpid()

    def write(self, inflight: int, routed: Sequence[int], load: Sequence[int]) -> None:
        base = self.row * self.width
        self.array[base + 1] = inflight
        self.array[base + 2:base + 2 + self.workers] = list(routed)
        self.array[base + 2 + self.workers:base + self.width] = list(load)

    def rows(self) -> list[ProcessFigures]:
        """Each process's figures (a copy), in row order; rows of processes not yet started are all zeros."""
        a, w = self.array[:], self.workers
        return [ProcessFigures(a[b], a[b + 1], tuple(a[b + 2:b + 2 + w]), tuple(a[b + 2 + w:b + 2 + 2 * w]))
                for b in range(0, len(a), self.width)]
