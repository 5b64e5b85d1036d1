"""Triton kernel for MLA's absorbed decode (attention/mla.py): H query heads over one shared latent row a token.

Each decode row's query is [q_nope W_UK | q_pe] (R + P wide); each cached token of its request is one pool row
[c | k_pe] (kvcache/pool.py's latent shape), read once for all of the program's heads: the score is
q_lat . c + q_pe . k_pe, the value c itself, so the output is [B, H, R] in the latent space (W_UV applies after).
One program a (request, block of heads, split of the keys) walks its share of the request's keys through the page
table in tiles with an online softmax in base 2 (as kernels/triton/attention.py: scores scaled by scale * log2(e),
maxima from a large finite negative number). A small batch leaves most SMs idle with one program a request and head
block (at batch 1 on an H200: one of 132, the whole context walked serially), so the keys are split: `splits`
programs a (request, head block), sized from the batch alone (a captured graph's shapes fix it; the context length
lives on the device), each writing its normalized output and log-sum-exp, and a second kernel merging them.

FP8 latent rows (`KV_FP8`: e4m3 codes of row - mean, one fp32 scale a layer, kvcache/pool.py) are widened to the
query's dtype on load (exact: every e4m3 value is a bf16 / fp32 one) and the scale and mean stay out of the tiles, as
kernels/triton/attention.py does for MHA: the scale joins the logits' scalar, the mean's q . mean shifts every logit of
a row alike (left out), and the output is scale * sum(p code) + mean (sum(p) = 1) over the latent columns, applied
where the output is final (the one split's store, or the merge).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl_cli.kernels.fp8 import KVQuant

_LOG2E = 1.4426950408889634


@triton.jit
def _mla_decode_kernel(
    Q, KV, PT, ROWS, LENS, OUT, LSE, K_SCALE, K_MEAN, qk_scale,
    stride_qb, stride_qh, stride_kv, stride_pt, stride_ob, stride_os, stride_oh,
    H: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    hmask = heads < H
    q_rows = Q + b * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + r[None, :], mask=hmask[:, None] & (r[None, :] < R), other=0.0)
    q_pe = tl.load(q_rows + R + p[None, :], mask=hmask[:, None] & (p[None, :] < P), other=0.0)
    row = tl.load(ROWS + b)
    n = tl.load(LENS + b)
    per = _split_keys(n, SPLITS, BLOCK_N)
    lo = split * per
    hi = tl.minimum(n, lo + per)
    if KV_FP8:  # the layer's one scale joins the logits' scalar (see the module docstring)
        qk_scale = qk_scale * tl.load(K_SCALE)
    m = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        nmask = offs < hi
        slots = tl.load(PT + row * stride_pt + offs, mask=nmask, other=0).to(tl.int64)
        kv_rows = KV + slots[:, None] * stride_kv
        c = tl.load(kv_rows + r[None, :], mask=nmask[:, None] & (r[None, :] < R), other=0.0)
        k_pe = tl.load(kv_rows + R + p[None, :], mask=nmask[:, None] & (p[None, :] < P), other=0.0)
        if KV_FP8:  # codes widened as they load
            c = c.to(q_lat.dtype)
            k_pe = k_pe.to(q_pe.dtype)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        s = tl.where(nmask[None, :], s * qk_scale, -1.0e30)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.dot(w.to(c.dtype), c, input_precision=PRECISION)
        m = m_new
    out = acc / tl.maximum(denom, 1.0e-30)[:, None]  # an empty split: 0, and a log-sum-exp that weighs nothing
    if KV_FP8 and SPLITS == 1:  # final here: back from the codes' space
        out = out * tl.load(K_SCALE) + tl.load(K_MEAN + r, mask=r < R, other=0.0)[None, :]
    o_ptrs = OUT + b * stride_ob + split * stride_os + heads[:, None] * stride_oh + r[None, :]
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=hmask[:, None] & (r[None, :] < R))
    if SPLITS > 1:
        lse = tl.where(denom > 0, m + tl.log2(tl.maximum(denom, 1.0e-30)), -1.0e30)
        tl.store(LSE + (b * SPLITS + split) * H + heads, lse, mask=hmask)


@triton.jit
def _split_keys(n, SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys of each split of a request of n: whole tiles, the last live split short, the ones past it empty."""
    return tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _mla_merge_kernel(PART, LSE, OUT, LENS, K_SCALE, K_MEAN, stride_pb, stride_ps, stride_ph, stride_ob, stride_oh,
                      H: tl.constexpr, R: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, KV_FP8: tl.constexpr):
    """OUT[b, heads] = the splits' outputs weighted by their share of the softmax's mass (2^(lse - max)). Only the
    splits that saw a key are read: an empty one weighs exactly 0 (its lse is -1e30, its part 0), so leaving it out
    changes no bit, and a short context's few live splits cost a few loads, not SPLITS."""
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    hmask = heads < H
    mask = hmask[:, None] & (r[None, :] < R)
    n = tl.load(LENS + b)
    live = tl.maximum(tl.cdiv(n, tl.maximum(_split_keys(n, SPLITS, BLOCK_N), 1)), 1)  # (an empty row: split 0's 0)
    top = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    for i in range(live):
        top = tl.maximum(top, tl.load(LSE + (b * SPLITS + i) * H + heads, mask=hmask, other=-1.0e30))
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for i in range(live):
        w = tl.exp2(tl.load(LSE + (b * SPLITS + i) * H + heads, mask=hmask, other=-1.0e30) - top)
        part = tl.load(PART + b * stride_pb + i * stride_ps + heads[:, None] * stride_ph + r[None, :], mask=mask,
                       other=0.0)
        acc += w[:, None] * part
        total += w
    out = acc / total[:, None]
    if KV_FP8:
        out = out * tl.load(K_SCALE) + tl.load(K_MEAN + r, mask=r < R, other=0.0)[None, :]
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + r[None, :], out.to(OUT.dtype.element_ty), mask=mask)


