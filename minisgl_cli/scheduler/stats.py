"""Rolling token rates for the scheduler's figures (the figures themselves: `types.SchedulerStats`)."""

from __future__ import annotations

import time
from collections import deque


class RollingRate:
    """Tokens per second over the last `window` seconds (from the oldest event still in it to now), so a
    burst reads at its own rate while it lasts and fades to 0 a window after it ends.

    `active`: over the time from the window's first event to its last instead (the first one's tokens not counted,
    being made before it): the rate while events came, which idle time after them does not lower. The decode
    rate is this: decode steps follow each other while any request runs, so it reads the decode speed
    (docs/server.md, /metrics)."""

    def __init__(self, window: float = 10.0, active: bool = False):
        self.window = window
        self.active = active
        self.events: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float | None = None) -> None:
        self.events.append((now or time.perf_counter(), n))

    def rate(self, now: float | None = None) -> float:
        now = now or time.perf_counter()
        while self.events and self.events[0][0] < now - self.window:
            self.events.popleft()
        if not self.events:
            return 0.0
        if self.active:
            if len(self.events) < 2:
                return 0.0
            return sum(n for _, n in list(self.events)[1:]) / max(self.events[-1][0] - self.events[0][0], 1e-6)
        span = max(now - self.events[0][0], 1e-3)
        return sum(n for _, n in self.events) / span
