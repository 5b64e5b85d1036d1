"""Tensor-parallel collectives over torch.distributed: joining the group, and the few collectives layers call.

Every collective is bounded by `TIMEOUT` (set on the group): a peer that died makes its partners fail
instead of hanging for ever. TP 1 never touches torch.distributed.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from minisgl_cli.distributed import DistConfig, TPInfo

TIMEOUT = datetime.timedelta(seconds=120)


def init_tp(rank: int, cfg: DistConfig, device: torch.device) -> TPInfo:
    """Join the TP group as `rank` (returns at once for TP 1)."""
    if cfg.tp_size == 1:
        return TPInfo()
    url = f"tcp://{cfg.init_addr}"
    if device.type == "cuda":
        # NVLink multicast (NVLS) can take the GPUs of a shared host down; off unless the user says otherwise.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        dist.init_process_group("nccl", init_method=url, world_size=cfg.tp_size, rank=rank, timeout=TIMEOUT,
                                device_id=device)
        host = dist.new_group(backend="gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method=url, world_size=cfg.tp_size, rank=rank, timeout=TIMEOUT)
        host = dist.group.WORLD
    return TPInfo(rank, cfg.tp_size, host)


def broadcast_bytes(data: bytes | None, tp: TPInfo) -> bytes:
    """Rank 0's bytes on every rank, over the host (gloo) group: a length, then the payload if any."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(n, src=0, group=tp.host_group)
    size = int(n.item())
    if size == 0:
        return b""
    if tp.rank == 0:
        assert data is not None
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=tp.host_group)
        return data
    buf = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=tp.host_group)
    return buf.numpy().tobytes()


def min_over_ranks(n: int, tp: TPInfo) -> int:
    """The smallest of every rank's n (over the host group)."""
    if tp.size == 1:
        return n
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.host_group)
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
