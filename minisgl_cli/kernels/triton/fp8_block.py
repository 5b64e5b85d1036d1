"""Block-wise FP8 GEMM (W8A8) for checkpoints shipped in DeepSeek-V3's FP8 form: y = x W^T with W's e4m3 codes and
one fp32 scale per (bn x bk) block (loader/blocks.py's Fp8Blocks), x quantized per token per bk columns on the fly.

  quant_groups     one program a (row, group): the group's amax, its scale (kernels/fp8.py's quantize_groups: the
                   same codes and scales as the torch code, by IEEE division)
  block_fp8_mm     one program a (BLOCK_M x BLOCK_N) tile of y; each step over K is one group (BLOCK_K = bk), so the
                   tile's e4m3 dot in fp32 is scaled once by the rows' group scales and the columns' block scales
                   before it joins the sum (as sglang's w8a8_block_fp8_matmul and DeepSeek's own kernel)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl_cli.kernels.fp8 import FP8, INV_MAX, TINY
from minisgl_cli.kernels.triton.fp8 import fp8_codes


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s, K, tiny, inv_max,
                         GROUP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    mask = (tl.arange(0, BLOCK) < GROUP) & (offs < K)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), tiny) * inv_max
    tl.store(q_ptr + row * stride_q + offs, fp8_codes(x, scale, q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_s + g, scale)


def quant_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 scales [M, ceil(K / group)]): kernels/fp8.py's quantize_groups."""
    m, k = x.shape
    assert x.stride(1) == 1
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quant_groups_kernel[(m, groups)](x, q, s, x.stride(0), q.stride(0), s.stride(0), k, TINY, INV_MAX,
                                          GROUP=group, BLOCK=triton.next_power_of_2(group))
    return q, s


@triton.jit
def _block_fp8_mm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
                         stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                         GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn
    a_scales = as_ptr + offs_m * stride_asm
    b_scales = bs_ptr + (offs_n // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):  # one step a K-group: its scales are one per row and one per column
        k = g * BLOCK_K + offs_k
        a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & (k[None, :] < K), other=0.0)
        b = tl.load(b_cols + k[:, None], mask=(k[:, None] < K) & n_mask[None, :], other=0.0)
        sa = tl.load(a_scales + g, mask=m_mask, other=0.0)
        sb = tl.load(b_scales + g, mask=n_mask, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def block_fp8_mm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, block: tuple[int, int],
                 out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] e4m3 with xs [M, ceil(K / bk)] (quant_groups'), w [N, K] e4m3 with ws [ceil(N / bn), ceil(K / bk)]
    -> [M, N] in out_dtype: sum over groups of (xq_g . w_g) * xs[m, g] * ws[n // bn, g], in fp32."""
    m, k = xq.shape
    n = w.shape[0]
    bn, bk = block
    assert w.shape[1] == k and xq.stride(1) == 1 and w.stride(1) == 1 and bk >= 16 and bk & (bk - 1) == 0
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    block_m = 16 if m <= 16 else 64
    block_n = 128 if bn >= 128 else max(16, triton.next_power_of_2(bn))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if m:
        _block_fp8_mm_kernel[grid](xq, w, out, xs, ws, m, n, k, xq.stride(0), w.stride(0), out.stride(0),
                                   xs.stride(0), ws.stride(0), GROUP_N=bn, BLOCK_M=block_m, BLOCK_N=block_n,
                                   BLOCK_K=bk, num_warps=4, num_stages=3)
    return out


def block_fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] (16-bit) W^T for block-wise FP8 W: x quantized per token per bk columns, then block_fp8_mm."""
    xq, xs = quant_groups(x.contiguous(), block[1])
    return block_fp8_mm(xq, xs, w, ws, block, x.dtype)
