"""CUDA graphs of a media pipeline's short, repeated passes (the text encoder's, the DiT's block stacks): each input
shape replayed from one graph, captured only after an eager pass of that shape showed it never waits on the device.

Why: on an H200 a Z-Image-Turbo image is ~120 ms of host time the GPU waits through (docs/benchmarks.md, "idle
gaps"): its text encoder is ~500 small launches for ~3 ms of device work, and with FP8 weights a DiT block is short
enough that the host's share of each compiled block shows. A graph replays a whole pass in one launch.

How a shape becomes a graph (`Graphed`): its first call runs eager (torch.compile compiles, lazy state such as cuBLAS
workspaces and RoPE tables settles); its second runs eager under torch's sync debug mode set to raise, which fires
where an op would wait on the device (.item(), a copy from pageable memory, a data-dependent shape) and keeps that
shape eager for good; where it passes, the shape is captured right after, and every later call copies its inputs in
and replays. A capture that fails anyway (an op a graph cannot hold) leaves the shape eager and puts torch's CUDA
generator back out of capture mode: a failed capture leaves it there, and the next random op anywhere would raise.

A replay computes what the eager pass computes, kernel for kernel: the same compiled code, captured.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

MAX_GRAPHS = 16  # shapes kept captured per pass, the least recently used dropped
# Shapes remembered per pass as seen once or as staying eager, the oldest forgotten first: a server asked for ever new
# sizes keeps a bounded record, and a forgotten shape is only checked again.
MAX_KEYS = 256


class Pool:
    """One graph memory pool for a pipeline's graphs: its passes run one at a time, so their graphs share memory.
    `members`: the graphed passes using it."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.members: list[Graphed] = []

    def get(self) -> Any:
        if self.handle is None:
            self.handle = torch.cuda.graph_pool_handle()
        return self.handle


class Graphed:
    """`fn(*args)` (args: tensors, None or plain constants; it returns a tensor or a tuple of them) replayed from a
    CUDA graph per distinct args shape; the results are fresh tensors, as the eager call's are."""

    def __init__(self, fn: Callable[..., Any], pool: Pool, name: str, max_graphs: int = MAX_GRAPHS):
        self.fn, self.pool, self.name, self.max_graphs = fn, pool, name, max_graphs
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, list[Any], Any]] = OrderedDict()
        self.seen: OrderedDict[tuple, None] = OrderedDict()  # shapes run eager once, not captured yet
        self.eager: OrderedDict[tuple, None] = OrderedDict()  # shapes that synchronize (or failed to capture)
        self.captures = self.replays = 0
        pool.members.append(self)

    def __call__(self, *args: Any) -> Any:
        key = _key(args)
        entry = self.graphs.get(key)
        if entry is not None:
            self.graphs.move_to_end(key)
            graph, static, out = entry
            for dst, src in zip(static, args, strict=True):
                if isinstance(dst, torch.Tensor) and dst is not src:
                    dst.copy_(src)
            graph.replay()
            self.replays += 1
            return _clone(out)
        if key in self.eager:
            return self.fn(*args)
        if key not in self.seen:  # compile and lazy state outside any graph
            _remember(self.seen, key, None)
            return self.fn(*args)
        try:
            with _sync_raises():
                result = self.fn(*args)
        except RuntimeError as exc:
            if "synchroniz" not in str(exc):
                raise
            log.info("%s: a pass of shape %s waits on the device; it stays eager", self.name, key)
            del self.seen[key]
            _remember(self.eager, key, None)
            return self.fn(*args)
        self._capture(key, args)
        return result

    def _capture(self, key: tuple, args: tuple) -> None:
        del self.seen[key]
        static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (the worker's metrics) neither fail nor spoil this capture
            with torch.cuda.graph(graph, pool=self.pool.get(), capture_error_mode="thread_local"):
                out = self.fn(*static)
        except Exception as exc:  # noqa: BLE001 - the eager pass computes the same, for this shape from now on
            log.warning("%s: CUDA graph capture of shape %s failed, it stays eager (%s)", self.name, key,
                        str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            _remember(self.eager, key, None)
            release_generator(_device(args))
            return
        self.graphs[key] = (graph, static, out)
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)


class GraphedBlocks(nn.ModuleList):
    """A DiT's list of repeated blocks, as its forward loops over it: iterating yields one step that runs every block
    (`x = block(x, *rest)` in order) through `Graphed`. The blocks stay this list's children: the state dict, `.to()`
    and module walks see the same modules under the same names."""

    def __init__(self, blocks: nn.ModuleList, pool: Pool, name: str):
        super().__init__(list(blocks))
        self.graphed = Graphed(self.run_eager, pool, name)

    def __iter__(self) -> Iterator[Any]:
        yield self.graphed

    def run_eager(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        for block in self._modules.values():
            x = block(x, *rest)
        return x


def install_blocks(denoiser: Any, pool: Pool, attrs: tuple[str, ...]) -> list[GraphedBlocks]:
    """Graph the DiT's block stacks named `attrs` (media/pipelines.py's BLOCK_STACKS: which, and when). Returns the
    stacks."""
    stacks = []
    for attr in attrs:
        blocks = getattr(denoiser, attr, None)
        if isinstance(blocks, nn.ModuleList) and not isinstance(blocks, GraphedBlocks) and len(blocks):
            stack = GraphedBlocks(blocks, pool, f"{type(denoiser).__name__}.{attr}")
            setattr(denoiser, attr, stack)
            stacks.append(stack)
    return stacks


def _remember(record: OrderedDict, key: tuple, value: Any) -> None:
    record[key] = value
    while len(record) > MAX_KEYS:
        record.popitem(last=False)


def release_generator(device: torch.device) -> None:
    """Put torch's CUDA generator of `device` back out of capture mode, where a failed capture leaves it: capturing
    (and so ending) a graph of one small op does."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            torch.zeros(1, device=device).add_(1)
    except Exception as exc:  # noqa: BLE001 - nothing more to do; say so
        log.warning("CUDA generator not released after a failed capture (%s)", exc)


def _device(args: tuple) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))


@contextmanager
def _sync_raises() -> Iterator[None]:
    """torch.cuda's sync debug mode set to raise within the block (it is process-wide: the worker runs one pass at a
    time)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def _key(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.stride(), a.device) if isinstance(a, torch.Tensor) else a for a in args)


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(_clone(o) for o in out)
