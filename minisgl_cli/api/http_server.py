"""A real uvicorn server on a daemon thread, and a free loopback port: what `serve`, `router`, bench and the
tests start an ASGI app with."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import httpx
import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """A real uvicorn server on a daemon thread (loopback and a free port by default):
    `with BackgroundServer(app) as url:`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 30.0,
                 log_level: str = "warning", graceful_s: int = 2):
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level=log_level,
                                                    timeout_graceful_shutdown=graceful_s))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.startup_timeout = startup_timeout
        self.graceful_s = graceful_s

    def start(self, healthy: bool = True) -> str:
        """Start and wait until it listens (and, if `healthy`, until /health says 200)."""
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError(f"could not serve on {self.host}:{self.port} (in use, or not an address here?)")
            if self.server.started and (not healthy or self._health() == 200):
                return self.url
            time.sleep(0.05)
        raise RuntimeError(f"server at {self.url} did not become healthy")

    def _health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def running(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=self.graceful_s + 5)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
