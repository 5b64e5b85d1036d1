"""RuntimeConfig: how the engine runs — in the caller's process or as processes, over how many ranks, nodes and
replicas (data parallel), and how requests are routed across the replicas.

Its fields are command-line options declared in `metadata`, like EngineConfig's (commands/common.py builds
the options). No torch or zmq here: `minisgl --help` reads this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from minisgl_cli.dispatch import DISPATCH_POLICIES, DispatchPolicy
from minisgl_cli.distributed import AllReduce, DistConfig, free_port

RuntimeMode = Literal["auto", "processes", "in-process"]


@dataclass(frozen=True)
class RuntimeConfig:
    mode: RuntimeMode = field(default="auto", metadata=dict(
        flags=("--runtime",), env="MINISGL_RUNTIME",
        help="processes (one per TP rank, over ZMQ), in-process, or auto."))
    num_tokenizer: int = field(default=0, metadata=dict(
        flags=("--num-tokenizer",), min=0, help="Processes: tokenizer workers (0 = the detokenizer tokenizes)."))
    tp_size: int = field(default=1, metadata=dict(
        flags=("--tp", "--tp-size"), min=1,
        help="Tensor-parallel ranks: one process and device each."))
    nnodes: int = field(default=1, metadata=dict(
        flags=("--nnodes",), min=1, help="Hosts the --tp ranks span (each runs --tp/--nnodes ranks)."))
    node_rank: int = field(default=0, metadata=dict(
        flags=("--node-rank",), min=0, help="This host's index; node 0 runs the API and rank 0."))
    dist_init_addr: str | None = field(default=None, metadata=dict(  # None: a free port of this host's
        flags=("--dist-init-addr",),
        help="HOST:PORT where the ranks meet (--dp replica i: PORT+i); needed with --nnodes > 1. "
             "Default: a free port on 127.0.0.1 for each replica."))
    all_reduce: AllReduce = field(default="auto", metadata=dict(
        flags=("--all-reduce",), env="MINISGL_ALL_REDUCE",
        help="CUDA --tp: auto (small decode sums fused with the RMSNorm after them, one-shot over symmetric memory "
             "for other small messages, NCCL above), one-shot (no fused kernel), nccl, or lamport (auto with the "
             "fused kernel flagless: each element signals its own arrival)."))
    dp_size: int = field(default=1, metadata=dict(
        flags=("--dp", "--dp-size"), min=1,
        help="Data-parallel engine replicas, each on its own --tp devices."))
    dispatch: DispatchPolicy = field(default="rr", metadata=dict(
        flags=("--dispatch", "--scheduler-mode"), env="SCHEDULER_MODE",
        help="Which replica takes a request: rr, fsfs, random, cache_aware."))
    # `serve --stream-interval`: the detokenizer sends a request's text every this many tokens (the first token
    # and the end at once); not an engine option of every command, so no flags here.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "processes", "in-process"):
            raise ValueError(f"--runtime must be auto, processes or in-process, not {self.mode!r}")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be >= 1")
        if self.num_tokenizer < 0:
            raise ValueError("--num-tokenizer must be >= 0")
        if self.mode == "in-process" and (self.tp_size > 1 or self.nnodes > 1 or self.dp_size > 1):
            raise ValueError("--runtime in-process runs one rank: --tp, --dp and --nnodes need --runtime processes")
        if self.dp_size < 1:
            raise ValueError("--dp must be >= 1")
        if self.dp_size > 1 and self.nnodes > 1:
            raise ValueError("--dp runs its replicas on one host; across hosts put `minisgl router` in front of "
                             "one `minisgl serve` per host")
        if self.dispatch not in DISPATCH_POLICIES:
            raise ValueError(f"--dispatch must be one of {', '.join(DISPATCH_POLICIES)}, "
                             f"not {self.dispatch!r}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--nnodes > 1 needs --dist-init-addr HOST:PORT: node 0's address, which every node "
                             "reaches")
        _ = self.dist  # validates --tp / --nnodes / --node-rank / --dist-init-addr / --all-reduce now, as a usage error

    @property
    def dist(self) -> DistConfig:
        return self.replica_dist(0)

    def replica_dist(self, replica: int) -> DistConfig:
        """Where replica `replica`'s ranks meet: --dist-init-addr's port plus the replica's index, or without one a
        port free now (one host: two engines started side by side must not meet at one fixed port)."""
        if self.dist_init_addr is None:
            addr = f"127.0.0.1:{free_port()}"
        else:
            host, _, port = self.dist_init_addr.rpartition(":")
            addr = f"{host}:{int(port) + replica}" if replica and port.isdigit() else self.dist_init_addr
        return DistConfig(self.tp_size, self.nnodes, self.node_rank, addr, self.all_reduce)

    def processes(self, by_default: bool) -> bool:
        """Whether the engine runs as processes; `by_default` is the command's choice for `auto`."""
        if self.mode != "auto":
            return self.mode == "processes"
        return by_default or self.tp_size > 1 or self.nnodes > 1 or self.dp_size > 1
