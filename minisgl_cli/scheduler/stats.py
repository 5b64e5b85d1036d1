"""Rolling token rates for the scheduler's figures (the figures themselves: `types.SchedulerStats`)."""

from __future__ import annotations

import time
from collections import deque


class RollingRate:
    """Tokens per second over the last `window` seconds (from the oldest event still in it to now), so a
    burst reads at its own rate while it lasts and fades to 0 a window after it ends."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self.events: deque[tuple[float, int]] = deque()

    def add(self, n: int, now: float | None = None) -> None:
        self.events.append((now or time.perf_counter(), n))

    def rate(self, now: float | None = None) -> float:
        now = now or time.perf_counter()
        while self.events and self.events[0][0] < now - self.window:
            self.events.popleft()
        if not self.events:
            return 0.0
        span = max(now - self.events[0][0], 1e-3)
        return sum(n for _, n in self.events) / span
