"""Tensor-parallel layout: this rank's place (`TPInfo`) and where the ranks meet (`DistConfig`). No torch here.

The process group's start-up and the collectives layers call are in `comm.py` (torch.distributed: NCCL on
CUDA, gloo on the CPU, so TP is testable without a GPU); the one-shot all-reduce of small messages over
symmetric memory (CUDA) is in `one_shot.py`, the buffers of the all-reduce fused with RMSNorm in `push_rows.py`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

# How a TP group sums the layers' partial products: auto (on one CUDA host: small decode batches' sums fused with the
# residual add + RMSNorm after them (push_rows.py), other small messages by torch's one-shot kernel over symmetric
# memory, NCCL above them), one-shot (the same without the fused kernel), nccl (the group's all-reduce for all),
# lamport (auto with the fused kernel's rows their own arrival flags: push_rows.py).
AllReduce = Literal["auto", "one-shot", "nccl", "lamport"]
ALL_REDUCES: tuple[str, ...] = get_args(AllReduce)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` now (the OS's pick): a rendezvous or server of this host's own."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1
    # The gloo group for the schedulers' own host messages (rank 0 hands the others each step's requests),
    # so those never queue behind the model's collectives on the GPU. None at TP 1.
    host_group: Any = field(default=None, compare=False, repr=False)
    all_reduce: AllReduce = "auto"  # what the group may use (DistConfig's, nccl across hosts)
    # The one-shot all-reduce (one_shot.OneShotAllReduce) once comm.setup_all_reduce made it on every rank.
    one_shot: Any = field(default=None, compare=False, repr=False)
    # The fused all-reduce + RMSNorm's buffers (push_rows.PushRows), likewise (--all-reduce auto or lamport).
    push_rows: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class DistConfig:
    """Where the ranks of one TP group meet, and how they sum: `--tp`, `--nnodes`, `--node-rank`, `--dist-init-addr`,
    `--all-reduce`."""

    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    init_addr: str = "127.0.0.1:29517"  # HOST:PORT of the rendezvous (torch.distributed's TCP store)
    all_reduce: AllReduce = "auto"  # --all-reduce

    def __post_init__(self) -> None:
        if self.all_reduce not in ALL_REDUCES:
            raise ValueError(f"--all-reduce must be one of {', '.join(ALL_REDUCES)}, not {self.all_reduce!r}")
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
