"""FP8 attention for diffusion transformers: non-causal, unpaged self-attention over whole sequences (8-bit, opt-in).

A DiT's self-attention over a video's 32k tokens is most of its step (Wan2.1-1.3B at 832x480x81: 350 of 520 ms on
an H200, at ~565 TFLOPS in cuDNN's bf16 kernel). Both of its dots run here in FP8 e4m3, the rate Hopper's tensor
cores double, as SageAttention does with INT8:
- Q: one scale a token (a row of the QK^T tile: it multiplies the fp32 scores after the dot, with the softmax scale
  and log2(e) folded in). K: one scale a tile of BLOCK_N tokens (a scalar a loop step, so the scores take one
  multiply-add on their way to exp2), after smoothing by its mean over the sequence: `q . (k - mean)` differs from
  `q . k` by the same `q . mean` on every score of a row, which softmax ignores, and the spread left is what the
  8 bits then cover.
- P (the softmax weights) comes out of exp2 already in e4m3's range: the running max is shifted by log2(445), so
  the largest weight is 445 rather than 1, and the row sums, taken from the same weights, cancel the factor.
  V has one scale a channel (over the sequence), applied to the output once at the end.
- The codes are laid out head-major and padded to whole tiles, V transposed (D x S), so every tile is one TMA
  (tensor-descriptor) load in bounds and the second dot reads its operand K-major, as Hopper's FP8 MMA wants;
  only the last key tile masks its padding. The codes come from two Triton passes (quantize_qkv).
Tiles: 64 queries x 128 keys on 4 warps, 3 stages, the fastest of those examples/dit_attention_probe.py tried on
an H200 (~790 TFLOPS at Wan's shape, 1.37x cuDNN's bf16; 1.32x with the quantization). Tried and slower there:
128-query tiles on 8 warps, 64-key tiles, Triton's warp specialization (equal), and the exponentials in fp16 pairs
(ex2.approx.f16x2: the conversions cost more than the halved MUFU work saved).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from minisgl_cli.kernels.fp8 import FP8_MAX

LOG2E = 1.4426950408889634
_FP8_MAX = tl.constexpr(FP8_MAX)
_P_SHIFT = tl.constexpr(8.8)  # log2 of the largest softmax weight, 2^8.8 ~ 445 < 448 (e4m3's max)


@dataclass(frozen=True)
class Tiles:
    """The kernel's launch shape: queries and keys a tile (the quantization's tiles too), warps, pipeline stages."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    warp_specialize: bool = False


@dataclass
class Fp8QKV:
    """Attention inputs in e4m3, head-major and padded to whole tiles, with their fp32 scales."""

    q: torch.Tensor  # (B, H, S_q_pad, D) codes
    q_scale: torch.Tensor  # (B, H, S_q_pad): a token's scale times softmax scale times log2(e)
    k: torch.Tensor  # (B, H, S_k_pad, D) codes of k less its mean over the sequence
    k_scale: torch.Tensor  # (B, H, S_k_pad // block_n): one a tile of keys
    vt: torch.Tensor  # (B, H, D, S_k_pad) codes, transposed
    v_scale: torch.Tensor  # (B, H, D): one a channel


@triton.jit
def _quantize_q(X, CODES, SCALES, S, H, S_PAD, sxb, sxs, sxh, scale, D: tl.constexpr, TILE: tl.constexpr):
    """A tile of query tokens of one head: e4m3 codes, one scale a token (times `scale`), zeros past S."""
    bh = tl.program_id(1).to(tl.int64)  # offsets past 2^31 elements at large batches
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    dims = tl.arange(0, D)
    x = tl.load(X + bh // H * sxb + bh % H * sxh + rows[:, None] * sxs + dims[None, :], mask=(rows < S)[:, None],
                other=0.0).to(tl.float32)
    s = tl.maximum(tl.max(tl.abs(x), 1), 1e-8) / _FP8_MAX
    tl.store(CODES + (bh * S_PAD + rows)[:, None] * D + dims[None, :], (x / s[:, None]).to(tl.float8e4nv))
    tl.store(SCALES + bh * S_PAD + rows, s * scale)


