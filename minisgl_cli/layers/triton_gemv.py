"""Single-row matmul (GEMV) in Triton for batch-1 decode, optionally with SiLU-and-mul fused into its input.

At one token per step a linear layer is a pass over its weight: time = bytes / bandwidth plus the
kernel's start-up. cuBLAS's GEMV is tuned for neither end here (5-6 us on a 4-8 MB Qwen3-0.6B matrix,
~80% of copy bandwidth on Llama-8B's big ones). This kernel gives each program BLOCK_N output rows and
walks K in wide contiguous chunks, so every load is a long coalesced run of the weight, and a grid of
N / BLOCK_N programs covers every SM many times. Measured in one H100 run (weights cold in L2, inside
a CUDA graph): 3.4-6 us vs cuBLAS's 5.8-9.3 on Qwen3-0.6B's layers, 2.6-3.1 TB/s vs 2.1-2.8 on
Llama-8B's. CUDA only; callers fall back to torch for more rows or other devices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minisgl_cli.layers.pdl import pdl_kwargs


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_w,
                 HAS_BIAS: tl.constexpr, ACT_MUL: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mask_n = rn < N  # K masks stay vectorisable: K is specialised on divisibility by 16
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
    # The weights never depend on an earlier kernel: the first chunk streams in before waiting for x
    # (under programmatic dependent launch that overlaps the previous kernel's tail).
    w = tl.load(w_ptrs, mask=mask_n[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mk = (k0 + rk) < K
        x = tl.load(x_ptr + k0 + rk, mask=mk, other=0.0)
        xf = x.to(tl.float32)
        if ACT_MUL:  # x is [gate | up] of 2K: silu(gate) * up, rounded where the unfused path rounds
            u = tl.load(x_ptr + K + k0 + rk, mask=mk, other=0.0)
            act = (xf / (1.0 + tl.exp(-xf))).to(x.dtype).to(tl.float32)
            xf = (act * u.to(tl.float32)).to(x.dtype).to(tl.float32)
        acc += w.to(tl.float32) * xf[None, :]
        w_ptrs += BLOCK_K
        nk = (k0 + BLOCK_K + rk) < K  # all false after the last chunk: no memory is touched
        w = tl.load(w_ptrs, mask=mask_n[:, None] & nk[None, :], other=0.0, eviction_policy="evict_first")
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def pick_config(n: int, k: int, act_mul: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps), from a sweep on an H100 (examples/gpu_bench.py --only gemv).

    Few rows per program win everywhere (more programs in flight to hide the DRAM latency); long K
    rows take 512-wide chunks, short ones 1024. The fused SiLU input needs more registers per chunk.
    """
    if k >= 4096:
        return (4 if act_mul else 1), 512, 4
    return (
        (1 if n <= 1024 and not act_mul else 2),
        min(1024, triton.next_power_of_2(k)),
        (8 if act_mul or n <= 1024 else 4),
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act_mul: bool = False,
         config: tuple[int, int, int] | None = None, pdl: bool = True) -> torch.Tensor:
    """y[1, N] = f(x) @ weight[N, K]^T (+ bias); f(x) = silu(x[:, :K]) * x[:, K:] when act_mul (x is [1, 2K])."""
    n, k = weight.shape
    assert x.shape[0] == 1 and x.shape[-1] == (2 * k if act_mul else k) and x.is_contiguous()
    assert weight.stride(1) == 1
    block_n, block_k, warps = config or pick_config(n, k, act_mul)
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, ACT_MUL=act_mul,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_kwargs(x, pdl),
    )
    return y
