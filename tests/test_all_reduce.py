"""Which all-reduce a TP group uses (CPU checks; tests/test_gpu_tp.py runs the one-shot kernel on two GPUs).

--all-reduce auto lets CUDA groups on one host sum small messages with torch's one-shot kernel over symmetric
memory; gloo (the CPU), nccl, other dtypes and groups across hosts keep the process group's all-reduce, and a
rank that cannot set symmetric memory up takes every rank back to NCCL instead of failing the start."""

from __future__ import annotations

import logging

import pytest
import torch
from ranks import run_ranks

from minisgl_cli.distributed import DistConfig, TPInfo, comm, one_shot
from minisgl_cli.runtime.config import RuntimeConfig


def test_all_reduce_flag_reaches_every_replicas_ranks(monkeypatch):
    assert RuntimeConfig().dist.all_reduce == "auto"
    rt = RuntimeConfig(all_reduce="nccl", dp_size=2, tp_size=2)
    assert rt.replica_dist(0).all_reduce == rt.replica_dist(1).all_reduce == "nccl"
    assert RuntimeConfig(all_reduce="one-shot").dist.all_reduce == "one-shot"
    assert RuntimeConfig(all_reduce="lamport").dist.all_reduce == "lamport"
    with pytest.raises(ValueError, match="--all-reduce must be one of auto, one-shot, nccl"):
        RuntimeConfig(all_reduce="custom")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--all-reduce"):
        DistConfig(all_reduce="mpi")  # type: ignore[arg-type]


@pytest.mark.parametrize("args, env, ok", [
    (["serve", "--all-reduce", "custom"], {}, False),
    (["serve"], {"MINISGL_ALL_REDUCE": "custom"}, False),
    (["serve", "--help"], {}, True),
])
def test_all_reduce_flag_and_its_variable_are_parsed_and_checked(args, env, ok):
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    result = CliRunner().invoke(app, args, env={"COLUMNS": "200", **env})
    if ok:
        assert result.exit_code == 0 and "--all-reduce" in result.output and "MINISGL_ALL_REDUCE" in result.output
    else:
        assert result.exit_code == 2, result.output
        assert "--all-reduce must be one of auto, one-shot, nccl" in result.output, result.output


def test_the_start_line_names_the_fused_kernels_protocol():
    from types import SimpleNamespace

    shot = SimpleNamespace(nbytes=32 << 10)
    for lamport, fused in ((False, "fused with RMSNorm <= 4 rows"), (True, "fused with RMSNorm (Lamport) <= 4 rows")):
        tp = TPInfo(0, 2, one_shot=shot, push_rows=SimpleNamespace(max_rows=4, lamport=lamport))
        assert comm.describe_all_reduce(tp) == f"{fused}, one-shot <= 32 KiB, else nccl"
    unfused = TPInfo(0, 2, all_reduce="one-shot", one_shot=shot)
    assert comm.describe_all_reduce(unfused) == "one-shot <= 32 KiB, else nccl"


def test_the_buffer_caps_what_one_rank_reads_from_its_peers():
    mib = 1 << 20
    assert one_shot.buffer_bytes(256 * 4096 * 2, world=2) == 2 * mib  # Llama-8B's 256 decode rows at TP 2
    assert one_shot.buffer_bytes(256 * 4096 * 2, world=4) == 2 * mib // 3 // 16 * 16
    assert one_shot.buffer_bytes(8 * mib, world=2) == one_shot.MAX_READ_BYTES
    assert one_shot.buffer_bytes(1000, world=2) == 992  # whole 16-byte vectors


@pytest.mark.parametrize("tp, device, dtype, why", [
    (TPInfo(0, 1), "cuda", torch.bfloat16, "TP 1 has nothing to sum"),
    (TPInfo(0, 2), "cpu", torch.bfloat16, "gloo on the CPU"),
    (TPInfo(0, 2, all_reduce="nccl"), "cuda", torch.bfloat16, "--all-reduce nccl"),
    (TPInfo(0, 2), "cuda", torch.float16, "torch's one-shot kernel sums bf16 and fp32 only"),
])
def test_setup_keeps_the_process_groups_all_reduce(tp, device, dtype, why):
    """These return before any collective (no process group here): the group's all-reduce stays."""
    assert comm.setup_all_reduce(tp, torch.device(device), dtype, 1 << 20) is tp, why


class _Recorder:
    """Stands in for OneShotAllReduce: takes what `fits` says, and records what it summed."""

    def __init__(self, fits: bool):
        self.fits, self.seen = fits, []

    def takes(self, x):
        return self.fits

    def __call__(self, x):
        self.seen.append(x)
        return x * 2


def test_all_reduce_takes_the_one_shot_path_for_the_messages_it_fits(monkeypatch):
    fake = _Recorder(fits=True)
    x = torch.ones(4)
    assert torch.equal(comm.all_reduce(x, TPInfo(0, 2, one_shot=fake)), x * 2) and fake.seen == [x]
    summed = []
    monkeypatch.setattr(comm.dist, "all_reduce", lambda t: summed.append(t))  # the process group's (in place)
    other = _Recorder(fits=False)
    assert comm.all_reduce(x, TPInfo(0, 2, one_shot=other)) is x and summed == [x] and not other.seen
    assert comm.all_reduce(x, TPInfo(0, 1, one_shot=fake)) is x and len(fake.seen) == 1  # TP 1: nothing to sum


def _rank(rank: int, addr: str, out, fail_on: int) -> None:
    """A gloo rank whose symmetric-memory steps 'work' except allocation on rank `fail_on`: what it chose."""
    from minisgl_cli.distributed import comm, one_shot

    logging.basicConfig(level=logging.INFO)

    def allocate(self):
        if rank == fail_on:
            raise RuntimeError("no P2P between these GPUs")

    one_shot.OneShotAllReduce.allocate = allocate  # type: ignore[method-assign]
    one_shot.OneShotAllReduce.rendezvous = lambda self, group: None  # type: ignore[method-assign]
    one_shot.OneShotAllReduce.check = lambda self, rank, world, dtype: None  # type: ignore[method-assign]
    tp = comm.init_tp(rank, DistConfig(tp_size=2, init_addr=addr), torch.device("cpu"))
    # The device says cuda so the set-up runs; the agreement itself goes over the gloo host group.
    chosen = comm.setup_all_reduce(tp, torch.device("cuda"), torch.bfloat16, 1 << 20)
    out.put((rank, (chosen.one_shot is not None, comm.describe_all_reduce(chosen))))
    comm.close_tp()


@pytest.mark.slow
@pytest.mark.parametrize("fail_on", [1, -1], ids=["rank-1-fails", "all-succeed"])
def test_ranks_agree_on_the_all_reduce_when_one_cannot_set_it_up(fail_on):
    """Rank 1 failing to allocate takes rank 0 back to the group's all-reduce too (or both would hang in
    different collectives); with every step working on both, both take the one-shot."""
    got = sorted(run_ranks(_rank, 2, fail_on, timeout=120).items())
    if fail_on == 1:
        assert got == [(0, (False, "gloo")), (1, (False, "gloo"))]
    else:
        assert got == [(0, (True, "one-shot <= 1024 KiB, else nccl")), (1, (True, "one-shot <= 1024 KiB, else nccl"))]
