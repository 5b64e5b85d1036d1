"""Overlap scheduling: a launched step whose sampled ids are still on the device, and how the next
step reads them without a host round trip.

With overlap the scheduler launches step N+1 before it reads step N's tokens, so the CPU work of a
step (scheduling, page allocation, building the batch, handling outputs) hides behind the GPU's.
Two consequences, handled here and in the scheduler: a decode input that step N sampled is gathered
on the device from N's output; and a request that finished at step N is seen one step late, so it may
have run one extra token in step N+1 -- that token is dropped and its pages are freed with the rest.
Penalties need no host round trip (their token counts live on the device, sampling/state.py), but a
grammar needs every earlier token on the host before its mask: for a step holding a grammar request whose last
token is still in flight, the scheduler launches the forward, then reads the previous step while it runs, then
fills the grammar masks and samples (see `Scheduler._launch`): the forward still overlaps the CPU work, only the
sampling waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl_cli.engine.batch import Mode
from minisgl_cli.engine.engine import Engine
from minisgl_cli.sampling.sampler import Sampled
from minisgl_cli.scheduler.request import Req

# A row's logprob results: (chosen token's logprob, top candidate ids, their logprobs).
RowLogprobs = tuple[float, list[int], list[float]]


@dataclass
class Launched:
    """One step sent to the device; its tokens are read by `read()` (the only wait on the GPU)."""

    mode: Mode
    reqs: list[Req]
    lens: list[int]
    produces: list[bool]  # False for a chunk of a long prompt: no token yet
    sampled: Sampled  # next ids [B] int64 (and logprobs where asked) on the device
    host: torch.Tensor | None = None  # pinned copy of next_ids, filled asynchronously
    host_lp: list[torch.Tensor | None] | None = None  # pinned copies of the logprob tensors, likewise
    event: torch.cuda.Event | None = None
    rows: dict[int, int] = field(default_factory=dict)  # id(req) -> row, for requests that sampled
    drafts: list[list[int]] | None = None  # a verify step's, per request (its rows: 1 + its drafts, in order)
    starts: list[int] = field(default_factory=list)  # each request's first row's position
    hidden: torch.Tensor | None = None  # every row's hidden state, where the engine keeps them (MTP drafts)

    @property
    def next_ids(self) -> torch.Tensor:
        return self.sampled.next_ids

    @staticmethod
    def start(mode: Mode, reqs: list[Req], lens: list[int], produces: list[bool], sampled: Sampled,
              engine: Engine, async_copy: bool, drafts: list[list[int]] | None = None) -> Launched:
        """With `async_copy` (overlap) on CUDA, the results start their way back into pinned host memory (the
        engine's read-back buffers). A verify step (`drafts`) is read at once: `rows` (for the next step's inputs)
        holds plain steps' only."""
        rows = {id(r): i for i, (r, p) in enumerate(zip(reqs, produces)) if p} if drafts is None else {}
        step = Launched(mode, reqs, lens, produces, sampled, rows=rows, drafts=drafts)
        next_ids = sampled.next_ids
        if async_copy and next_ids.is_cuda:
            step.host = engine.readback(next_ids.shape[0])
            step.host.copy_(next_ids, non_blocking=True)
            if sampled.lp_rows:  # only steps with a logprobs request pay for these copies
                step.host_lp = [None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                .copy_(t, non_blocking=True)
                                for t in (sampled.logprob, sampled.top_ids, sampled.top_logprobs)]
            step.event = torch.cuda.Event()
            step.event.record()
        return step

    def read(self) -> tuple[list[int], dict[int, RowLogprobs]]:
        """The sampled ids, and each logprobs row's results keyed by row (empty when none asked)."""
        s = self.sampled
        if self.event is None:
            ids = s.next_ids.tolist()
            lp = [None if t is None else t.tolist() for t in (s.logprob, s.top_ids, s.top_logprobs)]
        else:
            self.event.synchronize()
            assert self.host is not None  # start() sets it with the event
            ids = self.host.tolist()
            lp = [None if t is None else t.tolist() for t in (self.host_lp or [None, None, None])]
        if not s.lp_rows:
            return ids, {}
        chosen, top_ids, top_lps = lp
        assert chosen is not None  # set whenever lp_rows is
        return ids, {row: (chosen[j], top_ids[j] if top_ids else [], top_lps[j] if top_lps else [])
                     for j, row in enumerate(s.lp_rows)}


def feed_input_ids(cpu_ids: torch.Tensor, src: list[int], prev: Launched, engine: Engine) -> torch.Tensor:
    """Decode inputs: row i takes prev.next_ids[src[i]] where src[i] >= 0, else cpu_ids[i] (already on device)."""
    n = len(src)
    if src == list(range(n)) and prev.next_ids.shape[0] >= n:  # steady state: same requests, same order
        return prev.next_ids[:n]
    index = engine.upload(src, torch.int64)
    return torch.where(index >= 0, prev.next_ids[index.clamp(min=0)], cpu_ids)
