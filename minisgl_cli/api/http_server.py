"""A real uvicorn server on a daemon thread, a free loopback port, and one port bound for several processes: what
`serve`, `router`, bench and the tests start an ASGI app with; the wait for a `minisgl serve` child's /health."""

from __future__ import annotations

import functools
import socket
import subprocess
import threading
import time
from typing import Any

import httpx
import uvicorn

from minisgl_cli.distributed import free_port


def shared_port(host: str, port: int, n: int, backlog: int = 2048) -> list[socket.socket]:
    """`n` listening sockets on one port (SO_REUSEPORT), one for each process that serves it: the kernel spreads
    the connections over them evenly. RuntimeError (one line) where the port is taken, even by a program that
    holds it with SO_REUSEPORT itself (it would otherwise share our port silently), or not an address here."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        with socket.socket(family) as probe:  # without SO_REUSEPORT: refused where anyone listens on the port
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
            port = probe.getsockname()[1]  # port 0: the one the kernel chose
        for _ in range(n):
            sock = socket.socket(family)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(backlog)
    except OSError as exc:
        for sock in socks:
            sock.close()
        raise RuntimeError(f"could not serve on {host}:{port} ({exc.strerror or exc})") from None
    return socks


def health(url: str) -> int | None:
    """GET url/health's status; None where nothing answers."""
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.HTTPError:
        return None


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 900, poll_s: float = 0.2) -> None:
    """Wait until the server `proc` runs answers url/health with 200. RuntimeError (one line) where `proc` exits
    first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode}")
        if health(url) == 200:
            return
        time.sleep(poll_s)
    raise RuntimeError(f"was not healthy after {timeout_s:.0f} s")


class BackgroundServer:
    """A real uvicorn server on a daemon thread (loopback and a free port by default):
    `with BackgroundServer(app) as url:`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 30.0,
                 log_level: str = "warning", graceful_s: int = 2, sock: socket.socket | None = None):
        if sock is not None:  # already listening (shared_port): serve it instead of binding host:port
            host, port = sock.getsockname()[:2]
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level=log_level,
                                                    timeout_graceful_shutdown=graceful_s))
        run = functools.partial(self.server.run, sockets=[sock] if sock is not None else None)
        self.thread = threading.Thread(target=run, name="uvicorn", daemon=True)
        self.startup_timeout = startup_timeout
        self.graceful_s = graceful_s

    def start(self, healthy: bool = True) -> str:
        """Start and wait until it listens (and, if `healthy`, until /health says 200)."""
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError(f"could not serve on {self.host}:{self.port} (in use, or not an address here?)")
            if self.server.started and (not healthy or health(self.url) == 200):
                return self.url
            time.sleep(0.05)
        raise RuntimeError(f"server at {self.url} did not become healthy")

    def running(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.graceful_s + 5)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
