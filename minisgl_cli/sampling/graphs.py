"""SamplerGraphs: a small decode batch's random draw captured as CUDA graphs, replayed after the decode graph's.

A sampled step's draw is a gather of its rows' parameters and a few Triton launches (kernels/triton/sampling.py):
~0.3-0.5 ms of Python a step, more than Qwen3-0.6B's whole decode step at batch 1 (0.86 ms on an H200) leaves the
CPU, so a sampled stream ran 5-9% slower than a greedy one, which takes one argmax. Captured per (batch size, cut,
min-p) over the decode graphs' static inputs -- the rows' page-table rows and positions, the logits buffer -- a
draw is one replay. Only rows that need nothing but the draw take it (no penalty, bias, grammar mask, logprobs or
drafts), and only right after a decode-graph replay; any other step samples eagerly, as before. The kernels and
their inputs are the eager path's, so a row draws the same token either way.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Protocol

import torch

from minisgl_cli.sampling.sampler import DrawFn
from minisgl_cli.sampling.state import Need, SamplingBatch, SamplingState

log = logging.getLogger("minisgl.graph")

DRAW_ONLY = Need.SAMPLED | Need.TOP_K | Need.TOP_P | Need.MIN_P  # what a captured draw covers
# Past this many rows a step's kernels take long enough that its launches hide behind the GPU's work.
MAX_ROWS = 64
# The split kernels' variants: (a cut to test, a min-p floor to find). A top-k cut runs the same kernels as top-p.
VARIANTS = [(cut, min_p) for cut in (False, True) for min_p in (False, True)]


def _needs(cut: bool, min_p: bool) -> Need:
    return Need.SAMPLED | (Need.TOP_P if cut else Need.NONE) | (Need.MIN_P if min_p else Need.NONE)


class DecodeInputs(Protocol):
    """What the sampler's graphs read of the decode graphs they follow (engine/graph.py's DecodeGraphs): their sizes,
    device, and static positions, page-table rows and logits."""

    sizes: list[int]
    device: torch.device
    positions: torch.Tensor
    req_rows: torch.Tensor
    logits: torch.Tensor


class SamplerGraphs:
    def __init__(self, graphs: DecodeInputs, state: SamplingState, draw: DrawFn):
        self.decode = graphs
        self.state = state
        self.draw_fn = draw
        self.sizes = [s for s in graphs.sizes if s <= MAX_ROWS]
        n = self.sizes[-1]
        # Each row's drawn token's position: its input's + 1 (the eager path's seq_lens, int32 as they are).
        self.positions = torch.zeros(n, dtype=torch.int32, device=graphs.device)
        self.out = torch.zeros(n, dtype=torch.int64, device=graphs.device)
        self.graphs: dict[tuple[int, bool, bool], torch.cuda.CUDAGraph] = {}

    def _body(self, bs: int, cut: bool, min_p: bool) -> None:
        d = self.decode
        self.positions[:bs].copy_(d.positions[:bs] + 1)
        req_rows = d.req_rows[:bs]
        batch = SamplingBatch(req_rows, self.positions[:bs], _needs(cut, min_p), 0, [], None, 0, None)
        self.out[:bs].copy_(self.draw_fn(d.logits[:bs], self.state.params(req_rows), batch))

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        device = self.decode.device
        pool = torch.cuda.graph_pool_handle()  # apart from the decode graphs': their memory is live while this runs
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):
                for cut, min_p in VARIANTS:
                    self._body(bs, cut, min_p)  # warm-up outside the capture (a first launch may allocate)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._body(bs, cut, min_p)
                    self.graphs[(bs, cut, min_p)] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        log.info("captured %d sampler CUDA graphs (bs %d..%d) in %.2fs", len(self.graphs), self.sizes[0],
                 self.sizes[-1], time.perf_counter() - t0)

    def takes(self, logits: torch.Tensor, rows: SamplingBatch) -> bool:
        """Whether this step's draw can replay: the logits are the decode graph's latest (so its static inputs hold
        this batch's rows and positions), the batch is small and its rows need the draw alone."""
        needs = rows.needs
        return (bool(needs & Need.SAMPLED) and not needs & ~DRAW_ONLY and rows.drafts is None
                and logits.shape[0] <= self.sizes[-1] and logits.data_ptr() == self.decode.logits.data_ptr())

    def draw(self, n: int, needs: Need) -> torch.Tensor:
        """[n] next ids of the batch the decode graph just ran (a copy: the buffer is the next replay's)."""
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.graphs[(bs, bool(needs & (Need.TOP_K | Need.TOP_P)), bool(needs & Need.MIN_P))].replay()
        return self.out[:n].clone()
