"""FP8 Triton kernels (CUDA): activations to e4m3 per token for the FP8 GEMM, alone or fused into SiLU-and-mul.

Each program owns one row, so the row's amax, its scale and its codes come out of one pass over the row
(for `torch._scaled_mm`'s row-wise scaling: codes [M, K] and an fp32 scale per row [M, 1]). `fp8_codes`
is kernels/fp8.py's quantize in Triton (IEEE division), shared with the KV-store kernels, so both give the
same 8-bit codes as the torch code they are tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minisgl_cli.kernels.fp8 import FP8, INV_MAX, TINY
from minisgl_cli.kernels.triton.pdl import pdl_kwargs


@triton.jit
def fp8_codes(x, scale, dtype: tl.constexpr):
    """kernels/fp8.py's quantize: x / scale (IEEE division) clamped to +-448, rounded to e4m3 `dtype`."""
    return tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0).to(dtype)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, K, tiny, inv_max,
                       ACT_MUL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ACT_MUL:  # x is [gate | up] of 2K: silu(gate) * up, rounded as kernels/triton/ops.py's silu_and_mul does
        u = tl.load(x_ptr + row * stride_x + K + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        act = (xf / (1.0 + tl.exp(-xf))).to(x.dtype).to(tl.float32)
        x = (act * u.to(tl.float32)).to(x.dtype)
    xf = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(xf), axis=0), tiny) * inv_max  # kernels/fp8.py's row_scales
    tl.store(q_ptr + row * stride_q + offs, fp8_codes(xf, scale, q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quant_rows(x: torch.Tensor, act_mul: bool = False, pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit) -> (e4m3 codes [M, K], fp32 scales [M, 1]), one scale per row (kernels/fp8.quantize_rows).

    act_mul: x is a fused [M, 2K] gate-up and the rows quantized are silu(gate) * up."""
    m, k = x.shape
    if act_mul:
        k //= 2
    assert x.stride(1) == 1
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quant_rows_kernel[(m,)](
            x, q, s, x.stride(0), q.stride(0), k, TINY, INV_MAX, ACT_MUL=act_mul, BLOCK=block,
            num_warps=min(16, max(1, block // 512)), **pdl_kwargs(x, pdl),
        )
    return q, s

