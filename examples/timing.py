"""The benchmarks' clocks: time spent inside chosen methods, summed by label (how they split a step's host work), a
kernel's time inside a CUDA graph, and a call's GPU time in a warm loop."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence


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


def graph_us(fns: Sequence[Callable[[], object]], reps: int = 20, draws: int = 5) -> float:
    """Median over `draws` of the µs a call of fns takes, captured back to back in one CUDA graph (as a decode step
    runs its kernels) after a warm-up outside the capture (Triton compiles, cuBLAS picks)."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(draws):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps / len(fns))
    return sorted(times)[len(times) // 2]


def cuda_ms(fn: Callable[[], object], iters: int, warm: int = 3) -> float:
    """ms a call of fn on the GPU, the mean over `iters` back-to-back calls (CUDA events) after `warm` calls."""
    import torch

    for _ in range(warm):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
