"""Launching the server: `minisgl serve`'s whole life, and uvicorn on a background thread for tests and bench.

`serve` listens at once and answers 503 until the engine is up (a `StartingApp` in front of the real one),
starts the engine on the main thread, then runs until SIGINT / SIGTERM or until the engine dies. Also here:
what runs beside the app — cache warming of WARM_PREFIXES and the optional ZMQ control channel.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from minisgl_cli.api.http_server import BackgroundServer
from minisgl_cli.client.protocol import EngineClient
from minisgl_cli.notice import notice
from minisgl_cli.process_cpu import freeze_startup_heap
from minisgl_cli.runtime.supervisor import stop_on_signals
from minisgl_cli.server.app import create_app, json_metrics, shutdown_app
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


class StartingApp:
    """The ASGI app uvicorn runs from its first second: 503 with an OpenAI error body (and Retry-After) on
    every route until `attach(app)`, then that app. Its lifespan shuts the attached app down."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None

    def attach(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            body = json.dumps({"error": {"message": "the engine is starting (loading the model); retry shortly",
                                         "type": "server_error", "param": None, "code": "starting"}}).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"5")]})
            await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.app is not None:
                    await shutdown_app(self.app)
                await send({"type": "lifespan.shutdown.complete"})
                return


def serve(make_client: Callable[[threading.Event], EngineClient], settings: ServerSettings,
          cfg: LaunchConfig) -> None:
    """Listen, start the engine (`make_client(stop)`, on this thread: it must be the main thread, which
    outlives the engine's processes), serve until SIGINT / SIGTERM, then stop everything within seconds.

    RuntimeError (one line) when the port cannot be bound or the engine dies while serving."""
    starting = StartingApp()
    server = BackgroundServer(starting, cfg.host, cfg.port, log_level=cfg.log_level, graceful_s=5)
    server.start(healthy=False)
    client: EngineClient | None = None
    app: FastAPI | None = None
    control: ControlChannel | None = None
    reason: str | None = None
    # The handler stays through the shutdown: a second Ctrl-C there would otherwise interrupt it half-way, and the
    # interpreter's exit then waits forever on children that were never stopped.
    with stop_on_signals() as stop:
        try:
            client = make_client(stop)
            app = create_app(client, settings)
            if cfg.zmq_control:
                control = ControlChannel(cfg.zmq_endpoint, lambda: json_metrics(app),
                                         lambda text: client.insert_prefix(text).tokens)
                control.start()
            warm(client, cfg.warm_prefixes)
            freeze_startup_heap()
            starting.attach(app)
            notice(f"serving {client.info.name} at {server.url} (OpenAI API at /v1)")
            while not stop.wait(0.2):
                reason = client.failure() or (None if server.running() else "the HTTP server stopped")
                if reason is not None:
                    break
            if reason is None:
                notice("stopping")
        finally:
            if app is not None:  # first: a request waiting on the media worker would hold uvicorn's graceful stop
                app.state.ctx.media.close()
            server.stop()
            if control is not None:
                control.stop()
            if client is not None:
                client.close()
    if reason is not None:
        raise RuntimeError(reason)
