"""The workers behind `minisgl router`: each `minisgl serve` URL, whether it answers, and the routing across them.

A background task asks every worker's /health every `interval` seconds. A worker that fails it is taken out —
the `Dispatcher` stops picking it and forgets its prefix tree — and put back as soon as its /health answers 200
again. A check that only times out counts as failed from the SLOW_CHECKS-th in a row: under a full load the
answer can queue behind thousands of stream frames (in the worker's API or this router's own loop) while the
worker serves well, and taking it out then would turn a busy moment into failed requests. Requests count too:
FAILURES_OUT in a row that the worker failed (unreachable, 503, dropped or timed out) take it out, one does not
(a connection reset is not a dead host). Lives on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from minisgl_cli.dispatch import Dispatcher
from minisgl_cli.notice import notice

log = logging.getLogger("minisgl.router")

CHECK_TIMEOUT_S = 2.0
SLOW_CHECKS = 3  # timed-out checks in a row that take a worker out (a refused or non-200 one does at once)
FAILURES_OUT = 3  # requests failed in a row that take a worker out


@dataclass
class Worker:
    index: int
    url: str
    reason: str = "not checked yet"  # why it is out ("" while it serves)
    slow: int = 0  # health checks timed out in a row
    failures: int = 0  # requests it failed in a row


class Workers:
    def __init__(self, urls: Sequence[str], mode: str = "rr", cap: int | None = None, interval: float = 2.0,
                 label: str = ""):
        self.label = label  # which router process says the lines about the workers ("" when it is the only one)
        self.workers = [Worker(i, url.rstrip("/")) for i, url in enumerate(urls)]
        self.dispatcher = Dispatcher(len(urls), mode, cap, up=False)  # each is put in by its first good health check
        self.interval = interval
        self._task: asyncio.Task | None = None

    # --- routing ---------------------------------------------------------------------------------
    def pick(self, key: Sequence[Hashable] | None, exclude: Collection[int] = ()) -> Worker:
        """A worker for a request with this prompt (NoReplica / Busy from the router when there is none)."""
        return self.workers[self.dispatcher.pick(key, exclude)]

    def done(self, w: Worker) -> None:
        self.dispatcher.done(w.index)

    def up(self, w: Worker) -> bool:
        return self.dispatcher.up[w.index]

    def take_out(self, w: Worker, reason: str) -> None:
        if self.dispatcher.set_up(w.index, False) or w.reason == "not checked yet":
            log.warning("minisgl router: %sworker %s is out (%s)", self.label, w.url, reason)
        w.reason = reason

    def put_back(self, w: Worker) -> None:
        if self.dispatcher.set_up(w.index, True):
            notice(f"{self.label}worker {w.url} is {'up' if w.reason == 'not checked yet' else 'back'}")
            w.failures = 0
        w.reason = ""

    def failed(self, w: Worker, reason: str) -> None:
        """A request this worker failed; the FAILURES_OUT-th in a row takes it out."""
        w.failures += 1
        if w.failures >= FAILURES_OUT:
            self.take_out(w, f"{reason} ({w.failures} requests failed in a row)")

    def answered(self, w: Worker) -> None:
        """A request this worker answered (whatever the status): its failures in a row start again."""
        w.failures = 0

    # --- health ----------------------------------------------------------------------------------
    async def check(self, http: httpx.AsyncClient) -> None:
        """Ask every worker's /health once (side by side) and take out or put back accordingly."""

        async def one(w: Worker) -> None:
            try:
                r = await http.get(f"{w.url}/health", timeout=CHECK_TIMEOUT_S)
                ok, why = r.status_code == 200, f"/health answered {r.status_code}"
            except httpx.TimeoutException as exc:
                w.slow += 1
                if w.slow < SLOW_CHECKS and self.up(w):
                    return  # busy, not gone (yet): it keeps serving
                ok, why = False, f"/health failed: {type(exc).__name__} ({w.slow} in a row)"
            except httpx.HTTPError as exc:
                ok, why = False, f"/health failed: {type(exc).__name__}"
            if ok:
                w.slow = 0
                self.put_back(w)
            else:
                self.take_out(w, why)

        await asyncio.gather(*(one(w) for w in self.workers))

    def start(self, http: httpx.AsyncClient) -> None:
        async def loop() -> None:
            while True:
                await self.check(http)
                await asyncio.sleep(self.interval)

        self._task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # --- figures ---------------------------------------------------------------------------------
    async def metrics(self, http: httpx.AsyncClient, headers: dict[str, str] | None, routed: Sequence[int],
                      load: Sequence[int]) -> list[dict[str, Any]]:
        """Each worker: up or out (and why) as this process sees it, requests routed and its load (`routed`, `load`:
        every router process's, from the tally), and its own /metrics scheduler figures (asked with `headers`: the
        client's Authorization, for workers behind --api-key)."""

        async def one(w: Worker) -> dict[str, Any]:
            sched = None
            if self.up(w):
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                    r = await http.get(f"{w.url}/metrics", params={"format": "json"}, headers=headers,
                                       timeout=CHECK_TIMEOUT_S)
                    sched = r.json()["scheduler"] if r.status_code == 200 else None
            return {"url": w.url, "alive": self.up(w), "reason": w.reason or None,
                    "requests": routed[w.index], "inflight": load[w.index],
                    "cache_hit_rate": sched.get("cache_hit_rate") if sched else None, "scheduler": sched}

        return list(await asyncio.gather(*(one(w) for w in self.workers)))
