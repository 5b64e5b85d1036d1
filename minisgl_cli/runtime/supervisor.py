"""Runtime: this node's child processes — start them, wait until each is ready, watch for a death, stop them.

A watcher thread notices the first child to die and calls the death hooks with one line naming it (the client
fails its open streams with it; `minisgl serve` exits non-zero with it as its one line). Children are killed with their
parent whatever happens to it (see `child.die_with_parent`); `shutdown` stops all of them within 5 s.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Any, cast

import zmq

from minisgl_cli.messages import Failed, Ready
from minisgl_cli.process_cpu import cpu_seconds
from minisgl_cli.runtime.ipc import Endpoints, pull, recv
from minisgl_cli.vision import pixels

log = logging.getLogger("minisgl.runtime")

START_TIMEOUT_S = 900.0  # loading an 8B checkpoint and capturing CUDA graphs takes minutes on a slow disk
STOP_TIMEOUT_S = 5.0


class Runtime:
    """This node's child processes and their private ipc directory; `label` names the replica they make up
    ("replica 1 ") in every line about them."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.root = tempfile.mkdtemp(prefix="minisgl-")
        os.chmod(self.root, 0o700)  # the sockets are the engine's doors: this user only
        self.endpoints = Endpoints(self.root)
        self.procs: dict[str, BaseProcess] = {}  # spawn-context processes
        self.ready: dict[str, Ready] = {}
        self.stopping = False
        self.dead: str | None = None  # the first child's death, in one line
        self._died = threading.Event()
        self._hooks: list[Callable[[str], None]] = []
        # Bound before any child starts, so a child's Ready or Failed waits here however long we take to read it.
        self._ctx: zmq.Context | None = zmq.Context()
        self._launcher: zmq.Socket | None = pull(self._ctx, self.endpoints.launcher)

    def start(self, name: str, target: Callable, job: object) -> None:
        proc = mp.get_context("spawn").Process(target=target, args=(job,), name=f"minisgl {name}", daemon=False)
        proc.start()
        self.procs[name] = proc

    def wait_ready(self, progress: Callable[[str], None], t0: float,
                   stop: threading.Event | None = None) -> dict[str, Ready]:
        """Every child's Ready, printing a line per child; RuntimeError (children stopped) on any failure,
        KeyboardInterrupt (children stopped) once `stop` is set."""
        return wait_ready([self], progress, t0, stop)[0]

    def _poll(self, progress: Callable[[str], None], t0: float, stop: threading.Event | None, ms: int) -> None:
        """Take the Ready / Failed messages that arrive within `ms`; raise on a failure or a death."""
        assert self._launcher is not None
        if self._launcher.poll(ms):
            msg = recv(self._launcher)
            if isinstance(msg, Failed):
                raise RuntimeError(f"{self.label}{msg.proc} failed to start: {msg.error}")
            self.ready[msg.proc] = msg
            progress(f"{self.label}{msg.proc} ready{': ' + msg.detail if msg.detail else ''} "
                     f"({time.monotonic() - t0:.1f}s)")
        for name, proc in self.procs.items():
            if name not in self.ready and proc.exitcode is not None:
                if stop is not None and stop.is_set():  # the same signal reached the whole group
                    raise KeyboardInterrupt
                raise RuntimeError(f"{self.label}{name} exited with code {proc.exitcode} while starting")

    def _started(self) -> bool:
        if len(self.ready) < len(self.procs):
            return False
        self._close_launcher()
        return True

    def _close_launcher(self) -> None:
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = self._launcher = None

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
            self.dead = f"{self.label}{name} (pid {proc.pid}) exited with code {proc.exitcode}"
            log.info("minisgl runtime: %s", self.dead)  # said by whoever the hooks tell (serve's error line)
            self._died.set()
            for hook in self._hooks:
                hook(self.dead)

        threading.Thread(target=run, name="minisgl-watch", daemon=True).start()

    def cpu_seconds(self) -> dict[str, float]:
        """Each running child's CPU seconds so far (user + system), by its name with the replica's label."""
        out = {}
        for name, proc in self.procs.items():
            if proc.pid is not None and proc.exitcode is None and (s := cpu_seconds(proc.pid)) is not None:
                out[f"{self.label}{name}"] = s
        return out

    def alive(self) -> bool:
        return self.dead is None and all(p.exitcode is None for p in self.procs.values())

    def wait(self, stop: threading.Event) -> str | None:
        """Block until a child dies (its one-line reason) or `stop` is set (None)."""
        while not stop.is_set():
            if self._died.wait(0.2):
                return self.dead
        return None

    def shutdown(self) -> None:
        """SIGTERM every child (each stops through its own clean-up and exits 0), SIGKILL what is left after
        STOP_TIMEOUT_S (saying so); remove the ipc directory."""
        self.stopping = True
        for p in self.procs.values():
            if p.exitcode is None:
                p.terminate()  # SIGTERM; a child that is already gone is skipped
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        for name, p in self.procs.items():
            if p.exitcode is None:  # its stop path hung (each child's exits 0 on SIGTERM)
                log.warning("minisgl runtime: %s%s did not stop within %.0fs: killed", self.label, name, STOP_TIMEOUT_S)
                p.kill()
                p.join(1.0)
            if p.pid is not None:  # image pixels its tokenizer workers wrote and no scheduler read
                pixels.sweep(p.pid)
        log.info("minisgl runtime: stopped (%s)", ", ".join(f"{self.label}{n} exit {p.exitcode}"
                                                            for n, p in self.procs.items()))
        self._close_launcher()
        shutil.rmtree(self.root, ignore_errors=True)


def wait_ready(runtimes: list[Runtime], progress: Callable[[str], None], t0: float,
               stop: threading.Event | None = None) -> list[dict[str, Ready]]:
    """Every child's Ready in each runtime (they start side by side), a line per child. On any failure every
    runtime is stopped and RuntimeError raised; once `stop` is set, the same with KeyboardInterrupt."""
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(rt._started() for rt in runtimes):
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            if time.monotonic() > deadline:
                raise RuntimeError(f"the runtime did not start within {START_TIMEOUT_S:.0f}s")
            for rt in runtimes:
                if not rt._started():
                    rt._poll(progress, t0, stop, max(20, 200 // len(runtimes)))
    except BaseException:
        for rt in runtimes:
            rt.shutdown()
        raise
    return [rt.ready for rt in runtimes]


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event that SIGINT or SIGTERM sets while the block runs, for a process that ends after it (serve, the
    router, a node's ranks); a signal after the block ends the process at once (`exit_now`).

    Main thread only (Python delivers signals there): the block polls the event instead of being interrupted.
    The default handlers do not come back: a third Ctrl-C would then land in the interpreter's exit as a
    KeyboardInterrupt traceback from whichever atexit hook it interrupts."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, exit_now)


def exit_now(signum: int, frame: Any) -> None:
    """A signal handler for a process whose shutdown is done: flush, and exit with the shell's 128 + signal."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)
