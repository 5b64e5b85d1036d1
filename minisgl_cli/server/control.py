"""The optional ZMQ control channel: a REP socket on a background thread answering `metrics` and `warm <prefix>`.

Enabled with ZMQ_CONTROL=1 (or --zmq-control); the endpoint is ZMQ_CONTROL_ENDPOINT. One request,
one reply, both UTF-8 text: a command word and an argument. Replies are JSON.

    ping            -> {"ok": true, "reply": "pong"}
    metrics         -> {"ok": true, "metrics": {...the /metrics JSON...}}
    warm <prefix>   -> {"ok": true, "queued_tokens": N}   (prefills <prefix> into the radix cache)
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("minisgl.control")

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


class ControlChannel:
    def __init__(self, endpoint: str, metrics: Callable[[], dict[str, Any]], warm: Callable[[str], int]):
        self.endpoint, self._metrics, self._warm = endpoint, metrics, warm
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._bound = threading.Event()
        self.error: Exception | None = None

    def start(self, timeout: float = 5.0) -> None:
        """Bind and serve on a daemon thread; raise here if the endpoint cannot be bound."""
        self._worker = threading.Thread(target=self._serve, name="minisgl-zmq-control", daemon=True)
        self._worker.start()
        self._bound.wait(timeout)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=2)

    def handle(self, message: str) -> dict[str, Any]:
        command, _, arg = message.strip().partition(" ")
        try:
            if command == "ping":
                return {"ok": True, "reply": "pong"}
            if command == "metrics":
                return {"ok": True, "metrics": self._metrics()}
            if command == "warm":
                if not arg:
                    return {"ok": False, "error": "usage: warm <prefix>"}
                return {"ok": True, "queued_tokens": self._warm(arg)}
            return {"ok": False, "error": f"unknown command {command!r}; try ping, metrics, warm <prefix>"}
        except Exception as exc:  # a bad command must not take the channel down
            log.exception("control command %r failed", command)
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def _serve(self) -> None:
        import zmq

        ctx: zmq.Context = zmq.Context.instance()
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.error = RuntimeError(f"ZMQ control: cannot bind {self.endpoint}: {exc}")
            self._bound.set()
            sock.close()
            return
        self._bound.set()
        log.info("ZMQ control channel on %s", self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not dict(poller.poll(200)):  # poll with a timeout so stop() is honoured
                    continue
                raw = sock.recv()
                reply = self.handle(raw.decode("utf-8", errors="replace"))
                sock.send(json.dumps(reply).encode())
        finally:
            sock.close()
