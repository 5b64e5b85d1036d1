"""Time spent inside chosen methods, summed by label: how the benchmarks split a step's host work."""

from __future__ import annotations

import time
from collections.abc import Callable


def accumulate(owner: object, attr: str, label: str, into: dict[str, float],
               clock: Callable[[], float] = time.perf_counter) -> None:
    """Wrap owner.attr so that each call adds the `clock` time it took to into[label]."""
    fn = getattr(owner, attr)

    def wrapped(*a, **kw):
        t0 = clock()
        try:
            return fn(*a, **kw)
        finally:
            into[label] = into.get(label, 0.0) + clock() - t0

    setattr(owner, attr, wrapped)
