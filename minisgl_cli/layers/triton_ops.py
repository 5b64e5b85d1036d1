"""Fused Triton kernels for the decoder's small ops (CUDA only): add+RMSNorm, q/k-norm+RoPE, SiLU-and-mul.

Each replaces a chain of 3 to 10 elementwise torch kernels with one pass over the data. They round
to the engine dtype at the same points as the torch reference (and HF transformers) do, so bf16
results match it to within an ulp here and there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, N, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # residual = x + residual in the engine dtype (as the torch add rounds), written back in place
        s = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = s.to(x.dtype)
        tl.store(r_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    h = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w * h).to(x.dtype), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of a 2-D x; with `residual`, first residual += x (in place) and norm that."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, x2.stride(0), r2.stride(0), out.stride(0), n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return out.view(x.shape)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, stride_t, stride_cos, eps,
                         NUM_Q: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # head: q heads first, then k heads (their layout inside the fused qkv row)
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)
    base = qkv_ptr + t * stride_t + j * HEAD_DIM
    x1 = tl.load(base + offs)
    x2 = tl.load(base + half + offs)
    dt = x1.dtype
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / HEAD_DIM + eps)
        if j < NUM_Q:
            w1, w2 = tl.load(qw_ptr + offs), tl.load(qw_ptr + half + offs)
        else:
            w1, w2 = tl.load(kw_ptr + offs), tl.load(kw_ptr + half + offs)
        x1 = (w1.to(tl.float32) * (f1 * rstd).to(dt).to(tl.float32)).to(dt)
        x2 = (w2.to(tl.float32) * (f2 * rstd).to(dt).to(tl.float32)).to(dt)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_cos + offs).to(dt).to(tl.float32)  # cos/sin repeat over the halves
    s = tl.load(sin_ptr + pos * stride_cos + offs).to(dt).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # x*cos + rotate_half(x)*sin with the reference's roundings: each product, then the sum
    o1 = (a1 * c).to(dt).to(tl.float32) + (-a2 * s).to(dt).to(tl.float32)
    o2 = (a2 * c).to(dt).to(tl.float32) + (a1 * s).to(dt).to(tl.float32)
    tl.store(base + offs, o1.to(dt))
    tl.store(base + half + offs, o2.to(dt))


def qk_norm_rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_q: int, num_kv: int, head_dim: int, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float) -> None:
    """In place on the q and k heads of a fused qkv [T, (Hq + 2 Hkv) * D]: optional per-head RMSNorm, then RoPE."""
    T = qkv.shape[0]
    if T == 0:
        return
    has_norm = q_weight is not None
    qw = q_weight if has_norm else cos
    kw = k_weight if has_norm else cos
    _qk_norm_rope_kernel[(T, num_q + num_kv)](
        qkv, positions, cos, sin, qw, kw, qkv.stride(0), cos.stride(0), eps,
        NUM_Q=num_q, HEAD_DIM=head_dim, HAS_NORM=has_norm, num_warps=1,
    )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    T, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(2048, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(T, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
        )
    return out
