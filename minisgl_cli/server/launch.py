"""Launching the server: uvicorn in the foreground (`minisgl serve`) or on a background thread (tests, bench).

Also starts what runs beside the app: cache warming of WARM_PREFIXES and the optional ZMQ control channel.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn

from minisgl_cli.client import EngineClient
from minisgl_cli.server.app import create_app, json_metrics
from minisgl_cli.server.control import DEFAULT_ENDPOINT, ControlChannel
from minisgl_cli.server.settings import ServerSettings

log = logging.getLogger("minisgl.server")


@dataclass
class LaunchConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    warm_prefixes: list[str] = field(default_factory=list)
    zmq_control: bool = False
    zmq_endpoint: str = DEFAULT_ENDPOINT
    log_level: str = "warning"  # uvicorn's own access/error logs


def warm(client: EngineClient, prefixes: list[str]) -> None:
    """Prefill prefixes into the radix cache in the background; logs when each is cached."""
    for prefix in prefixes:
        if not prefix:
            continue
        done = client.insert_prefix(prefix)
        threading.Thread(target=lambda d=done, p=prefix: log.info("warm prefix cached: %s", p[:60])
                         if d.wait(600) else log.warning("warm prefix not cached yet: %s", p[:60]),
                         daemon=True).start()


def serve(client: EngineClient, settings: ServerSettings, cfg: LaunchConfig) -> None:
    """Run the server until Ctrl-C / SIGTERM; then stop the control channel and the engine."""
    app = create_app(client, settings)
    control = None
    if cfg.zmq_control:
        control = ControlChannel(cfg.zmq_endpoint, lambda: json_metrics(app),
                                 lambda text: client.insert_prefix(text).tokens)
        control.start()
    warm(client, cfg.warm_prefixes)
    log.warning("minisgl serve: %s on http://%s:%d (OpenAI API at /v1)", client.info.name, cfg.host, cfg.port)
    config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                            timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run()
    finally:
        if control is not None:
            control.stop()
        client.close()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """A real uvicorn server on a loopback port, on a daemon thread: `with BackgroundServer(app) as url:`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, startup_timeout: float = 30.0):
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=self.port, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.startup_timeout = startup_timeout

    def start(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn exited during startup")
            try:
                if self.server.started and httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self.url
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server at {self.url} did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
