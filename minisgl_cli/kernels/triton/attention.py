"""Triton kernels for paged attention: split-K decode (partial + reduce), causal extend over a cached prefix, KV store.

All kernels read the KV pool through the page table: request row `r` keeps the KV slot of position `p`
at `page_table[r, p]`, and slot `s` of layer `l` lives at `k[l][s, kv_head, :]`. Reading one slot index
per position (instead of one page index per page) makes the kernels independent of the page size and
of how pages are laid out; the index costs 4 bytes next to the 2 * head_dim * 2 bytes of K and V it
locates, so it is close to free.

Softmax runs in base 2: scores are multiplied by `scale * log2(e)` once and `exp2` is used throughout,
which is what the hardware computes natively (`exp(x) == exp2(x * log2(e))`). Log-sum-exps written
between the two decode stages are base-2 as well.

Running maxima start at a large finite negative number instead of -inf, so that a tile whose keys are
all masked gives `exp2(-inf - m) = 0` and `exp2(m_old - m_new) = 1` rather than NaN from `-inf - -inf`.

FP8 KV (`KV_FP8`: the pool holds e4m3 codes of x - mean, one fp32 scale per KV head, kvcache/pool.py): K and
V tiles load as 8 bits, half the bytes, and widen in registers to fp16 (exact for every e4m3 code; one
hardware conversion per pair on Hopper), and q and the softmax weights p go to fp16 for the two dots. Scales
and means never touch a tile: a program works on one KV head, so K's scale folds into the scalar that
already scales the logits, K's mean is left out (it adds the same q . mean to every logit of a row), and
V's scale and mean apply to the output once at the end (out = scale * sum(p code) + mean, as sum(p) = 1).

Sliding windows and sinks (per layer, so CUDA graphs capture them as constants; each a constexpr switch too, so a
full-attention layer runs the kernels it ran before them, with no window arithmetic): `window` > 0 limits a query at
position p to keys p - window + 1 .. p (decode splits only that span; extend starts at the first tile a block's
first row sees and masks every tile); `sinks` [H] fp32 add exp(sink) to each head's softmax denominator only,
at the end (decode: in the reduce, or the single split's own normalisation). A window layer of a pool that keeps its
KV in pages of its own (`slot_map`, `MAPPED`) reads one more index per position: the full slot's window slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minisgl_cli.kernels.fp8 import KVQuant
from minisgl_cli.kernels.triton.fp8 import fp8_codes
from minisgl_cli.kernels.triton.pdl import pdl_kwargs

LOG2E = 1.4426950408889634
_NEG_INIT = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (see the module docstring)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through tf32 (~1e-3 relative error); tests use fp32 as a tight check.
    return "ieee" if dtype == torch.float32 else "tf32"


def _pow2(n: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(n))


# ------------------------------------------------------------------------------------------------
# KV store
# ------------------------------------------------------------------------------------------------
@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr, k_scale_ptr, v_scale_ptr, k_mean_ptr, v_mean_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cs, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One program per new token: copy its K and V rows ([Hkv, D] each) to its slot in both caches."""
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_KV_HEADS
    mask = h_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    src_k = k_ptr + t.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + t.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst = slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    if KV_FP8:  # per-head scales, per-channel means ([Hkv, D], contiguous)
        ks = tl.load(k_scale_ptr + offs_h, mask=h_mask, other=1.0)
        vs = tl.load(v_scale_ptr + offs_h, mask=h_mask, other=1.0)
        mean_offs = offs_h[:, None] * HEAD_DIM + offs_d[None, :]
        km = tl.load(k_mean_ptr + mean_offs, mask=mask, other=0.0)
        vm = tl.load(v_mean_ptr + mean_offs, mask=mask, other=0.0)
        k = fp8_codes(k.to(tl.float32) - km, ks[:, None], k_cache_ptr.dtype.element_ty)
        v = fp8_codes(v.to(tl.float32) - vm, vs[:, None], v_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
    quant: KVQuant | None = None,
) -> None:
    """k/v [T, Hkv, D] (rows may be strided views of a fused qkv) -> k_cache/v_cache[loc]; one launch for both.

    quant: an FP8 cache's scales and means (kernels/fp8.py): the rows are stored as their e4m3 codes."""
    T, hkv, d = k.shape
    if T == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    q = quant if quant is not None else (k_cache,) * 4  # placeholders, never read
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, loc, *q,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=_pow2(hkv), BLOCK_D=_pow2(d), KV_FP8=quant is not None,
        num_warps=4 if hkv * d >= 1024 else 2,
    )


