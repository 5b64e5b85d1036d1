"""FP8 attention for diffusion transformers: non-causal, unpaged self-attention over whole sequences (8-bit, opt-in).

A DiT's self-attention over a video's 32k tokens is most of its step (Wan2.1-1.3B at 832x480x81: 350 of 520 ms on
an H200, at ~565 TFLOPS in cuDNN's bf16 kernel). Both of its dots run here in FP8 e4m3, the rate Hopper's tensor
cores double, as SageAttention does with INT8:
- Q and K: one scale a token (a row of the QK^T tile: the scales multiply the fp32 scores after the dot). K is
  smoothed first by its mean over the sequence: `q . (k - mean)` differs from `q . k` by the same `q . mean` on
  every score of a row, which softmax ignores, and the spread left is what the 8 bits then cover.
- P (the softmax weights, in [0, 1] after the running-max shift) scales by 448 into e4m3's range; V has one scale
  a channel (over the sequence), applied to the output once at the end, with the 448.
- V is stored transposed (D x S), so the second dot reads its operand K-major, as Hopper's FP8 MMA wants.
Softmax runs in base 2 with the row sums from the unquantized weights, as in attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
FP8_MAX = 448.0
_P_SCALE = tl.constexpr(FP8_MAX)  # the softmax weights, [0, 1], times this fill e4m3's range
_NEG_INIT = tl.constexpr(-1.0e30)


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, S, H, D) q, k, v -> e4m3 codes and fp32 scales: q and k a token each (k less its mean), v a channel."""
    e4m3 = torch.float8_e4m3fn

    def per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / FP8_MAX
        return (x.float() / s).to(e4m3), s.squeeze(-1)  # codes (B, S, H, D), scales (B, S, H)

    q8, sq = per_token(q)
    k8, sk = per_token(k - k.mean(dim=1, keepdim=True))
    sv = v.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-8) / FP8_MAX  # (B, 1, H, D)
    v8t = (v.float() / sv).to(e4m3).permute(0, 2, 3, 1).contiguous()  # (B, H, D, S)
    return q8, sq, k8, sk, v8t, sv.squeeze(1)  # sv (B, H, D)


@triton.jit
def _fp8_attention(Q, SQ, K, SK, VT, SV, OUT, S_Q, S_K, H,
                   sqb, sqs, sqh, ssb, sss, ssh, skb, sks, skh, tkb, tks, tkh, stb, std, sth,
                   svb, svh, sob, sos, soh,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D)
    row_ok = rows < S_Q
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=row_ok[:, None], other=0.0)
    sq = tl.load(SQ + b * ssb + h * ssh + rows * sss, mask=row_ok, other=0.0)  # softmax scale * log2(e) in it
    m = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, S_K, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < S_K
        k = tl.load(K + b * skb + h * skh + cols[:, None] * sks + dims[None, :], mask=col_ok[:, None], other=0.0)
        sk = tl.load(SK + b * tkb + h * tkh + cols * tks, mask=col_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sq[:, None] * sk[None, :]
        s = tl.where(col_ok[None, :], s, _NEG_INIT)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        vt = tl.load(VT + b * stb + h * sth + dims[:, None] * std + cols[None, :], mask=col_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot((p * _P_SCALE).to(tl.float8e4nv), tl.trans(vt))
        m = m_new
    sv = tl.load(SV + b * svb + h * svh + dims)
    out = acc * (sv[None, :] / (row_sum[:, None] * _P_SCALE))
    tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + dims[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None])


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  block_m: int = 128, block_n: int = 128, num_warps: int = 8, num_stages: int = 3) -> torch.Tensor:
    """softmax(q k^T * scale) v over (B, S, H, D) tensors (diffusers' NHD layout), both dots in FP8; the output in
    q's dtype and layout. No mask, no causality: a DiT's self-attention."""
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    if d not in (64, 128) or k.shape[2] != h:
        raise ValueError(f"fp8 attention takes head_dim 64 or 128 and as many K as Q heads, got {d}, {k.shape[2]}/{h}")
    scale = d ** -0.5 if scale is None else scale
    q8, sq, k8, sk, v8t, sv = quantize_qkv(q, k, v)
    out = torch.empty_like(q)
    grid = (triton.cdiv(s_q, block_m), b * h)
    sq = sq * (scale * LOG2E)  # a float argument would reach the kernel as fp64 under torch.compile
    _fp8_attention[grid](q8, sq, k8, sk, v8t, sv, out, s_q, s_k, h,
                         q8.stride(0), q8.stride(1), q8.stride(2), sq.stride(0), sq.stride(1), sq.stride(2),
                         k8.stride(0), k8.stride(1), k8.stride(2), sk.stride(0), sk.stride(1), sk.stride(2),
                         v8t.stride(0), v8t.stride(2), v8t.stride(1),
                         sv.stride(0), sv.stride(1), out.stride(0), out.stride(1), out.stride(2),
                         D=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return out
