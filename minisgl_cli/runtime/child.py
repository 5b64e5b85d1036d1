"""A runtime child process's start: it dies with its parent, logs under its name, and reports Ready or Failed.

Every child (scheduler ranks, tokenizer workers, the detokenizer, the media worker) starts the same way:

    child = Child("detokenizer", "detokenizer", log_level, endpoints.launcher)
    worker = child.start(partial(build, job))  # a failure: one Failed line to the launcher, exit 1
    child.ready()
    worker.serve()
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn, TypeVar

import zmq

from minisgl_cli.messages import Failed, Ready
from minisgl_cli.process_cpu import freeze_startup_heap
from minisgl_cli.runtime.ipc import push, send
from minisgl_cli.types import ModelInfo

log = logging.getLogger("minisgl.runtime")
T = TypeVar("T")


def die_with_parent() -> None:
    """In a child process: be killed when the parent dies, however it dies (even kill -9): no orphans.

    Ctrl-C reaches the whole process group; the parent stops its children itself, so they ignore it. SIGUSR1 prints
    every thread's stack to stderr (`kill -USR1 PID`): where a stuck rank waits, without stopping it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent was already gone before prctl took effect
        os._exit(1)


def no_process_locks() -> None:
    """Give tqdm a thread lock before anything draws a bar (torch.compile's tracer does, even hidden; a diffusers
    pipeline makes one per call, disabled or not): its default is a multiprocessing lock, a named semaphore that a
    child, which leaves through os._exit, would leave behind for the resource tracker to warn about at the server's
    exit ("leaked semaphore objects"). No bar here is shared with another process."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


class Child:
    """This process as one of the runtime's children, named `name` in the launcher's lines and `log_tag` in
    its log lines. Made first thing in the child's entry point; it holds the zmq context and the launcher
    socket for the life of the process."""

    def __init__(self, name: str, log_tag: str, log_level: int, launcher: str):
        die_with_parent()
        no_process_locks()
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s {log_tag} %(name)s: %(message)s",
                            datefmt="%H:%M:%S")
        self.name = name
        self.ctx = zmq.Context()
        self.launcher = push(self.ctx, launcher)

    def start(self, build: Callable[[zmq.Context], T]) -> T:
        """What the child serves, built on its zmq context; any failure is reported as one line and ends it."""
        try:
            return build(self.ctx)
        except BaseException as exc:  # noqa: BLE001 - any start-up failure is reported as one line
            log.debug("start-up failed:\n%s", traceback.format_exc())
            send(self.launcher, Failed(self.name, f"{type(exc).__name__}: {exc}".strip()))
            self.launcher.close(linger=2000)
            raise SystemExit(1) from None

    def ready(self, info: ModelInfo | None = None, detail: str = "") -> None:
        send(self.launcher, Ready(self.name, info, detail))
        freeze_startup_heap()  # while the launcher waits for the others (a collection: ~0.1 s)


def leave(code: int = 0) -> NoReturn:
    """Exit at once, once the child has handed back what it holds. Not through the interpreter's exit: that tears
    down zmq sockets other threads still block on (it hangs there), and waits for a CPU compile thread (or aborts
    in it)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
