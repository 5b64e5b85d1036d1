"""OneShotAllReduce: TP's small all-reduces (decode steps) over torch's symmetric memory, in and out of CUDA graphs.

A TP-2 decode step of Llama-8B makes 64 all-reduces of 8 KB, and NCCL spends ~20 µs on each inside a graph.
torch's one-shot kernel (`torch.ops.symm_mem.one_shot_all_reduce_copy_out`) copies this rank's input into a
buffer that every rank of the group has mapped (CUDA P2P), meets the others at a barrier in device memory, and
sums all ranks' buffers in one pass: one kernel, no NCCL proxy. With two ranks each element is one correctly
rounded addition, the same number NCCL gives.

This module holds one rank's buffer and the kernel call. Setting it up is collective: `comm.setup_all_reduce`
runs the steps below on every rank and keeps the result only where every rank succeeded. NVLink multicast is
never used (no multimem op here; comm.init_tp sets TORCH_SYMM_MEM_DISABLE_MULTICAST).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

# What one rank reads from its peers per all-reduce, at most: one-shot reads every peer's whole message, so its
# cost grows with the group while NCCL's ring does not (at TP 2 this covers 256 decode rows of a 4096-wide model).
MAX_READ_BYTES = 2 << 20
DTYPES = (torch.bfloat16, torch.float32)  # what torch's kernel sums
ALIGN = 16  # bytes: the kernel's vector width; the message and its offset must both be multiples
CHECK_TIMEOUT_S = 30.0


class Hung(RuntimeError):
    """The check's all-reduce never finished: the kernel still spins on this GPU, so NCCL cannot take over."""


def buffer_bytes(message_bytes: int, world: int) -> int:
    """The symmetric buffer (= the largest one-shot message) for messages up to `message_bytes` in a group of
    `world` ranks: capped so one rank reads at most MAX_READ_BYTES of its peers' memory."""
    cap = MAX_READ_BYTES // max(1, world - 1)
    return max(ALIGN, min(message_bytes, cap) // ALIGN * ALIGN)


def map_peers(buffer: torch.Tensor, group: Any) -> tuple[Any, Any]:
    """Map every peer's part of the symmetric `buffer` (collective over the process group `group`): torch's handle
    (its `buffer_ptrs`: each rank's address) and the group's name, which the symm_mem ops take."""
    import torch.distributed._symmetric_memory as symm_mem

    name: Any = group.group_name  # by name: what every torch with these ops takes (and the ops want)
    if torch.__version__ < "2.11":  # before 2.11 a group had to be enabled first (deprecated since)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    return symm_mem.rendezvous(buffer, name), name


class OneShotAllReduce:
    """One rank's symmetric buffer of `nbytes` and the one-shot sum over the group named `group_name`."""

    def __init__(self, device: torch.device, nbytes: int):
        self.device = device
        self.nbytes = nbytes
        self.buffer: torch.Tensor | None = None  # this rank's part of the symmetric memory, once allocated
        self.group_name = ""
        # The copy variant moves the input into the buffer inside the kernel (torch 2.8+); else a copy first.
        self._copy_out: Any = None

    def allocate(self) -> None:
        """This rank's buffer (local; `rendezvous` then maps the peers' buffers)."""
        import torch.distributed._symmetric_memory as symm_mem

        if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            raise RuntimeError(f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out")
        try:
            symm_mem.set_backend("CUDA")  # plain CUDA P2P (no NVSHMEM bootstrap); a no-op where it is the default
        except (AttributeError, RuntimeError):
            pass  # an older torch without backends, or one already in use: its default
        self.buffer = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)

    def rendezvous(self, group: Any) -> None:
        """Map every peer's buffer (collective over the process group `group`: every rank calls it once)."""
        assert self.buffer is not None
        self.group_name = map_peers(self.buffer, group)[1]

    def takes(self, x: torch.Tensor) -> bool:
        """Whether x goes one-shot: a contiguous bf16 / fp32 CUDA tensor that fits the buffer, 16-byte aligned.
        Every rank decides alike (the same shapes and dtypes meet in a collective)."""
        n = x.numel() * x.element_size()
        return (bool(self.group_name) and x.dtype in DTYPES and x.is_cuda and x.is_contiguous()
                and 0 < n <= self.nbytes and n % ALIGN == 0 and x.storage_offset() * x.element_size() % ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in a new tensor (x is left as it was). Only for x that `takes` accepts."""
        n = x.numel() * x.element_size()
        assert self.buffer is not None
        peer_view = self.buffer[:n].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        if self._copy_out is not None:
            return self._copy_out(peer_view, x, "sum", self.group_name, out)
        peer_view.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce_out(peer_view, "sum", self.group_name, out)

    def check(self, rank: int, world: int, dtype: torch.dtype) -> None:
        """One eager all-reduce of known values: RuntimeError if the sum is wrong, Hung if it does not finish within
        CHECK_TIMEOUT_S (peers' memory mapped but not reachable)."""
        numel = min(self.nbytes // dtype.itemsize, 4096)
        x = torch.full((numel,), float(rank + 1), dtype=dtype, device=self.device)
        y = self(x)
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + CHECK_TIMEOUT_S
        while not done.query():
            if time.monotonic() > deadline:
                raise Hung(f"the one-shot all-reduce did not finish in {CHECK_TIMEOUT_S:.0f}s (GPUs without peer "
                           "access?); start with --all-reduce nccl")
            time.sleep(0.005)
        expected = world * (world + 1) / 2
        if not bool((y == expected).all()):
            raise RuntimeError(f"the one-shot all-reduce summed wrong (got {y[0].item()}, expected {expected})")
