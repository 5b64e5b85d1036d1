"""Single-row matmul (GEMV) in Triton for batch-1 decode, optionally with SiLU-and-mul fused into its input.

At one token per step a linear layer is a pass over its weight: time = bytes / bandwidth plus the
kernel's start-up. cuBLAS's GEMV is tuned for neither end here (5-6 us on a 4-8 MB Qwen3-0.6B matrix,
~80% of copy bandwidth on Llama-8B's big ones). This kernel gives each program BLOCK_N output rows and
walks K in wide contiguous chunks, so every load is a long coalesced run of the weight, and a grid of
N / BLOCK_N programs covers every SM many times. Measured in one H100 run (weights cold in L2, inside
a CUDA graph): 3.4-6 us vs cuBLAS's 5.8-9.3 on Qwen3-0.6B's layers, 2.6-3.1 TB/s vs 2.1-2.8 on
Llama-8B's. CUDA only; callers fall back to torch for more rows or other devices.

FP8 weights (`--quantization fp8`): half the bytes, so the time goes to widening the codes unless that is
cheap. The FMA kernel's two conversions per weight (e4m3 -> fp16 -> fp32) hold it near 1.6-2.4 TB/s on an
H100; `_gemv_fp8_mma_kernel` widens pairs (e4m3x2 -> f16x2, half a conversion per weight) and multiplies on the
tensor cores without padding x with zero rows (its docstring), at 2.1-3.1 TB/s on Llama-8B's layers. The row's
fp32 scale multiplies the finished dot once. The activation stays 16-bit: at one row the bytes are all in the
weight, and a per-token scale would need the whole row before the first chunk.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minisgl_cli.kernels.fp8 import KVCache
from minisgl_cli.kernels.triton.fp8 import fp8_codes
from minisgl_cli.kernels.triton.pdl import pdl_kwargs
from minisgl_cli.kernels.triton.rope import rotate_halves


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, N, K, stride_w,
                 HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, ACT_MUL: tl.constexpr, GATE_UP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """GATE_UP: the weight is a merged [gate; up] of 2N rows and y = silu(x Wg) * (x Wu) [N] (`_gate_up_rows`)."""
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rn, mask_n = _weight_rows(pid, tl.arange(0, BLOCK_N), N, GATE_UP, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # K masks stay vectorisable: K is specialised on divisibility by 16
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
    if HAS_SCALE:  # FP8 weights: w = code * scale[row]
        y *= tl.load(s_ptr + rn, mask=mask_n, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    _store_rows(y_ptr, y, pid, N, GATE_UP, BLOCK_N)


@triton.jit
def _weight_rows(pid, r, N, GATE_UP: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows of program `pid`'s output rows `r` (0 .. BLOCK_N), and which exist.

    GATE_UP: the weight is [gate; up] (2N rows) and the program's rows pair up, (2i, 2i + 1) = (gate row j, up row
    j) for its BLOCK_N / 2 outputs j: both halves of an output in one program, for the SiLU-and-mul epilogue."""
    if GATE_UP:
        j = pid * (BLOCK_N // 2) + r // 2
        rn = j + (r % 2) * N
        ok = j < N
    else:
        rn = pid * BLOCK_N + r
        ok = rn < N
    return rn, ok


@triton.jit
def _silu_mul_pairs(y, dt: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_N] fp32 sums of (gate, up) pairs -> silu(gate) * up [BLOCK_N / 2] (fp32 of a `dt` value)."""
    pairs = tl.reshape(y, (BLOCK_N // 2, 2))
    half = tl.arange(0, 2)[None, :]
    return _silu_mul(tl.sum(tl.where(half == 0, pairs, 0.0), axis=1), tl.sum(tl.where(half == 1, pairs, 0.0), axis=1),
                     dt)


@triton.jit
def _silu_mul(g, u, dt: tl.constexpr):
    """silu(g) * u of fp32 sums, rounded to `dt` where the unfused path rounds (the GEMV's output, the activation
    of ops.silu_and_mul, its product: the caller's store)."""
    gf = g.to(dt).to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    return act * u.to(dt).to(tl.float32)


@triton.jit
def _store_rows(y_ptr, y, pid, N, GATE_UP: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program `pid`'s finished fp32 sums [BLOCK_N] to y (with GATE_UP: silu(gate) * up, BLOCK_N / 2 of them)."""
    out_ty = y_ptr.dtype.element_ty
    if GATE_UP:
        rn = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y = _silu_mul_pairs(y, out_ty, BLOCK_N)
    else:
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rn, y.to(out_ty), mask=rn < N)


@triton.jit
def _prefetch_rows_l2(row_ptrs, nbytes, nrows: tl.constexpr):
    """Start DRAM -> L2 copies of `nbytes` (a multiple of 16) from each of nrows 16-byte aligned row addresses
    (Hopper's bulk prefetch: no registers held, nothing waited on). One thread per row issues it."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, $3; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [row_ptrs, nbytes, nrows], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_fp8_mma_kernel(x_ptr, w_ptr, b_ptr, s_ptr, y_ptr, N, K, stride_w,
                         HAS_BIAS: tl.constexpr, ACT_MUL: tl.constexpr, GATE_UP: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    """FP8 weights through the tensor cores: each step's stretch of 16 * BLOCK_K inputs cut into 16 pieces.

    A GEMV has one row of x, and a tensor-core tile wants 16: padding x with 15 zero rows makes every warp
    build (and convert) a 16-row tile for one real row, which costs as much as the weights' own conversion.
    Instead the 16 rows of the tile are 16 pieces of x: X[j, c] = x[k0 + c * BLOCK_K + j], and the weight
    tile's row (n, c) is the matching piece of row n, A[(n, c), j] = W[n, k0 + c * BLOCK_K + j]. Then
    (A X)[(n, c), c] is row n's sum over piece c, and y[n] sums those 16 diagonal entries; the off-diagonal
    products are thrown away (the tensor cores have time to spare). Every element of x is read once per
    program, each weight row is read in runs of 16 * BLOCK_K bytes, every weight is widened e4m3x2 -> f16x2
    (half a conversion each) and multiplied in fp32 accumulators; x in fp16 is exact for bf16 values in
    fp16's range (clamped to stay finite).

    The weights never depend on the previous kernel, so under programmatic dependent launch some are asked
    for before waiting on it (overlapping its tail). PREFETCH 0: none (Triton pipelines the loads after the
    wait, num_stages); 1: the first tile into registers, then the next while computing this one, by hand;
    2: the first step's bytes of each row into L2; 3: each whole row into L2. GATE_UP: as `_gemv_kernel`'s."""
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if PREFETCH >= 2:
        pr, pr_ok = _weight_rows(pid, tl.arange(0, BLOCK_N), N, GATE_UP, BLOCK_N)
        pr = tl.where(pr_ok, pr, 0)
        _prefetch_rows_l2(w_ptr + pr.to(tl.int64) * stride_w, K if PREFETCH == 3 else 16 * BLOCK_K, BLOCK_N)
    rows = tl.arange(0, BLOCK_N * 16)
    rn_w, ok_w = _weight_rows(pid, rows // 16, N, GATE_UP, BLOCK_N)
    piece = rows % 16
    rj = tl.arange(0, BLOCK_K)
    rc = tl.arange(0, 16)
    w_mask = ok_w[:, None]
    w_ptrs = w_ptr + rn_w.to(tl.int64)[:, None] * stride_w + (piece * BLOCK_K)[:, None] + rj[None, :]
    x_ptrs = x_ptr + (rc * BLOCK_K)[None, :] + rj[:, None]
    acc = tl.zeros((BLOCK_N * 16, 16), dtype=tl.float32)
    if PREFETCH == 1:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        gdc_wait()
    for k0 in range(0, K, 16 * BLOCK_K):
        if PREFETCH == 1:
            nxt = tl.load(w_ptrs + (k0 + 16 * BLOCK_K), mask=w_mask & (k0 + 16 * BLOCK_K < K), other=0.0,
                          eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0, eviction_policy="evict_first")
        xv = tl.load(x_ptrs + k0)
        xf = xv.to(tl.float32)
        if ACT_MUL:  # x is [gate | up] of 2K: silu(gate) * up, rounded where the unfused path rounds
            u = tl.load(x_ptrs + K + k0)
            act = (xf / (1.0 + tl.exp(-xf))).to(xv.dtype).to(tl.float32)
            xf = (act * u.to(tl.float32)).to(xv.dtype).to(tl.float32)
        acc = tl.dot(w.to(tl.float16), tl.clamp(xf, -65504.0, 65504.0).to(tl.float16), acc)
        if PREFETCH == 1:
            w = nxt
    diag = tl.sum(tl.where(piece[:, None] == rc[None, :], acc, 0.0), axis=1)
    y = tl.sum(tl.reshape(diag, (BLOCK_N, 16)), axis=1)
    rn, mask_n = _weight_rows(pid, tl.arange(0, BLOCK_N), N, GATE_UP, BLOCK_N)
    y *= tl.load(s_ptr + rn, mask=mask_n, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    _store_rows(y_ptr, y, pid, N, GATE_UP, BLOCK_N)


@triton.jit
def _x_chunk(x_ptr, row, M, k0, cols, mk, K, stride_x, ACT_MUL: tl.constexpr):
    """Row `row` of x at columns k0 + cols (zero past K or past the M rows), fp32; ACT_MUL: silu(gate) * up of a
    [gate | up] row. `cols` [BLOCK_N, BLOCK_K] repeats the chunk's columns for every weight row: x loaded in the weight
    tile's own layout (each copy from L1), not once and then shuffled through shared memory every chunk."""
    m = mk & (row < M)
    x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=m, other=0.0)
    xf = x.to(tl.float32)
    if ACT_MUL:
        u = tl.load(x_ptr + row * stride_x + K + k0 + cols, mask=m, other=0.0)
        xf = _silu_mul(xf, u, x.dtype).to(x.dtype).to(tl.float32)
    return xf


@triton.jit
def _dot_rows(x_ptr, w_ptr, rn, mask_n, M, K, stride_x, stride_w, ACT_MUL: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """[BLOCK_N, ROWS] fp32 sums of weight rows `rn` against x's M <= ROWS rows (ROWS 1, 2 or 4; zero past M): each
    weight chunk, once in registers, multiplied into every row. One accumulator a row, each laid out as the one-row
    kernel's (a [BLOCK_N, ROWS, BLOCK_K] one made Triton shuffle x and w through shared memory every chunk). The first
    chunk is asked for before the PDL wait."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * stride_w + rk[None, :]
    w = tl.load(w_ptrs, mask=mask_n[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")
    if USE_PDL:
        gdc_wait()
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    cols = rk[None, :] + 0 * rn[:, None]
    for k0 in range(0, K, BLOCK_K):
        mk = (k0 + cols) < K
        wf = w.to(tl.float32)
        acc0 += wf * _x_chunk(x_ptr, 0, M, k0, cols, mk, K, stride_x, ACT_MUL)
        if ROWS > 1:
            acc1 += wf * _x_chunk(x_ptr, 1, M, k0, cols, mk, K, stride_x, ACT_MUL)
        if ROWS > 2:
            acc2 += wf * _x_chunk(x_ptr, 2, M, k0, cols, mk, K, stride_x, ACT_MUL)
            acc3 += wf * _x_chunk(x_ptr, 3, M, k0, cols, mk, K, stride_x, ACT_MUL)
        w_ptrs += BLOCK_K
        nk = (k0 + BLOCK_K + rk) < K  # all false after the last chunk: no memory is touched
        w = tl.load(w_ptrs, mask=mask_n[:, None] & nk[None, :], other=0.0, eviction_policy="evict_first")
    rm = tl.arange(0, ROWS)[None, :]
    y = tl.where(rm == 0, tl.sum(acc0, axis=1)[:, None], 0.0)
    if ROWS > 1:
        y = tl.where(rm == 1, tl.sum(acc1, axis=1)[:, None], y)
    if ROWS > 2:
        y = tl.where(rm == 2, tl.sum(acc2, axis=1)[:, None], y)
        y = tl.where(rm == 3, tl.sum(acc3, axis=1)[:, None], y)
    return y


@triton.jit
def _pair_halves(y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    """[BLOCK_N, ROWS] sums whose rows pair up (2i, 2i + 1) -> the firsts and the seconds, each [BLOCK_N / 2, ROWS]."""
    pairs = tl.reshape(y, (BLOCK_N // 2, 2, ROWS))
    half = tl.arange(0, 2)[None, :, None]
    return tl.sum(tl.where(half == 0, pairs, 0.0), axis=1), tl.sum(tl.where(half == 1, pairs, 0.0), axis=1)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                      HAS_BIAS: tl.constexpr, ACT_MUL: tl.constexpr, GATE_UP: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """M <= ROWS rows of x (a small decode batch) against one pass over 16-bit weights, so the weight bytes are read
    once for the batch (cuBLAS at 2-4 rows reads them at a fraction of the bandwidth its big tiles reach). ACT_MUL and
    GATE_UP as `_gemv_kernel`'s."""
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rn, mask_n = _weight_rows(pid, tl.arange(0, BLOCK_N), N, GATE_UP, BLOCK_N)
    y = _dot_rows(x_ptr, w_ptr, rn, mask_n, M, K, stride_x, stride_w, ACT_MUL, ROWS, BLOCK_N, BLOCK_K, USE_PDL)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    out_ty = y_ptr.dtype.element_ty
    rm = tl.arange(0, ROWS)
    if GATE_UP:
        g, u = _pair_halves(y, BLOCK_N, ROWS)
        y = _silu_mul(g, u, out_ty)
        rn_o = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        rn_o = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + rm[None, :] * stride_y + rn_o[:, None], y.to(out_ty), mask=(rn_o < N)[:, None] & (rm < M)[None, :])


@triton.jit
def _store_kv_halves(cache_ptr, scale_ptr, mean_ptr, slot, h, j, mask, o1, o2, HEAD_DIM: tl.constexpr,
                     KV_FP8: tl.constexpr):
    """Entries j and j + D/2 of KV heads h ([P, 1]) of each token (slot: [1, ROWS] offsets of their cache rows), under
    mask: as they are, or (FP8) the e4m3 codes of x - mean at the head's scale (as ops._store_kv_heads)."""
    half: tl.constexpr = HEAD_DIM // 2
    dst = cache_ptr + slot + h * HEAD_DIM + j
    if KV_FP8:
        scale = tl.load(scale_ptr + h, mask=mask, other=1.0)
        m1 = tl.load(mean_ptr + h * HEAD_DIM + j, mask=mask, other=0.0)
        m2 = tl.load(mean_ptr + h * HEAD_DIM + half + j, mask=mask, other=0.0)
        ty = cache_ptr.dtype.element_ty
        tl.store(dst, fp8_codes(o1.to(tl.float32) - m1, scale, ty), mask=mask)
        tl.store(dst + half, fp8_codes(o2.to(tl.float32) - m2, scale, ty), mask=mask)
    else:
        tl.store(dst, o1, mask=mask)
        tl.store(dst + half, o2, mask=mask)


@triton.jit
def _gemv_qkv_rope_kernel(x_ptr, w_ptr, b_ptr, y_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, loc_ptr,
                          k_scale_ptr, v_scale_ptr, k_mean_ptr, v_mean_ptr, M, K, stride_x, stride_w, stride_y,
                          stride_cos, stride_cs, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HAS_BIAS: tl.constexpr, KV_FP8: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """The fused qkv projection of M <= ROWS tokens with, in its epilogue, RoPE on the q and k heads and the rotated k
    and the v heads stored to their cache slots: ops._qk_norm_rope_kernel's work (without a q/k norm) minus its launch
    and its pass over the rows. A program's BLOCK_N weight rows pair up, (2i, 2i + 1) = rows j and j + D/2 of one
    head: the two entries RoPE turns together."""
    if USE_PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    half: tl.constexpr = HEAD_DIM // 2
    pairs: tl.constexpr = (NUM_Q + 2 * NUM_KV) * half
    r = tl.arange(0, BLOCK_N)
    p = pid * (BLOCK_N // 2) + r // 2
    rn = (p // half) * HEAD_DIM + p % half + (r % 2) * half
    y = _dot_rows(x_ptr, w_ptr, rn, p < pairs, M, K, stride_x, stride_w, False, ROWS, BLOCK_N, BLOCK_K, USE_PDL)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=p < pairs, other=0.0).to(tl.float32)[:, None]
    dt = y_ptr.dtype.element_ty
    x1, x2 = _pair_halves(y, BLOCK_N, ROWS)
    a1, a2 = x1.to(dt).to(tl.float32), x2.to(dt).to(tl.float32)  # the GEMV's output, as the unfused path rounds it
    po = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    h, j = (po // half)[:, None], (po % half)[:, None]  # [P, 1]: head and entry of each pair
    rm = tl.arange(0, ROWS)
    mask_m = rm < M
    ok = (po < pairs)[:, None] & mask_m[None, :]
    pos = tl.load(pos_ptr + rm, mask=mask_m, other=0)[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + j, mask=ok, other=0.0).to(dt).to(tl.float32)  # cos/sin repeat per half
    s = tl.load(sin_ptr + pos * stride_cos + j, mask=ok, other=0.0).to(dt).to(tl.float32)
    o1, o2 = rotate_halves(a1, a2, c, s, dt)
    rot = h < NUM_Q + NUM_KV  # q and k heads turn; v heads pass as they are
    o1 = tl.where(rot, o1, a1.to(dt))
    o2 = tl.where(rot, o2, a2.to(dt))
    out = y_ptr + rm[None, :] * stride_y + h * HEAD_DIM + j
    tl.store(out, o1, mask=ok)
    tl.store(out + half, o2, mask=ok)
    slot = (tl.load(loc_ptr + rm, mask=mask_m, other=0).to(tl.int64) * stride_cs)[None, :]
    is_k = (h >= NUM_Q) & rot
    _store_kv_halves(k_cache_ptr, k_scale_ptr, k_mean_ptr, slot, h - NUM_Q, j, ok & is_k, o1, o2, HEAD_DIM, KV_FP8)
    _store_kv_halves(v_cache_ptr, v_scale_ptr, v_mean_ptr, slot, h - NUM_Q - NUM_KV, j, ok & ~rot, o1, o2, HEAD_DIM,
                     KV_FP8)


Config = tuple[int, ...]
"""(BLOCK_N, BLOCK_K, num_warps): the FMA kernel; (BLOCK_N, BLOCK_K, num_warps, num_stages, prefetch): the FP8
tensor-core one (a step covers 16 * BLOCK_K inputs; prefetch as its PREFETCH, 1 with num_stages 1)."""


def mma_fits(k: int, config: Config) -> bool:
    """Whether the FP8 tensor-core kernel with `config` covers rows of k: whole steps of 16 * BLOCK_K."""
    return len(config) == 5 and k % (16 * config[1]) == 0


def pick_config(n: int, k: int, act_mul: bool = False, itemsize: int = 2) -> Config:
    """The kernel and its block shape, from sweeps (examples/gpu_bench.py --only gemv --sweep [--sweep-fp8]).

    16-bit weights (an H200 sweep, 2026-11-30; the H100's picks of one row a program left 10-25% on its faster
    memory): 4-8 rows a program, 2-8k weights a chunk step, so each program keeps more bytes in flight; two rows
    where N alone gives tens of thousands of programs (a head, Llama-8B's gate / up). Up to 1,024 rows the whole of a
    2k row is one chunk, which its program asks for before the PDL wait: Qwen3-0.6B's o_proj, after the attention,
    took Qwen3-0.6B batch 1 from 1,248.5 to 1,280.7 tok/s on an H200 (`examples/gemv_e2e.py`, 2026-12-01; the sweep
    above times a GEMV after a copy of itself, not after the kernels a step runs before it), and its qkv (4096 x 1024)
    in one chunk of 8 rows a program 1,277.8 to 1,314.5. An o_proj of up to 3,072 rows of 4k: a row a program in one
    chunk, as gemv_e2e.py variants gpt-oss-20b (2880 x 4096) 532.0 to 556.7 and Qwen3-30B-A3B (2048 x 4096) 369.0 to
    371.0; Llama-8B's 4096 rows lost 1.6% to it and keep 4 rows a program.
    FP8 weights: the tensor-core kernel wherever rows split into steps of 16 * 64 inputs -- 8 rows per
    program, 3 stages, each row's first step prefetched into L2 before the wait (Llama-8B at one row: 2.4-3.1
    TB/s, against 1.6-2.7 for the FMA kernel); 16 rows for a qkv-sized N, and on a square 4096 x 4096 the
    first tile into registers instead (7.5 vs 7.9 us).
    """
    if itemsize == 1:
        if not act_mul and n <= 4096 and k <= 4096:
            cfg: Config = (8, 64, 4, 1, 1)
        else:
            cfg = (16, 64, 4, 3, 2) if 4096 < n <= 8192 and not act_mul else (8, 64, 4, 3, 2)
        if mma_fits(k, cfg):
            return cfg
        return (8, 512, 4) if k >= 4096 else (4, min(2048, triton.next_power_of_2(k)), 8)
    chunk = triton.next_power_of_2(k)
    if act_mul:  # a down projection: the fused SiLU input costs registers per chunk
        return (8, min(1024, chunk), 4) if k >= 8192 else (4, min(1024, chunk), 8)
    if n > 16384:  # a head or a wide gate / up: programs enough at two rows each
        return (2, min(1024, chunk), 4) if k >= 2048 else (8, min(256, chunk), 4)
    if n <= 1024:  # a row a program, the whole of a 2k row in one chunk (end to end: examples/gemv_e2e.py)
        return 1, min(2048, chunk), 4
    if n <= 3072 and k >= 4096:  # an o_proj of many heads into a narrower model: a 4k row a program, in one chunk
        return 1, min(4096, chunk), 4
    if n > 4096:
        return 8, min(512, chunk), 4
    if k <= 1024:  # a row of at most 1k in one chunk (Qwen3-0.6B's qkv, end to end as above)
        return 8, chunk, 8
    return 4, min(1024 if k >= 4096 else 512, chunk), 4


MAX_ROWS = 4
"""The most rows `gemv` takes: the rows kernel's accumulators grow with them, and past a few rows a GEMM's tiles reuse
each weight load as well (cuBLAS)."""


def pick_rows_config(n: int, k: int, rows: int, gate_up: bool = False) -> Config:
    """(BLOCK_N, BLOCK_K, num_warps) of the 1-4 row kernels (`_gemv_rows_kernel`, `_gemv_qkv_rope_kernel`): few
    weight rows per program, as at one row (a gate-up or RoPE pair: 2), in 512-wide chunks. Not yet swept on a GPU
    (examples/decode_kernels_gpu.py --sweep); compiled for sm_90, 4 rows take 48 registers a thread (72 with a
    pair), no spills, where 1024-wide chunks take 96-167."""
    return (2 if gate_up else 1), min(512, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, act_mul: bool = False,
         config: Config | None = None, pdl: bool = True, scale: torch.Tensor | None = None,
         gate_up: bool = False) -> torch.Tensor:
    """y[M, N] = f(x) @ weight[N, K]^T (+ bias) for M <= MAX_ROWS rows; f(x) = silu(x[:, :K]) * x[:, K:] when act_mul
    (x is [M, 2K]).

    gate_up: weight is a merged [gate; up] (2I rows) and y = silu(x Wg^T) * (x Wu^T) [M, I], the SiLU-and-mul in the
    epilogue (each program computes matching gate and up rows), rounded as gemv then ops.silu_and_mul round. With
    16-bit weights it runs the rows kernel at one row too (`_dot_rows`: no shuffle of x for a pair of weight rows).
    scale: the fp32 per-row scales [N] of an e4m3 `weight` (W = weight * scale[:, None]); one row only.
    config: see `pick_config` (one row) and `pick_rows_config`; a 5-tuple runs the tensor-core kernel (FP8 weights,
    16-bit x only)."""
    n, k = weight.shape
    m = x.shape[0]
    assert 1 <= m <= MAX_ROWS and x.shape[-1] == (2 * k if act_mul else k) and x.stride(-1) == 1
    assert weight.stride(1) == 1 and not (gate_up and (act_mul or n % 2))
    n_out = n // 2 if gate_up else n
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else weight
    scale_arg = scale if scale is not None else weight
    if m > 1 or (gate_up and scale is None):  # (a 16-bit gate-up pair: this kernel loads x in the pair's layout)
        assert scale is None, "FP8 weights take one row here (more: Fp8Method's scaled GEMM)"
        block_n, block_k, warps = config or pick_rows_config(n_out, k, m, gate_up)
        rows = triton.next_power_of_2(m)
        _gemv_rows_kernel[(triton.cdiv(n_out, block_n // 2 if gate_up else block_n),)](
            x, weight, bias_arg, y, m, n_out, k, x.stride(0), weight.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, ACT_MUL=act_mul, GATE_UP=gate_up, ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, **pdl_kwargs(x, pdl),
        )
        return y
    assert x.is_contiguous()
    config = config or pick_config(n, k, act_mul, weight.element_size())
    if len(config) == 5 and (x.dtype not in (torch.bfloat16, torch.float16) or not mma_fits(k, config)):
        config = (8, 512, 4)  # an fp32 row (the tensor-core kernel widens x to fp16), or rows it cannot slice
    if gate_up and config[0] < 2:  # a program's rows pair gate with up
        config = (2, *config[1:])
    per = config[0] // 2 if gate_up else config[0]  # outputs a program writes
    if len(config) == 5:
        assert scale is not None
        block_n, block_k, warps, stages, prefetch = config
        _gemv_fp8_mma_kernel[(triton.cdiv(n_out, per),)](
            x, weight, bias_arg, scale_arg, y, n_out, k, weight.stride(0), HAS_BIAS=bias is not None,
            ACT_MUL=act_mul, GATE_UP=gate_up, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=prefetch, num_warps=warps,
            num_stages=stages, **pdl_kwargs(x, pdl),
        )
        return y
    block_n, block_k, warps = config
    _gemv_kernel[(triton.cdiv(n_out, per),)](
        x, weight, bias_arg, scale_arg, y, n_out, k,
        weight.stride(0), HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, ACT_MUL=act_mul, GATE_UP=gate_up,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_kwargs(x, pdl),
    )
    return y


def gemv_rope_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, num_q: int, num_kv: int, head_dim: int,
                 kv_cache: KVCache, pdl: bool = True,
                 config: Config | None = None) -> torch.Tensor:
    """gemv(x, weight, bias) of a fused qkv projection [M, (Hq + 2 Hkv) D], M <= MAX_ROWS, 16-bit weights, with RoPE
    on its q and k heads (positions [M] into cos / sin [P, D]) and the rotated k and the v heads stored to their slots
    (kv_cache as ops.qk_norm_rope_'s: (k_cache, v_cache, loc, quant)) in the same kernel. Returns the rotated rows."""
    n, k = weight.shape
    m = x.shape[0]
    k_cache, v_cache, loc, quant = kv_cache
    assert 1 <= m <= MAX_ROWS and x.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert n == (num_q + 2 * num_kv) * head_dim and head_dim % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == (num_kv, head_dim)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = config or pick_rows_config(n // 2, k, m, gate_up=True)
    fp8 = quant if quant is not None else (cos,) * 4  # placeholders, never read
    _gemv_qkv_rope_kernel[(triton.cdiv(n // 2, block_n // 2),)](
        x, weight, bias if bias is not None else weight, y, positions, cos, sin, k_cache, v_cache, loc, *fp8, m, k,
        x.stride(0), weight.stride(0), y.stride(0), cos.stride(0), k_cache.stride(0), NUM_Q=num_q, NUM_KV=num_kv,
        HEAD_DIM=head_dim, HAS_BIAS=bias is not None, KV_FP8=quant is not None, ROWS=triton.next_power_of_2(m),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl_kwargs(x, pdl),
    )
    return y
