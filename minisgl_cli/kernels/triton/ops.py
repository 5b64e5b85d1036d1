"""Fused Triton kernels for the decoder's small ops (CUDA only): add+RMSNorm (TP: all-reduce+add+RMSNorm),
q/k-norm+RoPE (+KV store), SiLU-and-mul.

Each replaces a chain of 3 to 10 elementwise torch kernels with one pass over the data. They round
to the engine dtype at the same points as the torch reference (and HF transformers) do, so bf16
results match it to within an ulp here and there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minisgl_cli.distributed.push_rows import UNSET, PushRows
from minisgl_cli.kernels.fp8 import FP8, INV_MAX, TINY, Fp8Rows, KVCache
from minisgl_cli.kernels.triton.fp8 import fp8_codes, quant_rows  # noqa: F401  (quant_rows re-exported, as gemv)
from minisgl_cli.kernels.triton.gemv import gemv, gemv_rope_kv  # noqa: F401  (re-exported: one switch for every layer op)
from minisgl_cli.kernels.triton.moe import FUSED_MAX_TOKENS as MOE_FUSED_MAX_TOKENS  # noqa: F401  (as gemv)
from minisgl_cli.kernels.triton.moe import SwiGLUExperts  # noqa: F401  (as gemv)
from minisgl_cli.kernels.triton.moe import fused_experts as moe_fused  # noqa: F401  (as gemv)
from minisgl_cli.kernels.triton.moe import route_grouped as moe_route_grouped  # noqa: F401  (as gemv)
from minisgl_cli.kernels.triton.moe import routed_experts as moe_routed  # noqa: F401  (as gemv)
from minisgl_cli.kernels.triton.pdl import pdl_kwargs
from minisgl_cli.kernels.triton.rope import rotate_halves
from minisgl_cli.kernels.triton.sampling import argmax_rows  # noqa: F401  (as gemv)
from minisgl_cli.kernels.triton.step_inputs import decode_inputs  # noqa: F401  (as gemv)


@triton.jit
def _add_norm_store(x, row, offs, mask, r_ptr, w, out_ptr, s_ptr, stride_r, stride_o, N, eps, tiny, inv_max,
                    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr):
    """Row `row`'s x (the engine dtype): add the residual (written back), normalize by w, store (or FP8 codes)."""
    if HAS_RESIDUAL:
        # residual = x + residual in the engine dtype (as the torch add rounds), written back in place
        s = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = s.to(x.dtype)
        tl.store(r_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / N + eps)
    h = (xf * rstd).to(x.dtype).to(tl.float32)
    y = (w * h).to(x.dtype)
    if QUANT:  # the FP8 GEMM's input: the normed row's codes and scale, as quant_rows would make of y
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), axis=0), tiny) * inv_max
        tl.store(out_ptr + row * stride_o + offs, fp8_codes(yf, scale, out_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(out_ptr + row * stride_o + offs, y, mask=mask)


@triton.jit
def _rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, s_ptr, stride_x, stride_r, stride_o, N, eps, tiny, inv_max,
                    HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, TERMS: tl.constexpr, BLOCK: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """TERMS > 1: row r of x is the sum of x's rows r TERMS ... r TERMS + TERMS - 1 (summed in fp32, rounded once,
    as torch's sum over them)."""
    if USE_PDL:  # see kernels/triton/pdl.py: the weight is read before the wait, activations after
        gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    if TERMS > 1:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(TERMS):
            acc += tl.load(x_ptr + (row * TERMS + j) * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(x_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    _add_norm_store(x, row, offs, mask, r_ptr, w, out_ptr, s_ptr, stride_r, stride_o, N, eps, tiny, inv_max,
                    HAS_RESIDUAL, QUANT)


@triton.jit
def _all_reduce_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, s_ptr, data_ptrs, flag_ptrs, epoch_ptr, rank, slot,
                               max_rows, stride_r, stride_o, N, eps, tiny, inv_max, WORLD: tl.constexpr,
                               QUANT: tl.constexpr, LAMPORT: tl.constexpr, UNSET: tl.constexpr, BLOCK: tl.constexpr,
                               USE_PDL: tl.constexpr):
    """Row `row` of every rank's partial sum x, summed over the TP group, then the residual add and RMSNorm:
    the memory protocol is distributed/push_rows.py's (LAMPORT: its flagless form; UNSET: -0.0's bits as a signed
    integer of the element's width)."""
    if USE_PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        gdc_wait()
    x = tl.load(x_ptr + row.to(tl.int64) * N + offs, mask=mask, other=0.0)
    dt = x_ptr.dtype.element_ty
    if LAMPORT:  # -0.0 means "not yet written" on the wire: send (and sum, as every rank does) +0.0 for it
        x = tl.where(x == 0, tl.zeros_like(x), x)
    epoch = tl.load(epoch_ptr + row) + 1
    tl.store(epoch_ptr + row, epoch)
    parity = epoch % 2
    # This rank's row into its slot of every peer's buffer, then (all stores issued: the barrier) the flags.
    mine = (parity * WORLD + rank) * slot + row.to(tl.int64) * N
    for q in tl.static_range(WORLD):
        if q != rank:
            tl.store(_buffer(x_ptr, tl.load(data_ptrs + q), LAMPORT) + mine + offs, x, mask=mask)
    if not LAMPORT:
        tl.debug_barrier()
        for q in tl.static_range(WORLD):
            if q != rank:
                flag = tl.load(flag_ptrs + q).to(tl.pointer_type(tl.int64)) + rank * max_rows + row
                tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    # The peers' rows, as each arrives, summed in rank order in fp32: every rank rounds alike, and (two ranks)
    # each element is one correctly rounded addition, as NCCL's and the one-shot's.
    own_data = _buffer(x_ptr, tl.load(data_ptrs + rank), LAMPORT)
    if not LAMPORT:
        own_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for q in tl.static_range(WORLD):
        if q == rank:
            acc += x.to(tl.float32)
        else:
            theirs = own_data + (parity * WORLD + q) * slot + row.to(tl.int64) * N
            if LAMPORT:
                acc += _lamport_take(theirs + offs, mask, UNSET).to(tl.float32)
            else:
                seen = tl.atomic_add(own_flags + q * max_rows + row, 0, sem="acquire", scope="sys")
                while seen < epoch:
                    seen = tl.atomic_add(own_flags + q * max_rows + row, 0, sem="acquire", scope="sys")
                tl.debug_barrier()
                acc += tl.load(theirs + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    _add_norm_store(acc.to(dt), row.to(tl.int64), offs, mask, r_ptr, w, out_ptr, s_ptr, stride_r, stride_o, N, eps,
                    tiny, inv_max, True, QUANT)


@triton.jit
def _buffer(anchor, addr, VECTORS: tl.constexpr):
    """The symmetric buffer at integer address `addr` as a pointer of `anchor`'s type. VECTORS: made from `anchor` (a
    pointer argument) plus their gap, so that Triton sees its alignment and moves rows as 16-byte vectors (a pointer
    made from an integer moves one element at a time: 8 stores a thread over NVLink instead of one). The buffers are
    16-byte aligned, so the gap is a multiple of 16 bytes wherever the anchor is aligned, and where it is not, Triton's
    alignment of the anchor bounds the sum's. Only the Lamport form takes it so far: the flag protocol keeps the
    element-wise accesses its TP 2 = NCCL runs were made with (docs/benchmarks.md, 2026-12-01)."""
    if VECTORS:
        nbytes: tl.constexpr = anchor.dtype.element_ty.primitive_bitwidth // 8
        return anchor + tl.multiple_of((addr - anchor.to(tl.int64)) // nbytes, 16 // nbytes)
    return addr.to(tl.pointer_type(anchor.dtype.element_ty))


@triton.jit
def _lamport_take(ptrs, mask, UNSET: tl.constexpr):
    """A peer's row at ptrs once every element has arrived (none reads -0.0), then -0.0 written back over it (the
    slot unwritten again for the call that next uses it). Each element is read and reset by the same thread."""
    bits_ty = tl.int16 if UNSET == -(1 << 15) else tl.int32
    v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    while tl.max((v.to(bits_ty, bitcast=True) == UNSET).to(tl.int32), axis=0) > 0:
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    tl.store(ptrs.to(tl.pointer_type(bits_ty)), tl.full(ptrs.shape, UNSET, bits_ty), mask=mask)
    return v


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            pdl: bool = True, quant: bool = False, terms: int = 1) -> torch.Tensor | Fp8Rows:
    """RMSNorm over the last dim of a 2-D x; with `residual`, first residual += x (in place) and norm that.

    quant: return the normed rows as e4m3 codes with a scale per row (`Fp8Rows`, what quant_rows gives of
    the 16-bit result) for an FP8 linear, saving that linear its own pass over the rows.
    terms: x is [T terms, n], each row of the result the sum of `terms` consecutive rows of x."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.shape[0] % terms == 0
    rows = x2.shape[0] // terms
    out = torch.empty((rows, n), dtype=FP8 if quant else x2.dtype, device=x2.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x2.device) if quant else out
    r2 = residual.reshape(-1, n) if residual is not None else x2
    if rows:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight, out, scales, x2.stride(0), r2.stride(0), out.stride(0), n, eps, TINY, INV_MAX,
            HAS_RESIDUAL=residual is not None, QUANT=quant, TERMS=terms, BLOCK=block,
            num_warps=min(16, max(1, block // 256)), **pdl_kwargs(x2, pdl),
        )
    if quant:
        return Fp8Rows(out, scales, x2.dtype)
    return out.view(x.shape) if terms == 1 else out


def all_reduce_rmsnorm(partial: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       push: PushRows, pdl: bool = True, quant: bool = False) -> torch.Tensor | Fp8Rows:
    """rmsnorm(sum of every TP rank's `partial`, residual) in one kernel (distributed/push_rows.py): residual +=
    the sum (in place), and the normed rows (FP8 codes with `quant`), as all_reduce then rmsnorm would give.
    Collective: every rank calls it with the same shapes. `push.takes(partial)` must hold."""
    assert push.data_ptrs is not None and push.flag_ptrs is not None
    t, n = partial.shape
    out = torch.empty((t, n), dtype=FP8 if quant else partial.dtype, device=partial.device)
    scales = torch.empty((t, 1), dtype=torch.float32, device=partial.device) if quant else out
    block = triton.next_power_of_2(n)
    _all_reduce_rmsnorm_kernel[(t,)](
        partial, residual, weight, out, scales, push.data_ptrs, push.flag_ptrs, push.epochs, push.rank, push.slot,
        push.max_rows, residual.stride(0), out.stride(0), n, eps, TINY, INV_MAX, WORLD=push.world, QUANT=quant,
        LAMPORT=push.lamport, UNSET=UNSET[partial.element_size()], BLOCK=block,
        num_warps=min(16, max(1, block // 256)), **pdl_kwargs(partial, pdl),
    )
    return Fp8Rows(out, scales, partial.dtype) if quant else out


@triton.jit
def _store_kv_heads(cache_ptr, scale_ptr, mean_ptr, slot, h, mask, x1, x2, offs, HEAD_DIM: tl.constexpr,
                    KV_FP8: tl.constexpr):
    """Rows of KV heads `h` ([HEADS, 1], those under `mask`), as two halves, into their cache slot: as they are,
    or (FP8) the e4m3 codes of x - mean at the head's scale."""
    half: tl.constexpr = HEAD_DIM // 2
    dst = cache_ptr + slot + h * HEAD_DIM
    if KV_FP8:
        scale = tl.load(scale_ptr + h, mask=mask, other=1.0)
        mean = mean_ptr + h * HEAD_DIM
        tl.store(dst + offs, fp8_codes(x1.to(tl.float32) - tl.load(mean + offs, mask=mask, other=0.0), scale,
                                       cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + half + offs, fp8_codes(x2.to(tl.float32) - tl.load(mean + half + offs, mask=mask, other=0.0),
                                              scale, cache_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + offs, x1, mask=mask)
        tl.store(dst + half + offs, x2, mask=mask)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, loc_ptr,
                         k_scale_ptr, v_scale_ptr, k_mean_ptr, v_mean_ptr, stride_t, stride_cos, stride_cs, eps,
                         NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HEADS: tl.constexpr,
                         HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, KV_FP8: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """One token's heads j0 .. j0 + HEADS of N_HEADS (q heads, then k heads, then with STORE_KV v heads: their
    order in the qkv row) as two [HEADS, HEAD_DIM / 2] halves: q/k get their norm and RoPE, k and v go to the pool."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)[None, :]
    rot = j < NUM_Q + NUM_KV  # q and k heads: normed, rotated, written back
    is_k = (j >= NUM_Q) & rot
    is_v = (j >= NUM_Q + NUM_KV) & (j < N_HEADS)
    base = qkv_ptr + t * stride_t + j * HEAD_DIM
    x1 = tl.load(base + offs, mask=j < N_HEADS, other=0.0)
    x2 = tl.load(base + half + offs, mask=j < N_HEADS, other=0.0)
    dt = x1.dtype
    slot = tl.load(loc_ptr + t).to(tl.int64) * stride_cs  # (without STORE_KV loc is the positions: unused)
    if STORE_KV:  # v heads: copied to their slot
        _store_kv_heads(v_cache_ptr, v_scale_ptr, v_mean_ptr, slot, j - NUM_Q - NUM_KV, is_v, x1, x2, offs,
                        HEAD_DIM, KV_FP8)
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1))[:, None] / HEAD_DIM + eps)
        is_q = j < NUM_Q
        w1 = tl.where(is_q, tl.load(qw_ptr + offs), tl.load(kw_ptr + offs)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qw_ptr + half + offs), tl.load(kw_ptr + half + offs)).to(tl.float32)
        x1 = (w1 * (f1 * rstd).to(dt).to(tl.float32)).to(dt)
        x2 = (w2 * (f2 * rstd).to(dt).to(tl.float32)).to(dt)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_cos + offs).to(dt).to(tl.float32)  # cos/sin repeat over the halves
    s = tl.load(sin_ptr + pos * stride_cos + offs).to(dt).to(tl.float32)
    o1, o2 = rotate_halves(x1.to(tl.float32), x2.to(tl.float32), c, s, dt)
    tl.store(base + offs, o1, mask=rot)
    tl.store(base + half + offs, o2, mask=rot)
    if STORE_KV:  # the rotated k as the q/k rows hold it
        _store_kv_heads(k_cache_ptr, k_scale_ptr, k_mean_ptr, slot, j - NUM_Q, is_k, o1, o2, offs, HEAD_DIM, KV_FP8)



def qk_norm_rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  num_q: int, num_kv: int, head_dim: int, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, eps: float, kv_cache: KVCache | None = None, pdl: bool = True,
                  config: tuple[int, int] | None = None) -> None:
    """In place on the q and k heads of a fused qkv [T, (Hq + 2 Hkv) * D]: optional per-head RMSNorm, then RoPE.

    With kv_cache = (k_cache, v_cache, loc, quant) ([slots, Hkv, D] each, loc [T]) the same launch also
    writes the rotated k and the v heads to their slots: the attention backend then skips its own store.
    quant: an FP8 cache's scales and means (kernels/fp8.py; the heads are stored as e4m3 codes), else None.
    """
    T = qkv.shape[0]
    if T == 0:
        return
    has_norm = q_weight is not None
    qw = q_weight if has_norm else cos
    kw = k_weight if has_norm else cos
    k_cache, v_cache, loc, quant = kv_cache if kv_cache is not None else (qkv, qkv, positions, None)
    if kv_cache is not None:
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[1:] == (num_kv, head_dim)
    fp8 = quant if quant is not None else (cos,) * 4  # placeholders, never read
    heads = num_q + (2 if kv_cache is not None else 1) * num_kv
    per, warps = config or pick_rope_config(T)
    _qk_norm_rope_kernel[(T, triton.cdiv(heads, per))](
        qkv, positions, cos, sin, qw, kw, k_cache, v_cache, loc, *fp8, qkv.stride(0), cos.stride(0),
        k_cache.stride(0), eps, NUM_Q=num_q, NUM_KV=num_kv, N_HEADS=heads, HEAD_DIM=head_dim, HEADS=per,
        HAS_NORM=has_norm,
        STORE_KV=kv_cache is not None, KV_FP8=quant is not None, num_warps=warps, **pdl_kwargs(qkv, pdl),
    )


def pick_rope_config(tokens: int) -> tuple[int, int]:
    """(heads per program, num_warps) of qk_norm_rope_, from a sweep on an H100 (examples/gpu_bench.py --only
    fp8ops): one head per one-warp program up to 16 tokens (the most programs in flight); beyond, 16 heads per
    program -- 2x faster at 256 tokens (a decode batch) and 3-5x at 8192 (a prefill chunk) than a program per
    head, whose cos / sin and slot loads each wait on one another; a token's heads all in one program was no faster
    than one per head."""
    return (1, 1) if tokens <= 16 else (16, 4)


@triton.jit
def _rope_pair_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_ct, stride_st,
                      NUM_Q: tl.constexpr, D: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (t, h): token t's q head h (h < NUM_Q) or its k (h == NUM_Q), rotated in place (`rotate_halves`; the
    cos repeats over the halves and sin_signed's second half is the plain sin, as RotaryEmbedding.at builds them)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < NUM_Q:
        row = q_ptr + t * stride_qt + h * stride_qh
    else:
        row = k_ptr + t * stride_kt
    half: tl.constexpr = D // 2
    d = tl.arange(0, half)
    x1 = tl.load(row + d)
    x2 = tl.load(row + half + d)
    c = tl.load(cos_ptr + t * stride_ct + d).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + half + d).to(tl.float32)
    o1, o2 = rotate_halves(x1.to(tl.float32), x2.to(tl.float32), c, s, x1.dtype)
    tl.store(row + d, o1)
    tl.store(row + half + d, o2)


def rope_pair_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
               pdl: bool = True) -> None:
    """q [T, H, D] and k [T, D] (16-bit; rows may be views into wider ones) rotated in place in one launch, as
    layers/rotary.py's rotate(x, (cos, sin_signed)) computes them; cos / sin_signed [T, 1, D] (`RotaryEmbedding.at`)."""
    n_tok, heads, dim = q.shape
    assert k.shape == (n_tok, dim) and dim & (dim - 1) == 0 and q.stride(2) == k.stride(1) == 1
    assert q.dtype == k.dtype and q.dtype in (torch.bfloat16, torch.float16)
    if n_tok:
        _rope_pair_kernel[(n_tok, heads + 1)](
            q, k, cos, sin_signed, q.stride(0), q.stride(1), k.stride(0), cos.stride(0), sin_signed.stride(0),
            NUM_Q=heads, D=dim, num_warps=1, **pdl_kwargs(q, pdl),
        )


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    T, n2 = gate_up.shape
    n = n2 // 2
    out = torch.empty((T, n), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        block = min(2048, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(T, triton.cdiv(n, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4, **pdl_kwargs(gate_up, pdl),
        )
    return out
