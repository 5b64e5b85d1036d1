"""Tensor-parallel layout: this rank's place (`TPInfo`) and where the ranks meet (`DistConfig`). No torch here.

The process group's start-up and the collectives layers call are in `comm.py` (torch.distributed: NCCL on
CUDA, gloo on the CPU, so TP is testable without a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    # The gloo group for the schedulers' own host messages (rank 0 hands the others each step's requests),
    # so those never queue behind the model's collectives on the GPU. None at TP 1.
    host_group: Any = field(default=None, compare=False, repr=False)


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
