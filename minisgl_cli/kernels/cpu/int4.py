"""The int4 decode GEMM of the CPU default mode: `minisgl::int4_mm` (csrc/int4_mm.cpp), built once for this CPU and
torch into the cache, and its weight layout.

ATen's `_weight_int4pack_mm_for_cpu` unpacks and scales each weight again for every 4 rows and multiplies in fp32
FMAs; this kernel unpacks a weight vector once for up to 12 rows and multiplies the 4-bit codes by the bf16
activations with AVX512-BF16 pair dot products (exact products), applying Q4_1's scale and min once a group of 32.
With a step's weights streaming from memory it is 1.3x ATen's speed at one row and ~2x at 16
(`python examples/bench_cpu_linear.py --kernels int4 int4-minisgl`). Like ATen's, it gives a row the same bits
whatever the rows beside it.

It needs AVX512-BF16 and a C++ compiler (`c++` or $CXX; the compiled decode step needs one too); elsewhere, or with
MINISGL_CPU_INT4=aten, the int4 method packs for ATen's kernel instead. Which one a process uses is fixed at its
first int4 layer (`kernel()`), and the compiled decode step's key names it. The two round differently: each
process's greedy answers are consistent, not bit-equal across the two kernels.
"""

from __future__ import annotations

import functools

import torch

from minisgl_cli import env
from minisgl_cli.kernels.cpu import library as cpu_library

GROUP = 32  # inputs per scale and min (GGUF's Q4_1 block)


@functools.cache
def kernel() -> str:
    """"minisgl" where this process runs minisgl::int4_mm, else "aten" (MINISGL_CPU_INT4=aten, or the kernels'
    library did not load: kernels/cpu/library.py)."""
    choice = env.cpu_int4()
    if choice == "aten":
        return "aten"
    why = cpu_library.missing("int4_mm")
    if why is None:
        return "minisgl"
    if choice == "minisgl":
        raise RuntimeError(f"MINISGL_CPU_INT4=minisgl: the int4 kernel is not available: {why}")
    return "aten"  # cpu_library.load logged why


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """minisgl::int4_mm's layout of Q4_1 groups (w = scale * q + low): q [N, K] codes 0..15 -> [N / 16, K / 2, 16]
    bytes, scale and low [N, K / 32] -> [N / 16, K / 32, 2, 16] fp16. N a multiple of 16."""
    n, k = q.shape
    pairs = (q[:, 0::2] | (q[:, 1::2] << 4)).view(n // 16, 16, k // 2).transpose(1, 2).contiguous()
    sm = torch.stack([scale, low], dim=-1).view(n // 16, 16, k // GROUP, 2).permute(0, 2, 3, 1)
    return pairs, sm.to(torch.float16).contiguous()


def mm(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times the packed weight's transpose: [M, N] bf16."""
    return torch.ops.minisgl.int4_mm(x, qweight, qscale)