# ------------------------------------------------------------------------------------------------
# Decode: split-K over the context, then a reduce over the splits
# ------------------------------------------------------------------------------------------------
# Why split-K: a decode step has one query token per request, so a grid of (request, kv head) has only
# B * Hkv programs -- 8 for a single Llama-8B request, against 132 SMs on an H100. Each program would
# walk the whole context alone and the GPU would sit mostly idle. Splitting each context into
# `num_splits` chunks gives B * Hkv * num_splits programs that stream KV in parallel; each writes a
# partial (normalised output, log-sum-exp) pair and a cheap second kernel merges the partials exactly
# (softmax is associative once every partial carries its own max and sum).
#
# Why GQA-aware: all `group = H / Hkv` query heads of one KV head attend to the same K/V. One program
# takes the whole group as the rows of its query tile, so K/V is read from memory once per group, not
# once per query head -- decode is bound by these bytes. The tile has at least 16 rows because tl.dot
# wants M >= 16; padded rows are zero queries whose results are never stored.
#
# Why longest first: at big batches a program walks its request's whole context (one split), so programs
# differ in length as much as the contexts do, and the step ends with the last one. Started in batch
# order, a long context that starts last runs nearly alone at the end; started longest first (`order`,
# computed on the device each step of more than 8 rows), the programs that start last are short ones. At 256 requests of
# 200-1600 tokens on an H100: +5% KV-read bandwidth over FP8 KV (2400 -> 2545 GB/s), +1.4% over bf16.


