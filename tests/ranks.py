"""Spawned TP ranks for tests: `run_ranks(target, world, *args)` runs target(rank, addr, out, *args) in `world`
processes that meet at a free loopback port, and returns what each put in `out` as (rank, value)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 240.0) -> dict[int, Any]:
    """Each rank's value by rank (queue.Empty when one gives none within `timeout`); whatever still runs after is
    killed."""
    from minisgl_cli.api.http_server import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=target, args=(r, addr, out, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