def splits_for(bsz: int, heads: int, sms: int = 132) -> int:
    """Key splits a (request, head block): enough programs to fill the SMs about once, from the batch's shape alone
    (1 from 8 requests of 16 heads up on an H200's 132 SMs)."""
    return max(1, min(16, sms // (bsz * triton.cdiv(heads, 16))))


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, page_table: torch.Tensor, req_rows: torch.Tensor,
               seq_lens: torch.Tensor, kv_lora_rank: int, scale: float, quant: KVQuant | None = None,
               splits: int | None = None) -> torch.Tensor:
    """q [B, H, R + P] (the absorbed queries), kv_cache [slots, 1, R + P] (a layer's latent rows) -> [B, H, R]:
    softmax(q . row * scale) over each request's seq_lens[b] rows page_table[req_rows[b], :], times their c.
    quant: an FP8 pool's scale and means of this layer (its K's: kernels/fp8.py), the rows its e4m3 codes.
    `splits`: key splits a request (default `splits_for` the batch on this device's SM count)."""
    bsz, heads, width = q.shape
    rank, rope = kv_lora_rank, width - kv_lora_rank
    assert kv_cache.shape[1:] == (1, width) and kv_cache.stride(-1) == 1 and q.stride(-1) == 1
    block_h = 16  # tl.dot's smallest tile: query heads are the rows
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = 16 if block_r >= 512 else 32  # keep the latent tile (BLOCK_N x R) in registers
    if splits is None:
        # (Triton's interpreter on the CPU runs one program at a time: no split pays there)
        splits = splits_for(bsz, heads, torch.cuda.get_device_properties(q.device).multi_processor_count) \
            if q.is_cuda else 1
    out = torch.empty((bsz, heads, rank), dtype=q.dtype, device=q.device)
    # one split writes the output itself; more write fp32 parts and their log-sum-exps for the merge
    part = out[:, None] if splits == 1 else torch.empty((bsz, splits, heads, rank), dtype=torch.float32,
                                                            device=q.device)
    lse = part if splits == 1 else torch.empty((bsz, splits, heads), dtype=torch.float32, device=q.device)
    grid = (bsz, triton.cdiv(heads, block_h), splits)
    fp8 = (quant.k_scale, quant.k_mean) if quant is not None else (q, q)  # placeholders, never read
    _mla_decode_kernel[grid](
        q, kv_cache, page_table, req_rows, seq_lens, part, lse, *fp8, scale * _LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), page_table.stride(0), part.stride(0), part.stride(1),
        part.stride(2), H=heads, R=rank, P=rope, BLOCK_H=block_h, BLOCK_R=block_r,
        BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_N=block_n, SPLITS=splits,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", KV_FP8=quant is not None, num_warps=4,
        num_stages=1,
    )
    if splits > 1:
        _mla_merge_kernel[(bsz, triton.cdiv(heads, block_h))](
            part, lse, out, seq_lens, *fp8, part.stride(0), part.stride(1), part.stride(2), out.stride(0),
            out.stride(1), H=heads, R=rank, SPLITS=splits, BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_N=block_n,
            KV_FP8=quant is not None, num_warps=4)
    return out
