"""Backpressure: `InflightGate` caps engine requests in flight (429 + Retry-After) and downscales max_new_tokens."""

from __future__ import annotations

from minisgl_cli.api.protocol import MAX_BODY_REQUESTS
from minisgl_cli.server.errors import InputError
from minisgl_cli.server.metrics import ServerMetrics
from minisgl_cli.server.settings import ServerSettings

DOWNSCALE_HEADER = "X-Minisgl-Max-Tokens-Downscaled"
# The default cap: this many of the engine's running slots (--max-running-requests, summed over --dp replicas). A
# request queued behind 16 full batches waits about 16 whole generations; past that a client (or a router) does better
# to retry, or go elsewhere, than to join an ever longer queue. At least the largest body the API takes
# (MAX_BODY_REQUESTS), which an idle server must take.
DEFAULT_CAP_PER_SLOT = 16


def default_cap(max_running: int) -> int:
    return max(MAX_BODY_REQUESTS, DEFAULT_CAP_PER_SLOT * max_running)


def downscale_headers(note: str | None) -> dict[str, str]:
    """The response header reporting an applied downscale ("512->128"); none when it was not applied."""
    return {DOWNSCALE_HEADER: note} if note else {}


class InflightGate:
    """Counts engine requests in flight (one per choice) and sheds load past the cap.

    Lives on the event loop only, so plain integers suffice.
    """

    def __init__(self, settings: ServerSettings, capacity_hint: int, metrics: ServerMetrics):
        total = settings.max_inflight_total
        self.cap = default_cap(capacity_hint) if total is None else total or None  # 0: no cap
        self.capacity = self.cap or capacity_hint  # what "load" is measured against
        self.adaptive = settings.adaptive_max_new_tokens
        self.min_tokens = settings.adaptive_min_tokens
        self.retry_after_s = settings.retry_after_s
        self.inflight = 0
        self.metrics = metrics

    def check(self, n: int, param: str | None = None) -> None:
        """Refuse n engine requests (a body's prompts x n; `param`: the field that multiplies them) before any work:
        413 when they could never fit under the cap, a 429 that tells the client when to retry while they do not
        fit now."""
        if self.cap is None:
            return
        if n > self.cap:
            raise InputError(f"this request asks for {n} completions at once; the server runs at most {self.cap} "
                             "(--max-inflight-total)", param, 413, "request_too_large")
        if self.inflight + n > self.cap:
            raise InputError(f"server busy: {self.inflight} requests in flight (cap {self.cap}); retry shortly",
                             None, 429, "too_many_requests", {"Retry-After": str(self.retry_after_s)})

    def take(self, n: int) -> None:
        """Take n slots, or refuse as `check` does."""
        self.check(n)
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
