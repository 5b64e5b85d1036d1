"""Runtime: this node's child processes — start them, wait until each is ready, watch for a death, stop them.

A watcher thread notices the first child to die: it logs one line naming it and calls the death hooks
(the client fails its open streams; `minisgl serve` exits non-zero). Children are killed with their
parent whatever happens to it (see `ipc.die_with_parent`); `shutdown` stops all of them within 5 s.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import cast

import zmq

from minisgl_cli.messages import Failed, Ready
from minisgl_cli.runtime.ipc import Endpoints, pull, recv

log = logging.getLogger("minisgl.runtime")

START_TIMEOUT_S = 900.0  # loading an 8B checkpoint and capturing CUDA graphs takes minutes on a slow disk
STOP_TIMEOUT_S = 5.0


class Runtime:
    """This node's child processes and their private ipc directory."""

    def __init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="minisgl-")
        os.chmod(self.root, 0o700)  # the sockets are the engine's doors: this user only
        self.endpoints = Endpoints(self.root)
        self.procs: dict[str, BaseProcess] = {}  # spawn-context processes
        self.stopping = False
        self.dead: str | None = None  # the first child's death, in one line
        self._died = threading.Event()
        self._hooks: list[Callable[[str], None]] = []

    def start(self, name: str, target: Callable, job: object) -> None:
        proc = mp.get_context("spawn").Process(target=target, args=(job,), name=f"minisgl {name}", daemon=False)
        proc.start()
        self.procs[name] = proc

    def wait_ready(self, progress: Callable[[str], None], t0: float,
                   stop: threading.Event | None = None) -> dict[str, Ready]:
        """Every child's Ready, printing a line per child; RuntimeError (children stopped) on any failure,
        KeyboardInterrupt (children stopped) once `stop` is set."""
        ctx = zmq.Context()
        sock = pull(ctx, self.endpoints.launcher)
        ready: dict[str, Ready] = {}
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while len(ready) < len(self.procs):
                if stop is not None and stop.is_set():
                    raise KeyboardInterrupt
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the runtime did not start within {START_TIMEOUT_S:.0f}s")
                if sock.poll(200):
                    msg = recv(sock)
                    if isinstance(msg, Failed):
                        raise RuntimeError(f"{msg.proc} failed to start: {msg.error}")
                    ready[msg.proc] = msg
                    progress(
                        f"{msg.proc} ready{': ' + msg.detail if msg.detail else ''} ({time.monotonic() - t0:.1f}s)"
                    )
                for name, proc in self.procs.items():
                    if name not in ready and proc.exitcode is not None:
                        if stop is not None and stop.is_set():  # the same signal reached the whole group
                            raise KeyboardInterrupt
                        raise RuntimeError(f"{name} exited with code {proc.exitcode} while starting")
        except BaseException:
            self.shutdown()
            raise
        finally:
            ctx.destroy(linger=0)
        return ready

    def on_death(self, hook: Callable[[str], None]) -> None:
        """Call hook(reason) on the watcher thread when a child dies (not when `shutdown` stops them)."""
        self._hooks.append(hook)

    def watch(self) -> None:
        """A thread that reports the first child to die (unless we are stopping them)."""

        def run() -> None:
            sentinels = {p.sentinel: name for name, p in self.procs.items()}
            first = multiprocessing.connection.wait(list(sentinels))[0]
            if self.stopping:
                return
            name = sentinels[cast(int, first)]  # wait() returns the sentinels it was given
            proc = self.procs[name]
            proc.join(1.0)  # the sentinel fires as it dies; the exit code follows
            self.dead = f"{name} (pid {proc.pid}) exited with code {proc.exitcode}"
            log.error("minisgl runtime: %s", self.dead)
            self._died.set()
            for hook in self._hooks:
                hook(self.dead)

        threading.Thread(target=run, name="minisgl-watch", daemon=True).start()

    def alive(self) -> bool:
        return self.dead is None and all(p.exitcode is None for p in self.procs.values())

    def wait(self, stop: threading.Event) -> str | None:
        """Block until a child dies (its one-line reason) or `stop` is set (None)."""
        while not stop.is_set():
            if self._died.wait(0.2):
                return self.dead
        return None

    def shutdown(self) -> None:
        """SIGTERM every child, SIGKILL what is left after STOP_TIMEOUT_S; remove the ipc directory."""
        self.stopping = True
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()  # SIGTERM; a child that is already gone is skipped
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event that SIGINT or SIGTERM sets while the block runs (the previous handlers come back after).

    Main thread only (Python delivers signals there): the block polls the event instead of being interrupted."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
