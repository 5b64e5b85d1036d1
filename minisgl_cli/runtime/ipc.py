"""ZMQ plumbing of the runtime: where each process listens, and typed send / receive of `messages`.

Every process owns one PULL socket it binds (`ipc://` in a private temporary directory) and PUSHes
to the others' addresses. PUSH/PULL keeps order between one sender and one receiver and never drops
a message, which is all the runtime needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import zmq

from minisgl_cli.messages import decode, encode


@dataclass(frozen=True)
class Endpoints:
    """The addresses of one runtime's processes (all under one private directory)."""

    root: str

    def _at(self, name: str) -> str:
        return f"ipc://{os.path.join(self.root, name)}"

    @property
    def api(self) -> str:
        return self._at("api")

    @property
    def launcher(self) -> str:
        return self._at("launcher")

    @property
    def detokenizer(self) -> str:
        return self._at("detokenizer")

    @property
    def scheduler(self) -> str:
        return self._at("scheduler")

    @property
    def media(self) -> str:
        return self._at("media")

    @property
    def media_events(self) -> str:
        return self._at("media-events")

    def tokenizer(self, i: int) -> str:
        return self._at(f"tokenizer-{i}")


def pull(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(addr)
    return sock


def push(ctx: zmq.Context, addr: str, timeout_ms: int = -1) -> zmq.Socket:
    """A PUSH socket to `addr`; with `timeout_ms` a send that cannot leave in time raises zmq.Again."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)  # a message sent just before exit still leaves
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    sock.connect(addr)
    return sock


def send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(encode(msg), copy=False)


def recv(sock: zmq.Socket) -> Any:
    return decode(sock.recv(copy=False).buffer)
