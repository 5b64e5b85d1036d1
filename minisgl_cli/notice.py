"""Notices: the status lines a user sees at the default log level, as `minisgl: <line>` on stderr, from any process.

Logs (the `minisgl.*` loggers, WARNING unless -v) narrate and warn; a notice says what happens: the engine starts,
the server is up, the CPU decode is compiled, the server stops. It is the `minisgl.notice` logger at INFO, printed
once a command (or a child process of one) calls `show()`: a program using the Python API sees none unless it
configures logging itself.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("minisgl.notice")


def notice(line: str) -> None:
    log.info(line)


class _Stderr(logging.Handler):
    """Writes to the sys.stderr of the moment (a test runner swaps it per command)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(f"minisgl: {record.getMessage()}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: never raise from a handler
            self.handleError(record)


def show() -> None:
    """Print notices from now on, whatever the log level (once per process)."""
    if not shown():
        log.addHandler(_Stderr())
        log.setLevel(logging.INFO)
        log.propagate = False  # not twice under -v, and never in the timestamped log format


def shown() -> bool:
    return any(isinstance(h, _Stderr) for h in log.handlers)
