"""Request deadlines: how long one HTTP generation request may take in all (its `timeout`, else the server's
--request-timeout), and the bound that puts on every wait of the request (tokenizing, each engine output).

A wait is bounded by a timer that interrupts it (cancels the waiting task) when the deadline passes. An engine run
arms one timer for all its outputs (`start`, dropped by `cancel` when the run ends): a timer per output would cost
the stream path as much again as the output's own wake-up. What the request started is then aborted by whoever
owns it (an `EngineRun` closes), so a hung or dead engine ends the request by its deadline, as a 504.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from minisgl_cli.types import ErrorCode

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """A request ran past its deadline (a 504: ErrorCode.TIMEOUT)."""

    code = ErrorCode.TIMEOUT

    def __init__(self, seconds: float):
        super().__init__(f"request timed out: not finished within {seconds:g} s (the request's `timeout`, else the "
                         "server's --request-timeout); it was aborted")


class Deadline:
    """`seconds` from now (None: none). `wait(work)` awaits work, or raises DeadlineExceeded once the deadline has
    passed (work not yet started is closed, never run). One task waits at a time: a request's waits follow one
    another."""

    __slots__ = ("seconds", "at", "_loop", "_waiter", "_timer", "_fired")

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self._loop = asyncio.get_running_loop()
        self.at = self._loop.time() + seconds if seconds else None
        self._waiter: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    def start(self) -> None:
        """Arm the one timer every later wait shares (an engine run's outputs), until `cancel`."""
        if self.at is not None and self._timer is None:
            self._timer = self._loop.call_at(self.at, self._expire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._fired = True
        if self._waiter is not None:
            self._waiter.cancel()

    async def wait(self, work: Awaitable[T]) -> T:
        if self.at is None:
            return await work
        if self._fired or self._loop.time() >= self.at:
            close = getattr(work, "close", None)  # a coroutine never awaited would warn
            if close is not None:
                close()
            assert self.seconds is not None
            raise DeadlineExceeded(self.seconds)
        if self._timer is not None:  # the run's timer
            return await self._interruptible(work)
        self.start()  # a timer for this wait alone (tokenizing a prompt)
        try:
            return await self._interruptible(work)
        finally:
            self.cancel()

    async def _interruptible(self, work: Awaitable[T]) -> T:
        task = self._waiter = asyncio.current_task()
        assert task is not None and self.seconds is not None
        try:
            return await work
        except asyncio.CancelledError:
            # The timer's cancel alone is the deadline; with another one too (a hang-up, shutdown), that one goes on
            # (Python 3.10 cannot count them: there the deadline wins that rare tie).
            uncancel = getattr(task, "uncancel", None)  # 3.11+
            if self._fired and (uncancel is None or uncancel() == 0):
                raise DeadlineExceeded(self.seconds) from None
            raise
        finally:
            self._waiter = None
