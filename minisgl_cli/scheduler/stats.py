"""Scheduler statistics: queue sizes, KV usage, cache hits, rolling throughput (for chat, /metrics, bench)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass


@dataclass
class SchedulerStats:
    waiting: int = 0
    running: int = 0
    tokens_total: int = 0
    tokens_free: int = 0
    tokens_cached: int = 0  # held by the prefix cache (evictable or locked)
    tokens_in_use: int = 0  # held by running requests beyond their cached prefix
    cache_hit_tokens: int = 0
    cache_miss_tokens: int = 0
    cache_hit_requests: int = 0
    cache_miss_requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_tok_s: float = 0.0  # rolling
    decode_tok_s: float = 0.0  # rolling
    steps: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    retracted_requests: int = 0

    @property
    def cache_hit_rate(self) -> float:
        total = self.cache_hit_tokens + self.cache_miss_tokens
        return self.cache_hit_tokens / total if total else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "cache_hit_rate": round(self.cache_hit_rate, 4)}


class RollingRate:
    """Tokens per second over the last `window` seconds."""

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
