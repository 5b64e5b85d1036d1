"""Admission: `InflightGate` caps engine requests in flight (429 + Retry-After) and downscales max_new_tokens."""

from __future__ import annotations

from minisgl_cli.server.errors import InputError
from minisgl_cli.server.metrics import ServerMetrics
from minisgl_cli.server.settings import ServerSettings

DOWNSCALE_HEADER = "X-Minisgl-Max-Tokens-Downscaled"


def downscale_headers(note: str | None) -> dict[str, str]:
    """The response header reporting an applied downscale ("512->128"); none when it was not applied."""
    return {DOWNSCALE_HEADER: note} if note else {}


class InflightGate:
    """Counts engine requests in flight (one per choice) and sheds load past the cap.

    Lives on the event loop only, so plain integers suffice.
    """

    def __init__(self, settings: ServerSettings, capacity_hint: int, metrics: ServerMetrics):
        self.cap = settings.max_inflight_total or None
        self.capacity = self.cap or capacity_hint  # what "load" is measured against
        self.adaptive = settings.adaptive_max_new_tokens
        self.min_tokens = settings.adaptive_min_tokens
        self.retry_after_s = settings.retry_after_s
        self.inflight = 0
        self.metrics = metrics

    def admit(self, n: int) -> None:
        """Take n slots, or refuse with a 429 that tells the client when to retry."""
        if self.cap is not None and self.inflight + n > self.cap:
            raise InputError(f"server busy: {self.inflight} requests in flight (cap {self.cap}); retry shortly",
                             None, 429, "too_many_requests", {"Retry-After": str(self.retry_after_s)})
        self.inflight += n
        self.metrics.add_inflight(n)

    def release(self, n: int) -> None:
        self.inflight -= n
        self.metrics.add_inflight(-n)

    def downscale(self, requested: int) -> int:
        """Adaptive max_new_tokens: half the budget past 50% load, a quarter past 75% (counted when applied)."""
        if not self.adaptive or requested <= self.min_tokens:
            return requested
        load = self.inflight / max(self.capacity, 1)
        factor = 1.0 if load < 0.5 else 0.5 if load < 0.75 else 0.25
        cut = max(self.min_tokens, int(requested * factor))
        if cut < requested:
            self.metrics.downscale()
        return cut