@triton.jit
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, page_table_ptr, req_rows_ptr, seq_lens_ptr,
    mid_o_ptr, mid_lse_ptr, o_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, order_ptr, sinks_ptr, slot_map_ptr,
    counter_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_splits, window, short,
    stride_qb, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_pt,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DIRECT: tl.constexpr, USE_PDL: tl.constexpr, KV_FP8: tl.constexpr,
    HAS_ORDER: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOWED: tl.constexpr, MAPPED: tl.constexpr,
    MERGE: tl.constexpr, BLOCK_S: tl.constexpr, MERGE_D: tl.constexpr, MERGE_G: tl.constexpr,
    MERGE_GD: tl.constexpr,
):
    """Program (b, kv_head, split): attention of b's query heads of this group over one chunk of its context
    (of its last `window` positions where window > 0).

    The chunk length is derived from the request's own seq_len on the device (`_split_chunk`: a context of at
    most `short` positions in one chunk), so the grid depends only on the batch size and num_splits -- which is what
    lets a CUDA graph captured once replay for any context lengths. Splits past the end do nothing; the
    reduce recomputes the same chunking and ignores them. A context that fits one chunk has one live split,
    which (DIRECT or MERGE) writes the output itself: no partials, no count, no merge.
    """
    if USE_PDL:  # programmatic dependent launch (kernels/triton/pdl.py): nothing is read before the wait
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    if HAS_ORDER:  # longest contexts first: the last programs to start are short ones (less tail)
        b = tl.load(order_ptr + b)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = _window_start(seq_len, window, WINDOWED)
    chunk = _split_chunk(seq_len - lo, num_splits, short, BLOCK_N)
    live = tl.cdiv(seq_len - lo, chunk)  # splits that see at least one position
    if DIRECT or MERGE:  # a lone live split is the whole softmax
        lone = live == 1
    else:  # the reduce pass reads every live split's partial
        lone = live < 0
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    if start < end:
        row = tl.load(req_rows_ptr + b).to(tl.int64)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + offs_g
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :], other=0.0,
        )
        if KV_FP8:  # K's scale joins the logits' scalar; the dots run in fp16 (see the module docstring)
            qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
            q = q.to(tl.float16)
        m_i = tl.full([BLOCK_G], _NEG_INIT, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            # Page-table indirection: the slot of each position, then that slot's row in the cache.
            slots = tl.load(page_table_ptr + row * stride_pt + offs_n, mask=n_mask, other=0).to(tl.int64)
            if MAPPED:  # a window layer's slot of that full slot (kvcache/pool.py's slot_map)
                slots = tl.load(slot_map_ptr + slots)
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)  # e4m3 -> fp16 (or a 16-bit cache to q's dtype)
            k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [G, N], base-2 logits
            s = tl.where(n_mask[None, :], s, float("-inf"))
            # Online softmax: rescale what was accumulated under the old max before adding this tile.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        denom = l_i
        if HAS_SINKS:  # a lone split is the whole softmax: its denominator takes the sinks here
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634
            denom = tl.where(lone, l_i + tl.exp2(sink - m_i), l_i)
        out = acc / denom[:, None]
        if KV_FP8:
            vm = tl.load(v_mean_ptr + kvh * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
            out = out * tl.load(v_scale_ptr + kvh) + vm[None, :]
        if lone:  # one split (big batches, short contexts): this is the final output, no merge
            o = o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
            tl.store(o, out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
        else:
            mo = mid_o_ptr + b.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos
            tl.store(mo + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :])
            ml = mid_lse_ptr + b.to(tl.int64) * stride_mlb + heads * stride_mlh + split
            tl.store(ml, m_i + tl.log2(l_i), mask=g_mask)
    if MERGE:  # the last of (b, kv_head)'s live split programs to finish merges their partials: no second launch
        if (live > 1) & (start < end):
            tl.debug_barrier()  # every warp's partial is written before the count says so (the atomic releases them)
            counter = counter_ptr + b * tl.num_programs(1) + kvh
            if tl.atomic_add(counter, 1, sem="acq_rel") == live - 1:
                tl.debug_barrier()
                if MERGE_G > 0:  # the group's heads at once: one chain of loads, not one a head
                    _merge_group(mid_o_ptr, mid_lse_ptr, o_ptr, sinks_ptr, b, kvh * GROUP, live,
                                 stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                                 GROUP, MERGE_G, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS, ".cg", MERGE_GD)
                else:  # a head at a time (a group past _MERGE_MAX_HEADS, or group_merge=False)
                    for g in tl.static_range(GROUP):
                        _merge_group(mid_o_ptr, mid_lse_ptr, o_ptr, sinks_ptr, b, kvh * GROUP + g, live,
                                     stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob,
                                     stride_oh, 1, 1, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS, ".cg", MERGE_D)
                tl.store(counter, 0)  # ready for the next step (the count is all this kernel keeps between steps)


@triton.jit
def _window_start(seq_len, window, WINDOWED: tl.constexpr):
    """The first position a decode of seq_len positions attends to (its last `window` where WINDOWED)."""
    return tl.maximum(seq_len - window, 0) if WINDOWED else seq_len * 0


@triton.jit
def _live_splits(seq_len, num_splits, window, short, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    """The splits of a seq_len-position decode that see at least one position (`_split_chunk`'s chunks)."""
    lo = _window_start(seq_len, window, WINDOWED)
    return tl.cdiv(seq_len - lo, _split_chunk(seq_len - lo, num_splits, short, BLOCK_N))


@triton.jit
def _split_chunk(span, num_splits, short, BLOCK_N: tl.constexpr):
    """Positions each split of a `span`-position context covers, in whole BLOCK_N tiles: all of them up to `short`
    (splitting a short context costs a merge more than its tiles take), else span / num_splits."""
    return tl.cdiv(tl.where(span <= short, span, tl.cdiv(span, num_splits)), BLOCK_N) * BLOCK_N


@triton.jit
def _merge_group(mid_o_ptr, mid_lse_ptr, o_ptr, sinks_ptr, b, h0, live,
                 stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
                 GROUP: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_S: tl.constexpr, HAS_SINKS: tl.constexpr, CACHE: tl.constexpr, MERGE_D: tl.constexpr):
    """Heads h0 .. h0 + GROUP - 1 (G: GROUP's power of two) of request b: merge the partials of its `live` splits, each
    weighted by exp2(lse - max) (and the head's sink in the denominator), as [G, splits] and [G, splits, MERGE_D]
    tiles: every head's log-sum-exps in one load and each column slice of every head's partials in one (a head at a
    time is a chain of dependent loads a head: 8 for a group of 8). CACHE: the loads' cache modifier (".cg" where
    other SMs just wrote them)."""
    offs_g = tl.arange(0, G)
    g_mask = offs_g < GROUP
    heads = h0 + offs_g
    offs_s = tl.arange(0, BLOCK_S)
    gs_mask = g_mask[:, None] & (offs_s < live)[None, :]
    lse = tl.load(mid_lse_ptr + b.to(tl.int64) * stride_mlb + heads[:, None] * stride_mlh + offs_s[None, :],
                  mask=gs_mask, other=float("-inf"), cache_modifier=CACHE)
    top = tl.where(g_mask, tl.max(lse, 1), 0.0)  # padding heads: no -inf - -inf
    w = tl.exp2(lse - top[:, None])  # masked splits: exp2(-inf) = 0
    denom = tl.sum(w, 1)
    if HAS_SINKS:
        denom += tl.exp2(tl.load(sinks_ptr + heads, mask=g_mask, other=0.0) * 1.4426950408889634 - top)
    denom = tl.where(g_mask, denom, 1.0)
    for d0 in tl.static_range(0, BLOCK_D, MERGE_D):
        offs_d = d0 + tl.arange(0, MERGE_D)
        d_mask = offs_d < HEAD_DIM
        part = tl.load(
            mid_o_ptr + b.to(tl.int64) * stride_mob + heads[:, None, None] * stride_moh
            + offs_s[None, :, None] * stride_mos + offs_d[None, None, :],
            mask=gs_mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=CACHE,
        )
        out = tl.sum(part * w[:, :, None], 1) / denom[:, None]
        tl.store(o_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, o_ptr, sinks_ptr,
    num_splits, window, short,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOWED: tl.constexpr, MERGE_D: tl.constexpr,
):
    """Program (b, head): `_merge_group` of one head as a pass of its own (where no split counters are given)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + b)
    _merge_group(mid_o_ptr, mid_lse_ptr, o_ptr, sinks_ptr, b, tl.program_id(1),
                 _live_splits(seq_len, num_splits, window, short, BLOCK_N, WINDOWED), stride_mob, stride_moh,
                 stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh, 1, 1, HEAD_DIM, BLOCK_D, BLOCK_S, HAS_SINKS,
                 "", MERGE_D)


SHORT_CONTEXT = 256
"""The longest context a decode runs in one split (`decode_attention`'s short). At batch 1, splits of one 128-position
tile each cost a merge (the count, the partials written and read back) of about a tile: one program walking the whole
context is faster up to ~2 tiles, slower from ~3 (`examples/bench_attention.py --sweep-short`, an H200, µs a call at
130 / 384 / 640 positions, split with the grouped merge vs one split: Llama-8B's heads 5.9 / 6.7 / 7.5 vs 5.0 / 7.3 /
12.6; Qwen3-0.6B's 5.7 / 6.3 / 7.0 vs 5.1 / 7.2 / 12.1; Qwen3-30B-A3B's group of 8 6.7 / 6.8 / 7.7 vs 5.1 / 7.2 /
10.9; docs/benchmarks.md, issue 50). With the merge a head at a time (before 2026-12-01) the crossover was ~3-5 tiles
(384 here)."""

_MERGE_TILE = 8192  # a merge's [heads, splits, columns] fp32 partials at a time: 64 registers a thread at 4 warps
_MERGE_MAX_HEADS = 16  # past this a group's heads merge one at a time (fewer than 16 columns a slice otherwise)


def merge_group_tile(group: int, splits_block: int, block_d: int) -> tuple[int, int]:
    """(G, columns a slice) of the grouped merge of `group` query heads a KV head over `splits_block` splits; G 0:
    merge a head at a time (a group past _MERGE_MAX_HEADS)."""
    g = _pow2(group, 1)
    if g > _MERGE_MAX_HEADS:
        return 0, 0
    return g, max(16, min(block_d, _MERGE_TILE // (g * splits_block)))


def decode_block_n(head_dim: int, itemsize: int = 2) -> int:
    return decode_config(head_dim, itemsize)[0]


def decode_config(head_dim: int, itemsize: int = 2) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of the decode kernel for a cache of `itemsize`-byte values (1: FP8 codes, 4:
    fp32), from H100 sweeps (bench_attention.py --sweep-decode) up to head_dim 128.

    16-bit KV: 128-position tiles (+2% at 256 requests, +9% at one request over 64). FP8 KV: the same tiles,
    three stages (256 requests, longest first: 2532 GB/s vs 2521 with two, 2290 with 64-position tiles; capping
    the registers at 128 for a fourth program per SM: 2477). Wider heads (Gemma 3's 256, Gemma 4's global 512;
    not swept yet): tiles of 32 positions, and at 512 eight warps (a program's [16, 512] fp32 accumulator and the
    merge's [splits, 256] partials at 32 registers a thread) and, over an fp32 cache, 16 positions, so two stages of
    K and V tiles stay near 128 KB of shared memory."""
    if head_dim > 256:
        return (16 if itemsize > 2 else 32), 8, 2
    if head_dim > 128:
        return 32, 4, 2
    return (128, 4, 3) if itemsize == 1 else (128, 4, 2)


def num_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, max_splits: int = 32) -> int:
    """Enough splits that B * Hkv * splits covers the SMs about four times over; 1 once the batch does."""
    want = -(-4 * num_sms // max(1, batch_size * num_kv_heads))
    return max(1, min(max_splits, want))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    mid_o: torch.Tensor | None = None,
    mid_lse: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int] | None = None,
    pdl: bool = True,
    quant: KVQuant | None = None,
    order: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    slot_map: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    short: int | None = None,
    group_merge: bool = True,
) -> torch.Tensor:
    """q [B, H, D] (one token per request) -> [B, H, D] over positions 0..seq_lens[b]-1 of each request (the last
    `window` of them where window > 0); `sinks` [H] fp32: each head's sink logit in its softmax's denominator.

    mid_o [B, H, >=num_splits, D] / mid_lse [B, H, >=num_splits] fp32 scratch may be passed in (static
    buffers for CUDA graphs); otherwise they are allocated here. With num_splits == 1 the partial pass
    writes `out` itself and the reduce is skipped. config = (BLOCK_N, num_warps, num_stages).
    quant: an FP8 cache's scales and means (kernels/fp8.py).
    order: [B] int32, the rows in the order their programs start (longest context first, as the backend
    passes it: the programs that start last are then short ones, which shortens the tail), or None.
    slot_map: a window layer's full slot -> slot in its own cache (kvcache/pool.py), or None.
    counters: >= B * Hkv int32 zeros (left zero after the call): with them the last split program of each (request,
    KV head) merges the partials itself, one launch instead of two; without, a reduce pass does.
    short: the longest context (default SHORT_CONTEXT) that runs in one split whatever num_splits, its program writing
    the output itself where it can (num_splits 1, or counters given); 0: every context over num_splits.
    group_merge: with counters, the last split program merges its group's heads together (`_merge_group`); False: a
    head at a time, as before it (for `bench_attention.py --sweep-short`'s comparison).
    """
    B, H, D = q.shape
    hkv = k_cache.shape[1]
    group = H // hkv
    if q.stride(2) != 1:
        q = q.contiguous()
    if mid_o is None:
        mid_o = torch.empty((B, H, num_splits, D), dtype=torch.float32, device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty((B, H, num_splits), dtype=torch.float32, device=q.device)
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    block_n, warps, stages = config or decode_config(D, k_cache.element_size())
    block_d = _pow2(D, 16)
    direct = num_splits == 1
    merge = counters is not None and not direct
    assert counters is None or counters.numel() >= B * hkv
    fp8 = (quant.k_scale, quant.v_scale, quant.v_mean) if quant is not None else (q, q, q)  # placeholders
    merge_g, merge_gd = merge_group_tile(group, _pow2(num_splits, 2), block_d) if group_merge else (0, 0)
    merge_d = merge_group_tile(1, _pow2(num_splits, 2), block_d)[1]  # a head at a time
    _decode_partial_kernel[(B, hkv, num_splits)](
        q, k_cache, v_cache, page_table, req_rows, seq_lens, mid_o, mid_lse, out, *fp8,
        order if order is not None else seq_lens, sinks if sinks is not None else mid_lse,
        slot_map if slot_map is not None else seq_lens, counters if counters is not None else seq_lens,
        scale * LOG2E, num_splits, window, SHORT_CONTEXT if short is None else short,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=D, BLOCK_G=_pow2(group, 16), BLOCK_D=block_d, BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype if quant is None else torch.float16), DIRECT=direct,
        KV_FP8=quant is not None, HAS_ORDER=order is not None, HAS_SINKS=sinks is not None, WINDOWED=window > 0,
        MAPPED=slot_map is not None, MERGE=merge, BLOCK_S=_pow2(num_splits, 2), MERGE_D=merge_d,
        MERGE_G=merge_g, MERGE_GD=merge_gd, num_warps=warps, num_stages=stages, **pdl_kwargs(q, pdl),
    )
    if direct or merge:
        return out
    _decode_reduce_kernel[(B, H)](
        mid_o, mid_lse, seq_lens, out, sinks if sinks is not None else mid_lse, num_splits, window,
        SHORT_CONTEXT if short is None else short, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_S=_pow2(num_splits, 2), HAS_SINKS=sinks is not None,
        WINDOWED=window > 0, MERGE_D=merge_d, num_warps=4 if block_d >= 128 else 2,
        **pdl_kwargs(q, pdl),
    )
    return out


# ------------------------------------------------------------------------------------------------
# Extend (prefill over a cached prefix)
# ------------------------------------------------------------------------------------------------
# Flash-attention style: a program owns BLOCK_M consecutive new tokens of one request and one query
# head, streams that request's KV (cached prefix and the new tokens alike, all read from the pool after
# this step's store) in BLOCK_N tiles, and keeps a running max / sum / output per row. New token m sits
# at position prefix + m and sees keys 0..prefix + m. Keys up to prefix + (first row of the block) are
# visible to every row, so the walk has two phases: whole tiles below that line go through without any
# mask, and only the few tiles on the diagonal pay for the causal/length masks.


@triton.jit
def _extend_tile(
    q, m_i, l_i, acc, n0, row, q_pos, kv_end, kvh, window,
    k_cache_ptr, v_cache_ptr, page_table_ptr, slot_map_ptr,
    qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, WINDOWED: tl.constexpr, MAPPED: tl.constexpr,
):
    """One online-softmax step over keys n0..n0+BLOCK_N-1; MASKED adds the causal, length and window masks."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if MASKED:
        n_mask = offs_n < kv_end
        slots = tl.load(page_table_ptr + row * stride_pt + offs_n, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        slots = tl.load(page_table_ptr + row * stride_pt + offs_n).to(tl.int64)
        kv_mask = d_mask[None, :]
    if MAPPED:  # a window layer's slot of that full slot (kvcache/pool.py's slot_map)
        slots = tl.load(slot_map_ptr + slots)
    k = tl.load(k_cache_ptr + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                mask=kv_mask, other=0.0).to(q.dtype)  # e4m3 -> fp16 (or a 16-bit cache to q's dtype)
    k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (offs_n[None, :] < kv_end) & (offs_n[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, o_ptr,
    page_table_ptr, req_rows_ptr, seq_lens_ptr, qo_indptr_ptr, k_scale_ptr, v_scale_ptr, v_mean_ptr, sinks_ptr,
    slot_map_ptr, qk_scale, window,
    stride_qt, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOWED: tl.constexpr,
    MAPPED: tl.constexpr,
):
    """Program (m_block, b, head): causal attention of BLOCK_M new tokens of request b for one query head."""
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(qo_indptr_ptr + b)
    ext_len = tl.load(qo_indptr_ptr + b + 1) - q_start
    if mb * BLOCK_M < ext_len:
        seq_len = tl.load(seq_lens_ptr + b)
        prefix = seq_len - ext_len
        row = tl.load(req_rows_ptr + b).to(tl.int64)
        kvh = h // GROUP
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_mask = offs_m < ext_len
        d_mask = offs_d < HEAD_DIM
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if KV_FP8:  # as in decode: K's scale joins the logits' scalar, fp16 dots
            qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
            q = q.to(tl.float16)
        q_pos = prefix + offs_m
        # Keys 0..prefix + mb*BLOCK_M are seen by every row of the block (and all exist): whole tiles
        # up to there need no mask. kv_end is one past the last key the block's last real row sees.
        full_end = ((prefix + mb * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
        kv_end = tl.minimum(seq_len, prefix + (mb + 1) * BLOCK_M)
        lo = full_end * 0
        if WINDOWED:  # from the first tile the block's first row sees, every tile masked
            lo = (tl.maximum(prefix + mb * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N
            full_end = lo
        m_i = tl.full([BLOCK_M], _NEG_INIT, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range(lo, full_end, BLOCK_N):
            m_i, l_i, acc = _extend_tile(
                q, m_i, l_i, acc, n0, row, q_pos, kv_end, kvh, window, k_cache_ptr, v_cache_ptr, page_table_ptr,
                slot_map_ptr, qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
                HEAD_DIM, BLOCK_D, BLOCK_N, False, DOT_PRECISION, WINDOWED, MAPPED,
            )
        for n0 in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _extend_tile(
                q, m_i, l_i, acc, n0, row, q_pos, kv_end, kvh, window, k_cache_ptr, v_cache_ptr, page_table_ptr,
                slot_map_ptr, qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, stride_pt,
                HEAD_DIM, BLOCK_D, BLOCK_N, True, DOT_PRECISION, WINDOWED, MAPPED,
            )
        if HAS_SINKS:
            l_i += tl.exp2(tl.load(sinks_ptr + h) * 1.4426950408889634 - m_i)
        out = acc / l_i[:, None]
        if KV_FP8:
            vm = tl.load(v_mean_ptr + kvh * HEAD_DIM + offs_d, mask=d_mask, other=0.0)
            out = out * tl.load(v_scale_ptr + kvh) + vm[None, :]
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs with head_dim <= 128; fp32 or wider heads
# use smaller tiles to stay inside shared memory (extend_config). Overridable for tuning (examples/bench_attention.py).
EXTEND_CONFIG: tuple[int, int, int, int] = (64, 64, 4, 2)


def extend_config(head_dim: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """The extend kernel's tiles for a cache of `itemsize`-byte values (1: FP8 codes, 4: fp32). Up to head_dim 256:
    EXTEND_CONFIG (16-bit and FP8, up to 128) or half-size tiles. Gemma 4's global heads (512; not swept yet): 32
    rows over eight warps (the [32, 512] fp32 accumulator at 64 registers a thread), 32-position K / V tiles (16 over
    an fp32 cache, with 16 rows), two stages in about 128 KB of shared memory."""
    if head_dim > 256:
        return (16, 16, 8, 2) if itemsize > 2 else (32, 32, 8, 2)
    return EXTEND_CONFIG if itemsize <= 2 and head_dim <= 128 else (32, 32, 4, 2)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_extend_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    quant: KVQuant | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    slot_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] (request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]) -> [T, H, D].

    Token i of request b is at position seq_lens[b] - extend_len_b + i and attends causally to the whole
    sequence (its last `window` positions where window > 0), whose KV (this step's tokens included) must already be
    in the pool. quant, sinks, slot_map: as decode's.
    """
    T, H, D = q.shape
    hkv = k_cache.shape[1]
    B = req_rows.shape[0]
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    if T == 0 or B == 0:
        return out
    block_m, block_n, warps, stages = config or extend_config(D, k_cache.element_size())
    grid = (triton.cdiv(max_extend_len, block_m), B, H)
    fp8 = (quant.k_scale, quant.v_scale, quant.v_mean) if quant is not None else (q, q, q)  # placeholders
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, req_rows, seq_lens, qo_indptr, *fp8,
        sinks if sinks is not None else q, slot_map if slot_map is not None else seq_lens, scale * LOG2E, window,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        GROUP=H // hkv, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=_pow2(D, 16), BLOCK_N=block_n,
        DOT_PRECISION=_dot_precision(q.dtype if quant is None else torch.float16), KV_FP8=quant is not None,
        HAS_SINKS=sinks is not None, WINDOWED=window > 0, MAPPED=slot_map is not None, num_warps=warps,
        num_stages=stages,
    )
    return out


__all__ = [
    "LOG2E",
    "decode_attention",
    "decode_block_n",
    "decode_config",
    "extend_attention",
    "extend_config",
    "num_kv_splits",
    "store_kv",
]
