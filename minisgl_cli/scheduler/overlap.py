"""Overlap scheduling: a launched step whose sampled ids are still on the device, and how the next
step reads them without a host round trip.

With overlap the scheduler launches step N+1 before it reads step N's tokens, so the CPU work of a
step (scheduling, page allocation, building the batch, handling outputs) hides behind the GPU's.
Two consequences, handled here and in the scheduler: a decode input that step N sampled is gathered
on the device from N's output; and a request that finished at step N is seen one step late, so it may
have run one extra token in step N+1 -- that token is dropped and its pages are freed with the rest.
Presence/frequency penalties need every earlier token on the host, so while a penalized request runs
the scheduler reads each step's tokens before launching the next (no overlap for those steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl_cli.core.batch import Mode
from minisgl_cli.core.host import HostBuffers
from minisgl_cli.scheduler.request import Req


@dataclass
class Launched:
    """One step sent to the device; its tokens are read by `tokens()` (the only wait on the GPU)."""

    mode: Mode
    reqs: list[Req]
    lens: list[int]
    produces: list[bool]  # False for a chunk of a long prompt: no token yet
    next_ids: torch.Tensor  # [B] int64 on the device
    host: torch.Tensor | None = None  # pinned copy of next_ids, filled asynchronously
    event: torch.cuda.Event | None = None
    rows: dict[int, int] = field(default_factory=dict)  # id(req) -> row, for requests that sampled

    @staticmethod
    def start(mode: Mode, reqs: list[Req], lens: list[int], produces: list[bool], next_ids: torch.Tensor,
              host: HostBuffers, async_copy: bool) -> Launched:
        """With `async_copy` (overlap) on CUDA, the ids start their way back into one of `host`'s pinned buffers."""
        rows = {id(r): i for i, (r, p) in enumerate(zip(reqs, produces)) if p}
        step = Launched(mode, reqs, lens, produces, next_ids, rows=rows)
        if async_copy and next_ids.is_cuda:
            step.host = host.readback(next_ids.shape[0])
            step.host.copy_(next_ids, non_blocking=True)
            step.event = torch.cuda.Event()
            step.event.record()
        return step

    def tokens(self) -> list[int]:
        if self.event is None:
            return self.next_ids.tolist()
        self.event.synchronize()
        assert self.host is not None  # start() sets it with the event
        return self.host.tolist()


def feed_input_ids(cpu_ids: torch.Tensor, src: list[int], prev: Launched, host: HostBuffers) -> torch.Tensor:
    """Decode inputs: row i takes prev.next_ids[src[i]] where src[i] >= 0, else cpu_ids[i] (already on device)."""
    n = len(src)
    if src == list(range(n)) and prev.next_ids.shape[0] >= n:  # steady state: same requests, same order
        return prev.next_ids[:n]
    index = host.to_device(src, torch.int64, cpu_ids.device)
    return torch.where(index >= 0, prev.next_ids[index.clamp(min=0)], cpu_ids)
