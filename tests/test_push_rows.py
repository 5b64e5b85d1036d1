"""The fused all-reduce + RMSNorm's memory protocol (distributed/push_rows.py) under Triton's interpreter: two ranks
in one process, their buffers plain CPU tensors. tests/test_gpu_tp.py runs the kernel on two GPUs.

A kernel waits for its peer's flags, so the ranks cannot run one after the other as they are: rank 1's push for
each call is written by hand first, then rank 0's kernel runs (it pushes to rank 1 and finds rank 1's rows), then
rank 1's (it finds rank 0's). Three calls cover both parities of the buffers and the growing flags. Runs where
TRITON_INTERPRET=1 was set before triton was imported (as tests/test_gpu_moe.py):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_push_rows.py

`make test` runs it so on a machine without a GPU (triton in .venv/triton-interpreter), CI included.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (INTERPRET and importlib.util.find_spec("triton")),
                                reason="needs TRITON_INTERPRET=1 with triton importable (no GPU)")


@pytest.mark.parametrize("lamport", [False, True])
def test_two_ranks_sum_add_and_normalize_like_the_unfused_ops(lamport):
    """Flags, or (lamport) the rows as their own flags: -0.0 sent as +0.0, and each slot read reset to -0.0."""
    from minisgl_cli.distributed.push_rows import FLAG, UNSET
    from minisgl_cli.kernels.fp8 import INV_MAX, TINY
    from minisgl_cli.kernels.triton import ops as triton_ops

    world, max_rows, n, dt = 2, 4, 64, torch.float16  # the interpreter's bf16 is not native: fp16
    slot = max_rows * n
    data_bytes = 2 * world * slot * dt.itemsize
    bufs = [torch.zeros(data_bytes + world * max_rows * FLAG.itemsize, dtype=torch.uint8) for _ in range(world)]
    if lamport:
        for b in bufs:
            b[:data_bytes].view(dt).fill_(-0.0)
    data = [b[:data_bytes].view(dt).view(2, world, max_rows, n) for b in bufs]
    data_ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    flag_ptrs = torch.tensor([b.data_ptr() + data_bytes for b in bufs], dtype=torch.int64)
    epochs = [torch.zeros(max_rows, dtype=FLAG) for _ in range(world)]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, generator=g).to(dt)

    def fused(rank: int, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        triton_ops._all_reduce_rmsnorm_kernel[(x.shape[0],)](
            x, residual, w, out, out, data_ptrs, flag_ptrs, epochs[rank], rank, slot, max_rows, residual.stride(0),
            out.stride(0), n, 1e-6, TINY, INV_MAX, WORLD=world, QUANT=False, LAMPORT=lamport, UNSET=UNSET[2],
            BLOCK=n, USE_PDL=False)
        return out

    def unset(rows: torch.Tensor) -> bool:
        return bool((rows.view(torch.int16) == UNSET[2]).all())

    for call, rows in ((1, 3), (2, 3), (3, 1)):
        parts = [torch.randn(rows, n, generator=g).to(dt) for _ in range(world)]
        parts[0][0, :5] = -0.0  # on the wire (lamport) +0.0: -0.0 would read as not yet written
        parts[1][-1, 3:7] = -0.0
        residual = torch.randn(rows, n, generator=g).to(dt)
        data[0][call % 2, 1, :rows] = parts[1] + 0.0 if lamport else parts[1]  # rank 1's push of this call, by hand
        if not lamport:
            bufs[0][data_bytes:].view(FLAG).view(world, max_rows)[1, :rows] = call
        res = [residual.clone() for _ in range(world)]
        outs = [fused(0, parts[0], res[0])]
        if lamport:
            assert unset(data[0][call % 2, 1, :rows]), "rank 0 left what it read"
        outs.append(fused(1, parts[1], res[1]))
        if lamport:
            assert unset(data[1][call % 2, 0, :rows]), "rank 1 left what it read"
        # The unfused ops: the sum rounded to the dtype, + residual rounded, then RMSNorm as layers/norm.py does.
        summed = ((parts[0].float() + parts[1].float()).to(dt).float() + residual.float()).to(dt)
        h = summed.float()
        want = (w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt).float()).to(dt)
        for r in range(world):
            assert torch.equal(res[r], summed), (call, r)
            assert torch.equal(outs[r], want), (call, r, (outs[r].float() - want.float()).abs().max())
        assert epochs[0][:rows].tolist() == epochs[1][:rows].tolist() == [call] * rows
        flags1 = bufs[1][data_bytes:].view(FLAG).view(world, max_rows)
        # rank 0 raised its flags on rank 1; with lamport none
        assert flags1[0, :rows].tolist() == [0 if lamport else call] * rows
