"""Tensor-parallel collectives over torch.distributed: joining the group, and the few collectives layers call.

Every collective of the process groups is bounded by `TIMEOUT` (set on the group): a peer that died makes its
partners fail instead of hanging for ever. TP 1 never touches torch.distributed. On CUDA, `setup_all_reduce`
adds the one-shot all-reduce (one_shot.py) for small messages where every rank can run it; `all_reduce`
takes it for the messages it fits and NCCL for the rest.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from minisgl_cli.distributed import DistConfig, TPInfo

log = logging.getLogger("minisgl.distributed")

TIMEOUT = datetime.timedelta(seconds=120)
# NVLink multicast (NVLS) can take the GPUs of a shared host down: off (unless the user set these), before any
# NCCL or symmetric-memory start-up.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_tp(rank: int, cfg: DistConfig, device: torch.device) -> TPInfo:
    """Join the TP group as `rank` (returns at once for TP 1)."""
    if cfg.tp_size == 1:
        return TPInfo()
    url = f"tcp://{cfg.init_addr}"
    if device.type == "cuda":
        for name, value in NO_MULTICAST.items():
            os.environ.setdefault(name, value)
        dist.init_process_group("nccl", init_method=url, world_size=cfg.tp_size, rank=rank, timeout=TIMEOUT,
                                device_id=device)
        host = dist.new_group(backend="gloo", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method=url, world_size=cfg.tp_size, rank=rank, timeout=TIMEOUT)
        host = dist.group.WORLD
    # Symmetric memory maps peers' GPU memory: one host only.
    return TPInfo(rank, cfg.tp_size, host, all_reduce=cfg.all_reduce if cfg.nnodes == 1 else "nccl")


def setup_all_reduce(tp: TPInfo, device: torch.device, dtype: torch.dtype, max_bytes: int,
                     push: tuple[int, int] | None = None) -> TPInfo:
    """tp with the one-shot all-reduce for `dtype` messages up to `max_bytes`, and (`push`: max rows, row size;
    --all-reduce auto or lamport) the fused all-reduce + RMSNorm's buffers, where every rank can set them up; else tp
    as it was (NCCL, or gloo on the CPU), one line logged saying why.

    Collective: every rank of the group calls it at the same point. Each step (allocate, map the peers' buffers,
    sum known values once) ends with the ranks agreeing over the host group, so they choose alike."""
    from minisgl_cli.distributed import one_shot, push_rows

    if tp.size == 1 or device.type != "cuda" or tp.all_reduce == "nccl" or dtype not in one_shot.DTYPES:
        return tp
    made = one_shot.OneShotAllReduce(device, max_bytes)
    if not _agreed(tp, "NCCL only (symmetric memory", [
        ("allocate", made.allocate),
        ("rendezvous", lambda: made.rendezvous(dist.group.WORLD)),
        ("check", lambda: made.check(tp.rank, tp.size, dtype)),
    ]):
        return tp
    tp = dataclasses.replace(tp, one_shot=made)
    if push is not None and tp.all_reduce in ("auto", "lamport"):
        rows = push_rows.PushRows(device, tp.rank, tp.size, push[0], push[1], dtype, lamport=tp.all_reduce == "lamport")
        if _agreed(tp, "no fused all-reduce + RMSNorm (its buffers", [
            ("allocate", rows.allocate),
            ("rendezvous", lambda: rows.rendezvous(dist.group.WORLD)),
        ]):
            tp = dataclasses.replace(tp, push_rows=rows)
    if tp.rank == 0:
        log.info("TP all-reduce: %s", describe_all_reduce(tp))
    return tp


def _agreed(tp: TPInfo, what: str, steps: list[tuple[str, Callable[[], None]]]) -> bool:
    """Run the set-up steps on this rank; after each, whether every rank got through it (else one warning saying
    `what` and why, and False on every rank)."""
    from minisgl_cli.distributed import one_shot

    for step, action in steps:
        why = ""
        try:
            action()
        except one_shot.Hung:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of symmetric memory means NCCL, never a failed start
            why = f"{step}: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        if min_over_ranks(int(not why), tp) == 0:
            if tp.rank == 0 or why:
                log.warning("TP all-reduce: %s: %s)", what, why or f"{step} failed on another rank")
            return False
    return True


def describe_all_reduce(tp: TPInfo) -> str:
    """What sums the partial products: '[fused with RMSNorm <= R rows, ]one-shot <= N KiB, else nccl', 'nccl' or
    'gloo' ('' at TP 1)."""
    if tp.size == 1:
        return ""
    if tp.one_shot is not None:
        push = tp.push_rows
        fused = (f"fused with RMSNorm{' (Lamport)' if push.lamport else ''} <= {push.max_rows} rows, "
                 if push is not None else "")
        return f"{fused}one-shot <= {tp.one_shot.nbytes >> 10} KiB, else nccl"
    return dist.get_backend()


def close_tp(timeout_s: float = 30.0) -> bool:
    """Leave the process group (torch.distributed's destroy), waiting at most `timeout_s`: False if it did not
    finish (a peer gone mid-collective can hold it; the process exits anyway)."""
    if not dist.is_initialized():
        return True
    t = threading.Thread(target=dist.destroy_process_group, name="minisgl-destroy-pg", daemon=True)
    t.start()
    t.join(timeout_s)
    return not t.is_alive()


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
    """The sum of every rank's x: one-shot where it fits (a new tensor), else the group's all-reduce (in place)."""
    if tp.size == 1:
        return x
    if tp.one_shot is not None and tp.one_shot.takes(x):
        return tp.one_shot(x)
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
