"""PushRows: the symmetric memory TP's fused all-reduce + RMSNorm pushes each rank's partial rows through; `Partial`.

A TP decode step follows each row-split linear (o_proj, down_proj) with an all-reduce and then the residual add +
RMSNorm. At batch 1 on two GPUs each of those 64 all-reduces is a separate kernel of ~7 µs (torch's one-shot: two
barriers in device memory) that also breaks the chain of programmatic dependent launches between our kernels.
The fused kernel (kernels/triton/ops.py `all_reduce_rmsnorm`) does all three in one launch: each row's program
stores its partial row straight into every peer's buffer, raises one flag per (sender, row) there, waits for the
peers' flags in its own buffer, sums the rows in rank order and normalizes. This module holds that memory:

    per rank: data [2 parities][world senders][max_rows x row] of the engine dtype, then flags [world][max_rows] int64

and a local epoch per row: call k of row r writes parity k % 2 and raises its flags to k. A peer can be at most
one call ahead (it needs this rank's rows of call k to finish call k), so the other parity is never overwritten
while it is read; flags only grow, so nothing is reset between calls (or between CUDA graph replays).

`--all-reduce lamport` drops the flags (the Lamport protocol of TensorRT-LLM's small all-reduces): the data region
starts as -0.0 in every element, a sender writes its rows with -0.0 made +0.0, and a reader polls the rows themselves
until no element reads -0.0, sums, and writes -0.0 back over what it read. The flags cost the sender a system-wide
fence (its stores to the peer acknowledged over NVLink) and then a second crossing; here each element signals its
own arrival. The same parity argument makes the reset safe: a peer writes this parity again only at call k + 2,
after this rank's call k + 1, which ran after call k's reset had finished.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl_cli.distributed import TPInfo

FLAG = torch.int64  # call counts: at 20k calls a second an int32 would wrap within days
# The most rows the fused kernel takes (one program each): decode batches up to this; larger ones are bandwidth
# work, where the one-shot / NCCL sum and a separate norm cost little more.
FUSED_NORM_ROWS = 64
UNSET = {2: -(1 << 15), 4: -(1 << 31)}  # -0.0's bits as a signed integer, by the element's bytes: "not yet written"


@dataclass
class Partial:
    """This rank's partial sum of a row-split linear, left for the norm after it to all-reduce (fused)."""

    rows: torch.Tensor  # [T, hidden], contiguous, the engine dtype
    tp: TPInfo  # its push_rows holds the buffers; all_reduce(rows, tp) where the norm cannot fuse

    def select(self, idx: torch.Tensor) -> Partial:
        """These rows' partial sums (the sum of a row needs only that row from each rank)."""
        return Partial(self.rows[idx], self.tp)


class PushRows:
    """One rank's part of the symmetric buffers, the peers' addresses, and the per-row epochs."""

    def __init__(self, device: torch.device, rank: int, world: int, max_rows: int, row: int, dtype: torch.dtype,
                 lamport: bool = False):
        self.device, self.rank, self.world, self.lamport = device, rank, world, lamport
        self.max_rows, self.row, self.dtype = max_rows, row, dtype
        self.slot = max_rows * row  # elements of one (parity, sender) slot
        self.data_bytes = 2 * world * self.slot * dtype.itemsize
        self.buffer: torch.Tensor | None = None
        self.epochs = torch.zeros(max_rows, dtype=FLAG, device=device)  # calls made, per row program
        self.data_ptrs: torch.Tensor | None = None  # int64 [world]: each rank's data region (this one's included)
        self.flag_ptrs: torch.Tensor | None = None  # int64 [world]: each rank's flags

    def allocate(self) -> None:
        """This rank's buffer, zeroed (its flags must read 0 before any peer can raise one: rendezvous follows); with
        `lamport` its data region all -0.0 (unwritten)."""
        import torch.distributed._symmetric_memory as symm_mem

        flag_bytes = self.world * self.max_rows * FLAG.itemsize
        self.buffer = symm_mem.empty(self.data_bytes + flag_bytes, dtype=torch.uint8, device=self.device)
        self.buffer.zero_()
        if self.lamport:
            self.buffer[:self.data_bytes].view(self.dtype).fill_(-0.0)
        torch.cuda.synchronize(self.device)

    def rendezvous(self, group: Any) -> None:
        """Map every peer's buffer (collective over `group`) and keep their addresses on the device."""
        from minisgl_cli.distributed.one_shot import map_peers

        assert self.buffer is not None
        handle, _ = map_peers(self.buffer, group)
        ptrs = [int(p) for p in handle.buffer_ptrs]
        self.data_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=self.device)
        self.flag_ptrs = torch.tensor([p + self.data_bytes for p in ptrs], dtype=torch.int64, device=self.device)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x (a partial sum) fits: [T <= max_rows, row] of the buffers' dtype, contiguous, on this device.
        Every rank decides alike (the same shapes meet here)."""
        return (self.data_ptrs is not None and x.dim() == 2 and 0 < x.shape[0] <= self.max_rows
                and x.shape[1] == self.row and x.dtype == self.dtype and x.is_contiguous() and x.device == self.device)
