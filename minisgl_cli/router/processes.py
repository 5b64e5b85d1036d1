"""How `minisgl router` runs: the app in this process, or N router processes on one port under this one.

One Python process relays a few tens of thousands of SSE frames a second (one per token per stream): less than
two fast GPU servers stream. With `--processes N` each of N child processes runs the whole router app (app.py) on
its own listening socket of the same port (SO_REUSEPORT: the kernel spreads the connections over them), with its
own client to the workers, health checks and routing state; the caps are split among them, and their figures
meet in a `Tally` so that /metrics from any of them is the whole router's. This process binds the port, starts
them (runtime/supervisor.py's `Runtime`, as `serve` starts its engine's children), serves nothing itself, and
stops them all on SIGINT / SIGTERM. A child that dies takes the router down with a one-line reason and exit 1,
as an engine child takes `serve` down: whatever supervises the router (systemd, k8s) sees it and restarts it.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace

from fastapi import FastAPI

from minisgl_cli import notice
from minisgl_cli.api.http_server import BackgroundServer, shared_port
from minisgl_cli.process_cpu import usable_cores
from minisgl_cli.router.app import create_router_app
from minisgl_cli.router.tally import Tally
from minisgl_cli.runtime.child import Child, leave
from minisgl_cli.runtime.supervisor import Runtime, stop_on_signals

log = logging.getLogger("minisgl.router")

MAX_AUTO_PROCESSES = 4  # ~100k frames/s: past what two GPU servers stream, each a process's memory and cap share
SPREADS = sys.platform.startswith("linux")  # SO_REUSEPORT balances connections on Linux; elsewhere one socket takes all
GRACEFUL_S = 3  # a child's uvicorn lets open requests finish this long: within the runtime's 5 s before SIGKILL


@dataclass(frozen=True)
class RouterConfig:
    """What every router process routes by: the workers, the policy, the caps (the whole router's), the health
    checks' interval and the seconds a worker may send nothing while it has a request (None: no limit)."""

    urls: tuple[str, ...]
    mode: str = "rr"
    per_worker_cap: int | None = None
    total_cap: int | None = None
    health_interval: float = 2.0
    request_timeout: float | None = None

    def app(self, tally: Tally | None = None, label: str = "") -> FastAPI:
        return create_router_app(self.urls, self.mode, self.per_worker_cap, self.total_cap, self.health_interval,
                                 tally, label, self.request_timeout)

    def share(self, processes: int, i: int) -> RouterConfig:
        """Process i's of `processes`: each cap split so that the parts add up to it."""
        return replace(self, per_worker_cap=split(self.per_worker_cap, processes, i),
                       total_cap=split(self.total_cap, processes, i))

    def max_processes(self) -> int | None:
        """The most processes the caps split over (each needs a cap of at least 1); None without a cap."""
        caps = [c for c in (self.per_worker_cap, self.total_cap) if c]
        return min(caps) if caps else None


def split(cap: int | None, n: int, i: int) -> int | None:
    """Part i of `cap` over n processes (None: no cap); the parts differ by one at most and add up to it."""
    return None if cap is None else cap // n + (i < cap % n)


def auto_processes(cfg: RouterConfig) -> int:
    """--processes 0: one process for cache_aware (its prefix trees see every prompt only in one) and where the
    kernel does not spread a port's connections (`SPREADS`), else one per core up to MAX_AUTO_PROCESSES, and no
    more than the caps split over."""
    if cfg.mode == "cache_aware" or not SPREADS:
        return 1
    return max(1, min(MAX_AUTO_PROCESSES, usable_cores(), cfg.max_processes() or MAX_AUTO_PROCESSES))


def run_router(cfg: RouterConfig, host: str, port: int, processes: int = 1, log_level: str = "warning") -> None:
    """Serve the router until SIGINT / SIGTERM: in this process, or in `processes` children. RuntimeError in one
    line if the port cannot be bound, a child cannot start, or one dies."""
    if processes == 1:
        _serve_here(cfg.app(), host, port, log_level)
        return
    t0 = time.monotonic()
    socks = shared_port(host, port, processes)
    url = f"http://{host}:{socks[0].getsockname()[1]}"
    tally = Tally(processes, len(cfg.urls))
    runtime = Runtime()
    reason: str | None = None
    with stop_on_signals() as stop:  # through the shutdown too: a second Ctrl-C must not cut it short
        try:
            try:
                for i, sock in enumerate(socks):
                    name = f"router {i}"
                    runtime.start(name, _child, _Job(i, cfg.share(processes, i), sock, tally, log_level,
                                                     logging.getLogger("minisgl").getEffectiveLevel(),
                                                     runtime.endpoints.launcher, notice.shown()))
                    notice.notice(f"starting {name} (pid {runtime.procs[name].pid})")
            finally:
                for sock in socks:  # the children hold theirs: a child's socket goes with it, and its connections
                    sock.close()
            runtime.wait_ready(notice.notice, t0, stop)
            runtime.watch()
            notice.notice(f"router for {len(cfg.urls)} workers ({cfg.mode}) in {processes} processes at {url} "
                          "(OpenAI API at /v1)")
            reason = runtime.wait(stop)
            if reason is None:
                notice.notice("stopping")
        except KeyboardInterrupt:  # stopped while the children started
            notice.notice("stopping")
        finally:
            runtime.shutdown()
    if reason is not None:
        raise RuntimeError(reason)


def _serve_here(app: FastAPI, host: str, port: int, log_level: str) -> None:
    server = BackgroundServer(app, host, port, log_level=log_level, graceful_s=5)
    server.start(healthy=False)
    workers = app.state.workers
    notice.notice(f"router for {len(workers.workers)} workers ({workers.dispatcher.mode}) at {server.url} "
                  "(OpenAI API at /v1)")
    with stop_on_signals() as stop:  # through the shutdown too: a second Ctrl-C must not cut it short
        try:
            while not stop.wait(0.2):
                if not server.running():
                    raise RuntimeError("the HTTP server stopped")
            notice.notice("stopping")
        finally:
            server.stop()


@dataclass
class _Job:
    """One router child's start: its row in the tally, its share of the caps, its socket of the port."""

    index: int
    cfg: RouterConfig
    sock: socket.socket  # pickled as the child is spawned: multiprocessing hands it a duplicate of the fd
    tally: Tally
    uvicorn_log_level: str
    log_level: int
    launcher: str
    notices: bool


def _child(job: _Job) -> None:
    """A router child's entry point: serve its socket until SIGTERM (the parent's stop), then exit 0."""
    child = Child(f"router {job.index}", f"router{job.index}", job.log_level, job.launcher)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if job.notices:
        notice.show()

    def build(_ctx: object) -> BackgroundServer:
        job.tally.claim(job.index)
        app = job.cfg.app(job.tally, f"router {job.index}: ")
        server = BackgroundServer(app, log_level=job.uvicorn_log_level, graceful_s=GRACEFUL_S, sock=job.sock)
        server.start(healthy=False)
        return server

    server = child.start(build)
    child.ready()
    while not stop.wait(0.2):
        if not server.running():
            log.error("minisgl router: router %d: the HTTP server stopped", job.index)
            leave(1)
    server.stop()
    leave()
