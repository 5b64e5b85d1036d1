"""Tensor-parallel groups over torch.distributed: this rank's place, start-up, and the collectives layers call.

NCCL carries the model's collectives on CUDA, gloo on the CPU (so TP is testable without a GPU). A
second, gloo group always exists for the schedulers' own small host messages (rank 0 hands the
others each step's requests), so those never queue behind the model's collectives on the GPU.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# A collective that waits longer than this means a peer died: fail instead of hanging for ever.
TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1


@dataclass(frozen=True)
class DistConfig:
    """Where the ranks of one TP group meet: `--tp`, `--nnodes`, `--node-rank`, `--dist-init-addr`."""

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    init_addr: str = "127.0.0.1:29517"  # HOST:PORT of the rendezvous (torch.distributed's TCP store)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1:
            raise ValueError("--tp and --nnodes must be >= 1")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}")
        host, _, port = self.init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr must be HOST:PORT, not {self.init_addr!r}")

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        n = self.ranks_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)


def init_tp(rank: int, cfg: DistConfig, device: torch.device) -> TPInfo:
    """Join the TP group as `rank` (returns at once for TP 1)."""
    if cfg.tp_size == 1:
        return TPInfo()
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{cfg.init_addr}", world_size=cfg.tp_size, rank=rank,
                            timeout=TIMEOUT, device_id=device if device.type == "cuda" else None)
    global _host_group
    _host_group = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend != "gloo" else dist.group.WORLD
    return TPInfo(rank, cfg.tp_size)


_host_group = None


def broadcast_bytes(data: bytes | None, tp: TPInfo) -> bytes:
    """Rank 0's bytes on every rank, over the host (gloo) group: a length, then the payload if any."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src=0, group=_host_group)
    size = int(n.item())
    if size == 0:
        return b""
    if tp.rank == 0:
        assert data is not None  # a non-zero length came from rank 0's payload
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=_host_group)
        return data
    buf = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=_host_group)
    return buf.numpy().tobytes()


def min_over_ranks(n: int, tp: TPInfo) -> int:
    """The smallest of every rank's n (over the host group)."""
    if tp.size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_host_group)
    return int(t.item())


def broadcast_from_rank0(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    """x as rank 0 has it, on every rank (in place)."""
    if tp.size > 1:
        dist.broadcast(x, src=0)
    return x


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size == 1:
        return x
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