@triton.jit
def _quantize_kv(K, V, K_MEAN, V_SCALE, K_CODES, K_SCALES, VT_CODES, S, H, S_PAD, skb, sks, skh, svb, svs, svh,
                 D: tl.constexpr, TILE: tl.constexpr):
    """A tile of key / value tokens of one head: k less its mean in e4m3 with one scale for the tile; v's codes by
    its channel scales, stored transposed (D x S_PAD); zeros past S."""
    bh = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0)
    b = bh // H
    h = bh % H
    rows = t * TILE + tl.arange(0, TILE)
    dims = tl.arange(0, D)
    ok = (rows < S)[:, None]
    k = tl.load(K + b * skb + h * skh + rows[:, None] * sks + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    k = tl.where(ok, k - tl.load(K_MEAN + bh * D + dims)[None, :], 0.0)
    s = tl.maximum(tl.max(tl.abs(k)), 1e-8) / _FP8_MAX
    tl.store(K_CODES + (bh * S_PAD + rows)[:, None] * D + dims[None, :], (k / s).to(tl.float8e4nv))
    tl.store(K_SCALES + bh * (S_PAD // TILE) + t, s)
    v = tl.load(V + b * svb + h * svh + rows[:, None] * svs + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    v = v / tl.load(V_SCALE + bh * D + dims)[None, :]
    tl.store(VT_CODES + (bh * D + dims)[:, None] * S_PAD + rows[None, :], tl.trans(v).to(tl.float8e4nv))


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_m: int,
                 block_n: int) -> Fp8QKV:
    """(B, S, H, D) q, k, v -> e4m3 codes and scales (Fp8QKV): two reductions over the sequence (k's mean, v's
    channel maxima) and two Triton passes."""
    b, s_q, h, d = q.shape
    s_k = k.shape[1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    s_q_pad, s_k_pad = triton.cdiv(s_q, block_m) * block_m, triton.cdiv(s_k, block_n) * block_n
    e4m3 = torch.float8_e4m3fn
    q8 = torch.empty(b, h, s_q_pad, d, device=q.device, dtype=e4m3)
    sq = torch.empty(b, h, s_q_pad, device=q.device, dtype=torch.float32)
    _quantize_q[(s_q_pad // block_m, b * h)](q, q8, sq, s_q, h, s_q_pad, q.stride(0), q.stride(1), q.stride(2),
                                             scale * LOG2E, D=d, TILE=block_m)
    k_mean = k.mean(dim=1, dtype=torch.float32).contiguous()  # (B, H, D)
    sv = (torch.linalg.vector_norm(v, float("inf"), dim=1, dtype=torch.float32).clamp(min=1e-8) / FP8_MAX).contiguous()
    k8 = torch.empty(b, h, s_k_pad, d, device=q.device, dtype=e4m3)
    sk = torch.empty(b, h, s_k_pad // block_n, device=q.device, dtype=torch.float32)
    vt = torch.empty(b, h, d, s_k_pad, device=q.device, dtype=e4m3)
    _quantize_kv[(s_k_pad // block_n, b * h)](k, v, k_mean, sv, k8, sk, vt, s_k, h, s_k_pad, k.stride(0),
                                              k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                                              D=d, TILE=block_n)
    return Fp8QKV(q8, sq, k8, sk, vt, sv)


@triton.jit
def _key_tile(q, sq, K, SK, VT, acc, row_sum, m, start, bh, S_K, S_K_PAD, D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASK: tl.constexpr):
    """One tile of keys into the running softmax (m, row_sum) and output (acc)."""
    k = K.load([bh * S_K_PAD + start, 0])
    qk = tl.dot(q, k.T)
    if MASK:
        qk = tl.where((start + tl.arange(0, BLOCK_N) < S_K)[None, :], qk, float("-inf"))
    c = sq * tl.load(SK + bh * (S_K_PAD // BLOCK_N) + start // BLOCK_N)
    m_new = tl.maximum(m, tl.max(qk, 1) * c)
    p = tl.exp2(qk * c[:, None] - (m_new - _P_SHIFT)[:, None])
    alpha = tl.exp2(m - m_new)
    row_sum = row_sum * alpha + tl.sum(p, 1)
    vt = VT.load([bh * D, start])
    acc = tl.dot(p.to(tl.float8e4nv), vt.T, acc * alpha[:, None])
    return acc, row_sum, m_new


@triton.jit
def _fp8_attention(Q, SQ, K, SK, VT, SV, OUT, S_Q, S_K, H, S_Q_PAD, S_K_PAD, sob, sos, soh,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = Q.load([bh * S_Q_PAD + pid_m * BLOCK_M, 0])
    sq = tl.load(SQ + bh * S_Q_PAD + rows)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    whole = S_K // BLOCK_N * BLOCK_N
    for start in tl.range(0, whole, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        acc, row_sum, m = _key_tile(q, sq, K, SK, VT, acc, row_sum, m, start, bh, S_K, S_K_PAD, D, BLOCK_N, False)
    if whole < S_K:  # the last tile's padding masked
        acc, row_sum, m = _key_tile(q, sq, K, SK, VT, acc, row_sum, m, whole, bh, S_K, S_K_PAD, D, BLOCK_N, True)
    sv = tl.load(SV + bh * D + tl.arange(0, D))
    out = acc * (sv[None, :] / row_sum[:, None])
    b = (bh // H).to(tl.int64)
    h = bh % H
    dims = tl.arange(0, D)
    tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + dims[None, :], out.to(OUT.dtype.element_ty),
             mask=(rows < S_Q)[:, None])


def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  tiles: Tiles = Tiles()) -> torch.Tensor:
    """softmax(q k^T * scale) v over (B, S, H, D) tensors (diffusers' NHD layout), both dots in FP8; the output in
    q's dtype and shape, contiguous. No mask, no causality: a DiT's self-attention."""
    b, s_q, h, d = q.shape
    if d not in (64, 128) or k.shape[2] != h:
        raise ValueError(f"fp8 attention takes head_dim 64 or 128 and as many K as Q heads, got {d}, {k.shape[2]}/{h}")
    x = quantize_qkv(q, k, v, d ** -0.5 if scale is None else scale, tiles.block_m, tiles.block_n)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)  # contiguous, whatever q's strides: the op's fake
    attend(x, out, k.shape[1], tiles)
    return out


def attend(x: Fp8QKV, out: torch.Tensor, s_k: int, tiles: Tiles = Tiles()) -> None:
    """The kernel alone: quantized inputs (quantize_qkv's, with the same tiles) into `out` (B, S_q, H, D)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    block_m, block_n = tiles.block_m, tiles.block_n
    b, h, s_q_pad, d = x.q.shape
    s_k_pad = x.k.shape[2]
    qd = TensorDescriptor.from_tensor(x.q.view(-1, d), [block_m, d])
    kd = TensorDescriptor.from_tensor(x.k.view(-1, d), [block_n, d])
    vd = TensorDescriptor.from_tensor(x.vt.view(-1, s_k_pad), [d, block_n])
    grid = (s_q_pad // block_m, b * h)
    _fp8_attention[grid](qd, x.q_scale, kd, x.k_scale, vd, x.v_scale, out, out.shape[1], s_k, h, s_q_pad, s_k_pad,
                         out.stride(0), out.stride(1), out.stride(2), D=d, BLOCK_M=block_m, BLOCK_N=block_n,
                         WARP_SPECIALIZE=tiles.warp_specialize, num_warps=tiles.num_warps,
                         num_stages=tiles.num_stages)


@torch.library.custom_op("minisgl::dit_fp8_attention", mutates_args=())
def fp8_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """fp8_attention at its default tiles as one opaque op: a compiled DiT block calls it as is, and its host-side
    TMA descriptors stay out of the traced graph."""
    return fp8_attention(q, k, v, scale)


@fp8_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    return q.new_empty(q.shape)
