"""The fused MoE experts in Triton (CUDA): softmax top-k routing, per-expert block alignment, two grouped GEMMs.

One layer's experts in four or five launches (w8a8: two more, the quantizations) and a sum, none reading a value
back to the host (CUDA graphs capture them):

  route     one program per token: softmax over the experts in fp32, the k largest (lowest id first on a tie),
            renormalized where the model says so (`route` in layers/moe.py is the reference); DeepSeek's grouped
            choice from its scores likewise (`route_grouped`)
  align     the T k (token, choice) slots sorted by expert (stable: slots ascending within one), each expert's
            run padded to a whole number of BLOCK_M rows with an out-of-range slot id, and the expert of each
            block; blocks past the padded total are skipped by the GEMMs. One program per chunk of slots, after
            a launch that counts each chunk's slots per expert (none when one chunk holds them all: decode)
  gate/up   per (block, BLOCK_N columns): the block's token rows times its expert's gate and up rows in two
            accumulators, SiLU(gate) * up written per slot [T k, I]: the [T k, 2I] gate-up never exists
  down      per (block, BLOCK_N columns): those rows times the expert's down rows, scaled by the slot's routing
            weight, written per slot [T k, H]; a torch sum over each token's k slots follows (no atomics: the
            result does not depend on the order blocks run in), or on one CUDA rank the next RMSNorm sums them
            (`terms`: layers/norm.py's Terms)

Up to SMALL_MAX_TOKENS tokens (decode) `one_slot_experts` skips route and align: block b holds slot b alone in its
first row, and the gate/up programs route their slot themselves (the token's top-k from its E logits, recomputed in
each) and write its expert and weight for down; gate, gate/up, down: three launches a layer. At one token the tiles
(moe_tiles.py) pick the GEMV form of those blocks (BLOCK_M 1, `_expert_gemv_kernel`): a program streams BLOCK_N rows
of its slot's expert against the one activation row in fp32 multiply-adds, in the weights' own layout, where an MMA
tile would be 15 padding rows and its operands shuffled through shared memory (gpt-oss's packed experts on an H200:
45 against 78 µs a layer). The GEMV form also takes choices handed in (`fused_experts`: a slot a program, no
alignment).

Each output row is one MMA row of its block, so where a slot lands in its block changes nothing in its value.
FP8 expert weights (e4m3, an fp32 scale per output row) run w8a16 or w8a8 (kernels/triton/moe_tiles.py says which and
when): w8a16 widens the weight tile to the activation dtype; w8a8 takes the activations as e4m3 codes with a scale per
row (triton_fp8.quant_rows: the tokens before gate/up, the gate/up output before down), an FP8 MMA on the two 8-bit
tiles. The scales multiply the finished accumulator. MXFP4 expert weights (gpt-oss's, kept as its checkpoints ship them:
two e2m1 codes a byte, an e8m0 exponent per 32 values along K) run w4a16: the bytes and exponents loaded as stored, each
tile widened to the activation dtype in registers (`_mxfp4_tile`: exact, so the result is the dequantized weights' up to
the order of the fp32 sums), a 16-bit MMA; the GEMV form (one token) multiplies codes and activations as fp16 pairs on
CUDA, its sums rounded in fp16 four products at a time (`_block_sums_f16`). Block-wise FP8 expert weights (DeepSeek-V3's
checkpoints: e4m3, an fp32 scale per 128 x 128 block, `block`) keep the per-row FP8 experts' w8a16 / w8a8 choice, but
their scales vary along K: each K step stays inside one block column and its dot joins the sum times its blocks' scales
(w8a8: and its rows' scales, the activations quantized per token per 128 columns by kernels/triton/fp8_block.py's
quant_groups, as the dense block-FP8 linears take them). The grid is sized for the worst case the shapes allow: min(T k
BLOCK_M, T k + E (BLOCK_M - 1)) rows, so a decode step's handful of slots launches a handful of blocks.

gpt-oss's experts (`SwiGLUExperts`): each projection's per-expert bias added to its rounded output, and the clamped
SwiGLU in place of SiLU-and-mul, in the same two GEMMs; its routing (a softmax over the k largest logits) is the
renormalized softmax top-k the kernels compute.

The caller (layers/moe.py) takes torch's grouped GEMM past `FUSED_MAX_TOKENS` tokens (prefill chunks) on the
GPUs where it runs (examples/moe_bench.py measures both; kernels/triton/moe_tiles.py says what was chosen and why).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minisgl_cli.kernels.triton.fp8 import quant_rows
from minisgl_cli.kernels.triton.fp8_block import quant_groups
from minisgl_cli.kernels.triton.moe_tiles import (  # noqa: F401  (re-exported)
    FUSED_MAX_TOKENS,
    GEMV_SWEEP,
    MMA_16BIT_FEW,
    MMA_MXFP4_ONE,
    ROUTE_APART_EXPERTS,
    SMALL_MAX_TOKENS,
    MoeConfig,
    MoeTiles,
    pick_tiles,
)
from minisgl_cli.kernels.triton.pdl import pdl_kwargs


@triton.jit
def _pick_k(x, e, K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr):
    """The K largest of x [E_P2] (lanes e), one by one in registers, the lowest lane first on a tie, none twice:
    (their values, their lanes), each [K_P2]; lanes from K hold 0 and E_P2."""
    j = tl.arange(0, K_P2)
    tops = tl.zeros((K_P2,), dtype=tl.float32)
    ids = tl.full((K_P2,), E_P2, dtype=tl.int32)
    taken = e < 0
    for i in tl.static_range(K):
        top = tl.max(tl.where(taken, float("-inf"), x), axis=0)
        pick = tl.min(tl.where((x == top) & ~taken, e, E_P2), axis=0)
        tops = tl.where(j == i, top, tops)
        ids = tl.where(j == i, pick, ids)
        taken = taken | (e == pick)
    return tops, ids


@triton.jit
def _top_k(logits_ptr, row, stride_l, E, K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
           RENORMALIZE: tl.constexpr):
    """(weights [K_P2] fp32, ids [K_P2] int32) of token `row`'s gate logits; lanes from K hold 0 and E_P2."""
    e = tl.arange(0, E_P2)
    x = tl.load(logits_ptr + row * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    weights, ids = _pick_k(tl.where(e < E, p, float("-inf")), e, K, K_P2, E_P2)  # padding lanes never win
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, stride_l, E, K: tl.constexpr, K_P2: tl.constexpr,
                  E_P2: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    weights, ids = _top_k(logits_ptr, row, stride_l, E, K, K_P2, E_P2, RENORMALIZE)
    j = tl.arange(0, K_P2)
    tl.store(w_ptr + row * K + j, weights, mask=j < K)
    tl.store(ids_ptr + row * K + j, ids, mask=j < K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int32) of gate logits [T, E]: layers/moe.py's `route` in one launch."""
    n_tok, n_exp = logits.shape
    weights = torch.empty(n_tok, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n_tok, top_k, dtype=torch.int32, device=logits.device)
    if n_tok:
        _route_kernel[(n_tok,)](logits, weights, ids, logits.stride(0), n_exp, K=top_k,
                                K_P2=triton.next_power_of_2(top_k), E_P2=triton.next_power_of_2(n_exp),
                                RENORMALIZE=renormalize, **pdl_kwargs(logits, pdl))
    return weights, ids


@triton.jit
def _grouped_route_kernel(scores_ptr, bias_ptr, w_ptr, ids_ptr, stride_s, E, group_size, masked, scale,
                          K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, GROUPS: tl.constexpr,
                          G_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP2_SUM: tl.constexpr,
                          HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, USE_PDL: tl.constexpr):
    """Program t: token t's DeepSeek choice from its scores [E] (layers/moe.py's `route_grouped` after the scores):
    the choice values (scores + the correction bias), each group's score (the sum of its two best, or its best),
    the TOPK_GROUP best groups kept (the rest set to `masked`), the K best kept experts (lowest id first on a tie),
    their scores renormalized and scaled, stored with the ids ascending."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P2)
    valid = e < E
    scores = tl.load(scores_ptr + row * stride_s + e, mask=valid, other=0.0)
    choice = scores
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0)
    if GROUPS:
        g = tl.arange(0, G_P2)
        member = (e[None, :] // group_size == g[:, None]) & valid[None, :]  # [G_P2, E_P2]: expert e in group g
        vals = tl.where(member, choice[None, :], float("-inf"))
        best = tl.max(vals, axis=1)
        if TOP2_SUM:  # the best two, the first best's lane set aside (a tie counts twice, as topk(2) does)
            first = tl.min(tl.where(vals == best[:, None], e[None, :], E_P2), axis=1)
            second = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), vals), axis=1)
            group_score = best + second
        else:
            group_score = best
        group_score = tl.where(g < E // group_size, group_score, float("-inf"))
        kept = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, axis=0)
            pick = tl.min(tl.where(group_score == top, g, G_P2), axis=0)
            kept = kept | (g == pick)
            group_score = tl.where(g == pick, float("-inf"), group_score)
        keep = tl.max(tl.where(member & kept[:, None], 1, 0), axis=0) > 0
        choice = tl.where(keep, choice, masked)
    _, ids = _pick_k(tl.where(valid, choice, float("-inf")), e, K, K_P2, E_P2)  # padding lanes never win
    # the weights are the picks' scores, not their biased values (lanes from K: id E_P2, weight 0)
    weights = tl.sum(tl.where(e[None, :] == ids[:, None], scores[None, :], 0.0), axis=1)
    j = tl.arange(0, K_P2)
    if RENORMALIZE:
        weights = tl.div_rn(weights, tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scale
    rank = tl.sum(tl.where(ids[None, :] < ids[:, None], 1, 0), axis=1)  # each pick's place among the ids ascending
    tl.store(w_ptr + row * K + rank, weights, mask=j < K)
    tl.store(ids_ptr + row * K + rank, ids, mask=j < K)


def route_grouped(scores: torch.Tensor, top_k: int, bias: torch.Tensor | None, n_group: int, topk_group: int,
                  top2_sum: bool, masked: float, renormalize: bool, scale: float,
                  pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int32 ascending) of DeepSeek's router from its scores [T, E] fp32
    (the sigmoid or softmax of the logits): layers/moe.py's `route_grouped` after its first op, in one launch.
    Groups are scored where n_group > 1 or top2_sum (V3 scores its one group); `masked` is what a dropped group's
    experts count as (-inf: V3, 0: V2)."""
    n_tok, n_exp = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(1) == 1 and n_exp % n_group == 0
    weights = torch.empty(n_tok, top_k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(n_tok, top_k, dtype=torch.int32, device=scores.device)
    if n_tok:
        _grouped_route_kernel[(n_tok,)](
            scores, bias if bias is not None else scores, weights, ids, scores.stride(0), n_exp, n_exp // n_group,
            masked, scale, K=top_k, K_P2=triton.next_power_of_2(top_k), E_P2=triton.next_power_of_2(n_exp),
            GROUPS=n_group > 1 or top2_sum, G_P2=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group,
            TOP2_SUM=top2_sum, HAS_BIAS=bias is not None, RENORMALIZE=renormalize, **pdl_kwargs(scores, pdl))
    return weights, ids


@triton.jit
def _count_kernel(ids_ptr, hist_ptr, numel, E_P2: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """hist[c, e]: the slots of chunk c (CHUNK slots from c CHUNK) that chose expert e."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    c = tl.program_id(0)
    r = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + r, mask=r < numel, other=-1)
    experts = tl.arange(0, E_P2)
    tl.store(hist_ptr + c * E_P2 + experts, tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0))


@triton.jit
def _place_kernel(ids_ptr, hist_ptr, sorted_ptr, block_expert_ptr, total_ptr, numel, n_chunks, n_blocks,
                  E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, ONE_CHUNK: tl.constexpr,
                  BLOCKS: tl.constexpr, USE_PDL: tl.constexpr):
    """Chunk c's slots to their rows; its share of the blocks' experts and padding rows."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    c = tl.program_id(0)
    experts = tl.arange(0, E_P2)
    r = tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + c * CHUNK + r, mask=c * CHUNK + r < numel, other=-1)
    hit = (e[:, None] == experts[None, :]).to(tl.int32)
    if ONE_CHUNK:  # decode-sized: no count launch before this one
        counts = tl.sum(hit, axis=0)
        before = tl.zeros((E_P2,), dtype=tl.int32)
    else:  # every chunk's counts; those of the chunks before this one
        counts = tl.zeros((E_P2,), dtype=tl.int32)
        before = tl.zeros((E_P2,), dtype=tl.int32)
        rows = tl.arange(0, 16)
        for c0 in range(0, n_chunks, 16):
            h = tl.load(hist_ptr + (c0 + rows)[:, None] * E_P2 + experts[None, :],
                        mask=(c0 + rows < n_chunks)[:, None], other=0)
            counts += tl.sum(h, axis=0)
            before += tl.sum(tl.where((c0 + rows < c)[:, None], h, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    if c == 0:
        tl.store(total_ptr, tl.sum(padded, axis=0))
    # each slot: its expert's run start, that expert's slots in earlier chunks, the earlier ones of this chunk
    # that chose it (stable: slots ascend within an expert)
    rank = tl.sum(tl.cumsum(hit, axis=0) * hit, axis=1) - 1
    pos = tl.sum(hit * (starts + before)[None, :], axis=1) + rank
    tl.store(sorted_ptr + pos, c * CHUNK + r, mask=c * CHUNK + r < numel)
    # blocks c, c + n_chunks, ...: the expert (the number of runs ending at or before the block's first row) and
    # the out-of-range slot id `numel` in its rows past the expert's slots (rows no slot above writes)
    m = tl.arange(0, BLOCK_M)
    for b0 in range(c * BLOCKS, n_blocks, n_chunks * BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        first = b * BLOCK_M
        owner = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b < n_blocks)
        mine = owner[:, None] == experts[None, :]
        used = tl.sum(tl.where(mine, (starts + counts)[None, :], 0), axis=1)  # one past the expert's last slot row
        row = first[:, None] + m[None, :]
        tl.store(sorted_ptr + row, tl.full((BLOCKS, BLOCK_M), 0, tl.int32) + numel,
                 mask=(b < n_blocks)[:, None] & (row >= used[:, None]))


@triton.jit
def _e8m0_scale(e):
    """The fp32 factor of MXFP4 codes widened by the fp16 trick (`_mxfp4_tile`) under e8m0 exponents e:
    2 ** (e - 127), times the trick's 2 ** 14."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit
def _mxfp4_tile(packed, exps, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile in `dtype` of MXFP4 rows: bytes [BLOCK_N, BLOCK_K / 2] (two e2m1 codes
    each, the low nibble first) and e8m0 exponents [BLOCK_N, BLOCK_K / 32] (one per 32 values: 2 ** (e - 127)).

    A code's bits moved into fp16's (sign to bit 15, its exponent and mantissa bits under fp16's lowest exponent bits
    and top mantissa bit) make its value times 2 ** -14 (the code 0.5 an fp16 subnormal, which widens exactly), so
    each value is a shift and a mask or two, a widening and one multiply by its block's 2 ** (e - 127 + 14), made once
    a block. Exact (e2m1 times a power of two), as loader/mxfp4.py's `dequantize`, for exponents 2 .. 240."""
    p = packed.to(tl.int32)
    lo = ((p & 0x07) << 9) | ((p & 0x08) << 12)
    hi = ((p & 0x70) << 5) | ((p & 0x80) << 8)
    half = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # k = 2 byte + nibble
    half = half.to(tl.int16).to(tl.float16, bitcast=True)
    scale = tl.reshape(tl.broadcast_to(_e8m0_scale(exps)[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    return tl.trans((half.to(tl.float32) * scale).to(dtype))


@triton.jit
def _slot_expert(logits_ptr, rw_ptr, block_expert_ptr, pid_m, pid_n, stride_l, E, A_DIV: tl.constexpr,
                 ROUTE: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """The expert of one-slot block `pid_m`: ROUTE (gate/up) picks it from its token's top-k of the gate logits (in
    every program of the slot) and the first column tile writes it and its weight for down; else it is read."""
    if ROUTE:
        weights, ids = _top_k(logits_ptr, pid_m // A_DIV, stride_l, E, A_DIV, K_P2, E_P2, RENORMALIZE)
        mine = tl.arange(0, K_P2) == pid_m % A_DIV
        expert = tl.sum(tl.where(mine, ids, 0), axis=0).to(tl.int64)
        if pid_n == 0:
            tl.store(rw_ptr + pid_m, tl.sum(tl.where(mine, weights, 0.0), axis=0))
            tl.store(block_expert_ptr + pid_m, expert.to(tl.int32))
    else:
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    return expert


@triton.jit
def _finish(acc, acc_up, slot, valid, rn, mask_n, expert, as_ptr, s_ptr, b_ptr, rw_ptr, c_ptr, N, stride_se,
            stride_be, stride_c, limit, alpha, A_DIV: tl.constexpr, GATED: tl.constexpr, ROUTED: tl.constexpr,
            HAS_SCALE: tl.constexpr, A_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr):
    """An expert GEMM's epilogue on its fp32 sums [rows, BLOCK_N] of slots `slot` (those `valid`), columns rn: the
    weights' row scales (HAS_SCALE) and the activations' (A_SCALE), the biases, SiLU-and-mul or gpt-oss's SwiGLU
    (GATED; acc_up the up projection's), the routing weight (ROUTED), stored to c in its dtype."""
    if HAS_SCALE:  # FP8 weights: w = code * scale[expert, row]
        s_ptrs = s_ptr + expert * stride_se + rn
        acc *= tl.load(s_ptrs, mask=mask_n, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_ptrs + N, mask=mask_n, other=0.0)[None, :]
    if A_SCALE:  # FP8 activations: a = code * scale[row]
        a_scale = tl.load(as_ptr + slot // A_DIV, mask=valid, other=0.0)[:, None]
        acc *= a_scale
        if GATED:
            acc_up *= a_scale
    dtype = c_ptr.dtype.element_ty
    if HAS_BIAS:  # added to the rounded product, as the torch path adds it
        b_ptrs = b_ptr + expert * stride_be + rn
        acc = acc.to(dtype).to(tl.float32) + tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)
        if GATED:
            acc_up = acc_up.to(dtype).to(tl.float32) + tl.load(b_ptrs + N, mask=mask_n, other=0.0).to(tl.float32)
    if GATED:  # rounded where the unfused path rounds: gate and up, silu(gate), the product
        g = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        if SWIGLU:  # the gate clamped above, the up both ways: gate * sigmoid(alpha gate) * (up + 1)
            g = tl.minimum(g, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
            act = (g / (1.0 + tl.exp(-alpha * g))).to(dtype).to(tl.float32)
        else:
            act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        acc = act * up
    if ROUTED:
        acc *= tl.load(rw_ptr + slot, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + slot.to(tl.int64)[:, None] * stride_c + rn[None, :]
    tl.store(c_ptrs, acc.to(dtype), mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _expert_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, b_ptr, c_ptr, rw_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                        logits_ptr, N, K, numel, E, stride_a, stride_as, stride_we, stride_wn, stride_c, stride_se,
                        stride_sn, stride_be, stride_l, limit, alpha, A_DIV: tl.constexpr, GATED: tl.constexpr,
                        ROUTED: tl.constexpr, HAS_SCALE: tl.constexpr, MXFP4: tl.constexpr, A_SCALE: tl.constexpr,
                        BLOCK_SCALE: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        ONE_SLOT: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, RENORMALIZE: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """c[slot, n] for the slots of block program_id(0), columns of program_id(1): a[slot // A_DIV] . w[expert, n]
    (GATED: silu(. w[expert, n]) * (. w[expert, N + n])); ROUTED: times rw[slot]. A_SCALE: a holds e4m3 codes,
    row r's value codes * as[r], and the MMA runs on the 8-bit tiles. gpt-oss: HAS_BIAS adds b[expert, n] (and
    b[expert, N + n]) to each projection's output; SWIGLU takes its clamped SwiGLU (`limit`, `alpha`) for SiLU-and-mul.
    MXFP4: w holds bytes [E, rows, K / 2] (two e2m1 codes each) and s e8m0 exponents [E, rows, K / 32], widened to
    a's dtype in registers (`_mxfp4_tile`). BLOCK_SCALE (block-wise FP8, DeepSeek-V3's): s holds an fp32 scale per
    (GROUP_N x GROUP_K) block of w [E, rows / GROUP_N, K / GROUP_K], each K step (inside one group) scaled by its
    blocks' before it joins the sum; with A_SCALE, a's scales are per row per K group too [rows, K / GROUP_K].

    ONE_SLOT (a few tokens, no alignment): block b holds slot b alone, in its first row. Gate/up routes it (its
    token's top-k from the gate logits, in every program of the slot) and its first column tile writes the
    slot's expert and weight (block_expert, rw) for down, which reads them."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if ONE_SLOT:
        expert = _slot_expert(logits_ptr, rw_ptr, block_expert_ptr, pid_m, pid_n, stride_l, E, A_DIV, GATED, K_P2,
                              E_P2, RENORMALIZE)
        rows = tl.arange(0, BLOCK_M)
        slot = pid_m + rows * 0
        valid = rows == 0
    else:
        if pid_m * BLOCK_M >= tl.load(total_ptr):
            return
        slot = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = slot < numel
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slot // A_DIV).to(tl.int64)[:, None] * stride_a + rk[None, :]
    # the weight tile read as [BLOCK_K, BLOCK_N] of the row-major [N, K] matrix
    w_ptrs = w_ptr + expert * stride_we + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
    if BLOCK_SCALE:  # each column's row of block scales, each row's of group scales
        sb_ptrs = s_ptr + expert * stride_se + (rn // GROUP_N) * stride_sn
        if A_SCALE:
            sa_ptrs = as_ptr + (slot // A_DIV).to(tl.int64) * stride_as
    if MXFP4:  # as stored, [BLOCK_N, BLOCK_K / 2] bytes and [BLOCK_N, BLOCK_K / 32] exponents (K a multiple of 32)
        rb = tl.arange(0, BLOCK_K // 2)
        rs = tl.arange(0, BLOCK_K // 32)
        w_ptrs = w_ptr + expert * stride_we + rn.to(tl.int64)[:, None] * stride_wn + rb[None, :]
        s_ptrs = s_ptr + expert * stride_se + rn.to(tl.int64)[:, None] * stride_sn + rs[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # a e4m3 (A_SCALE): the weight tile's .to is none, an FP8 MMA
        mk = k0 + rk < K
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & mk[None, :], other=0.0)
        if MXFP4:
            bm = mask_n[:, None] & (k0 // 2 + rb < K // 2)[None, :]
            sm = mask_n[:, None] & (k0 // 32 + rs < K // 32)[None, :]
            w = _mxfp4_tile(tl.load(w_ptrs + k0 // 2, mask=bm, other=0), tl.load(s_ptrs + k0 // 32, mask=sm, other=0),
                            a.dtype, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, w, acc)
            if GATED:
                w = _mxfp4_tile(tl.load(w_ptrs + N * stride_wn + k0 // 2, mask=bm, other=0),
                                tl.load(s_ptrs + N * stride_sn + k0 // 32, mask=sm, other=0), a.dtype, BLOCK_N, BLOCK_K)
                acc_up = tl.dot(a, w, acc_up)
        elif BLOCK_SCALE:  # the step's dot, in fp32, times its weight blocks' scales (and its rows' group scales)
            wm = mk[:, None] & mask_n[None, :]
            scale = tl.load(sb_ptrs + k0 // GROUP_K, mask=mask_n, other=0.0)[None, :]
            if A_SCALE:
                scale = scale * tl.load(sa_ptrs + k0 // GROUP_K, mask=valid, other=0.0)[:, None]
            acc += tl.dot(a, tl.load(w_ptrs + k0, mask=wm, other=0.0).to(a.dtype)) * scale
            if GATED:
                scale = tl.load(sb_ptrs + (N // GROUP_N) * stride_sn + k0 // GROUP_K, mask=mask_n, other=0.0)[None, :]
                if A_SCALE:
                    scale = scale * tl.load(sa_ptrs + k0 // GROUP_K, mask=valid, other=0.0)[:, None]
                acc_up += tl.dot(a, tl.load(w_ptrs + N * stride_wn + k0, mask=wm, other=0.0).to(a.dtype)) * scale
        else:
            wm = mk[:, None] & mask_n[None, :]
            acc = tl.dot(a, tl.load(w_ptrs + k0, mask=wm, other=0.0).to(a.dtype), acc)
            if GATED:
                acc_up = tl.dot(a, tl.load(w_ptrs + N * stride_wn + k0, mask=wm, other=0.0).to(a.dtype), acc_up)
    _finish(acc, acc_up, slot, valid, rn, mask_n, expert, as_ptr, s_ptr, b_ptr, rw_ptr, c_ptr, N, stride_se,
            stride_be, stride_c, limit, alpha, A_DIV, GATED, ROUTED, HAS_SCALE, A_SCALE and not BLOCK_SCALE, HAS_BIAS,
            SWIGLU)


@triton.jit
def _dense_dots(x_ptr, w_rows, up, mask_n, K, GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight rows `w_rows` [BLOCK_N] (16-bit or e4m3: widened in registers) times the row x [K], and with GATED the
    rows `up` elements on: (sums, up's sums) [BLOCK_N] fp32. Each chunk's next is asked for before this one's sums."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_rows[:, None] + rk[None, :]
    m = mask_n[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptrs, mask=m, other=0.0, eviction_policy="evict_first")
    wu = w
    if GATED:
        wu = tl.load(w_ptrs + up, mask=m, other=0.0, eviction_policy="evict_first")
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)[None, :]
        m = mask_n[:, None] & (k0 + BLOCK_K + rk < K)[None, :]  # all false after the last chunk: nothing read
        nxt = tl.load(w_ptrs + k0 + BLOCK_K, mask=m, other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * x
        w = nxt
        if GATED:
            nxt = tl.load(w_ptrs + up + k0 + BLOCK_K, mask=m, other=0.0, eviction_policy="evict_first")
            acc_up += wu.to(tl.float32) * x
            wu = nxt
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _half_pair(p, ASM: tl.constexpr):
    """The two fp16 values whose bits a word holds (low half, high half), in fp32. ASM (CUDA; Triton's interpreter
    runs no PTX): one conversion a half read in place; the casts through int16 cost a byte permute a pair besides."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [p], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    lo = p.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _x_pair(x, A_BF16: tl.constexpr, ASM: tl.constexpr):
    """The two 16-bit activations a word holds (x[2j], x[2j + 1]), in fp32."""
    if A_BF16:  # bf16 is fp32's top half
        return (x << 16).to(tl.float32, bitcast=True), (x & -65536).to(tl.float32, bitcast=True)
    return _half_pair(x, ASM)


@triton.jit
def _mxfp4_word_dots(v, x0, x1, x2, x3, x4, x5, x6, x7):
    """Each word of MXFP4 codes v (8 values: byte i holds values 2i, 2i + 1 in its low and high nibble) times its 8
    activations x0 .. x7 (fp32, broadcast against v), summed a word, times 2 ** -14 (the block's scale brings it back:
    `_mxfp4_tile`'s fp16 trick). A mask and a shift or two make two values' fp16 bits at once: values (0, 4), (1, 5),
    (2, 6), (3, 7) land in a word's low and high halves. The interpreter's form (`_block_sums_f16` is CUDA's): fp32
    products, no PTX."""
    a, b = _half_pair(((v & 0x00070007) << 9) | ((v & 0x00080008) << 12), False)
    t = a * x0
    t = t + b * x4  # one chain of multiply-adds (a sum of products would add its pairs apart: 3 more a word)
    a, b = _half_pair(((v & 0x00700070) << 5) | ((v & 0x00800080) << 8), False)
    t = t + a * x1
    t = t + b * x5
    a, b = _half_pair(((v & 0x07000700) << 1) | ((v & 0x08000800) << 4), False)
    t = t + a * x2
    t = t + b * x6
    a, b = _half_pair(((v >> 3) & 0x0E000E00) | (v & -2147450880), False)  # -2147450880: 0x80008000, the signs
    t = t + a * x3
    return t + b * x7


@triton.jit
def _e4m3_codes(v):
    """Words v of 8 e2m1 codes as two words of e4m3 bytes, each value times 2 ** -6 exactly (0 and 0.5 too): the
    even values (byte i: value 2i) and the odd ones (value 2i + 1)."""
    even = ((v << 4) & -2139062144) | ((v << 2) & 0x1C1C1C1C)  # -2139062144: 0x80808080, the signs
    odd = (v & -2139062144) | ((v >> 2) & 0x1C1C1C1C)
    return even, odd


@triton.jit
def _f16x2_dots0(codes, xa, xb):
    """codes' 4 e4m3 values times their activations, summed as fp16 pairs (xa: bytes 0, 1; xb: bytes 2, 3)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 l, h; .reg .b32 a, b, t; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 a, l; "
        "cvt.rn.f16x2.e4m3x2 b, h; mul.rn.f16x2 t, a, $2; fma.rn.f16x2 $0, b, $3, t; }",
        "=r,r,r,r", [codes, xa, xb], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f16x2_dots(codes, xa, xb, acc):
    """acc + codes' 4 e4m3 values times their activations, all as fp16 pairs (xa: bytes 0, 1; xb: bytes 2, 3)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 l, h; .reg .b32 a, b, t; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 a, l; "
        "cvt.rn.f16x2.e4m3x2 b, h; fma.rn.f16x2 t, a, $2, $4; fma.rn.f16x2 $0, b, $3, t; }",
        "=r,r,r,r,r", [codes, xa, xb, acc], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _f16_pack(lo, hi):
    """fp32 lo and hi as one word of fp16 (lo the low half)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _block_sums_f16(v, e, x02, x46, x13, x57, BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """`_block_sums` on CUDA: each word's 8 products as fp16 pairs (the codes as e4m3 bytes of their values times 2 **
    -6, `_e4m3_codes`; activations x02 .. x57 packed in pairs, `_f16_pack`), a word summed in fp16 (two fmas a half),
    its halves and words in fp32. A product of an e2m1 value and a bf16 activation is exact in fp16 where it is normal
    (2 + 8 significant bits), so what changes against fp32 is 3 fp16 roundings a half-word's sum and products under 2 **
    -14 (activations under ~4e-3 / value) kept as subnormals; an activation past fp16's 65504 would overflow (gpt-oss's
    normed rows and clamped SwiGLU outputs stay far below). The sm_90 SASS: 3.4-4.5 instructions a value against the
    fp32 form's 5.1-7.1 (examples/gemv_sass.py); gpt-oss-20b's experts at one token 36.7 -> 31.7 us a layer on an H200
    (examples/mxfp4_bench.py)."""
    even, odd = _e4m3_codes(v)
    t = _f16x2_dots0(even, x02, x46)
    t = _f16x2_dots(odd, x13, x57, t)
    lo, hi = _half_pair(t, True)
    return tl.sum(tl.reshape(lo + hi, (BLOCK_N, KB, 4)), axis=2) * (_e8m0_scale(e) * 0.00390625)  # 2 ** 6 / 2 ** 14


@triton.jit
def _block_sums(v, e, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """Code words v [BLOCK_N, 4 KB] times their activations (each [1, 4 KB]), summed a 32-value block (4 words, one
    thread's: no shuffle) and scaled by the block's e8m0 exponent e [BLOCK_N, KB]: [BLOCK_N, KB] fp32."""
    t = _mxfp4_word_dots(v, x0, x1, x2, x3, x4, x5, x6, x7)
    return tl.sum(tl.reshape(t, (BLOCK_N, KB, 4)), axis=2) * _e8m0_scale(e)


@triton.jit
def _mxfp4_dots(x_ptr, w_rows, s_rows, up_w, up_s, mask_n, K, GATED: tl.constexpr, A_BF16: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """`_dense_dots` of MXFP4 rows: w_rows [BLOCK_N] point at each row's codes as 32-bit words (8 a word, 4 words a
    32-value block; 16-byte aligned), s_rows at its e8m0 exponents (one a block), x_ptr at the activations as 32-bit
    pairs; GATED: the up rows `up_w` words and `up_s` exponents on. Rows by words [BLOCK_N, BLOCK_K / 8]: a block is
    one thread's 16-byte load, the activations a row-independent [words] (widened once for the rows a thread holds).
    Each chunk's next is asked for before this one's sums."""
    W: tl.constexpr = BLOCK_K // 8
    KB: tl.constexpr = BLOCK_K // 32
    rw = tl.arange(0, W)
    kb = tl.arange(0, KB)
    blocks = K // 32  # masks in whole blocks: constant over a block's 4 words, so a block is one load
    w_ptrs = w_rows[:, None] + rw[None, :]
    s_ptrs = s_rows[:, None] + kb[None, :]
    x_ptrs = x_ptr + rw * 4  # each word's first activation pair
    m = mask_n[:, None] & (rw // 4 < blocks)[None, :]
    ms = mask_n[:, None] & (kb < blocks)[None, :]
    v = tl.load(w_ptrs, mask=m, other=0, eviction_policy="evict_first")
    e = tl.load(s_ptrs, mask=ms, other=0)
    vu = v
    eu = e
    if GATED:
        vu = tl.load(w_ptrs + up_w, mask=m, other=0, eviction_policy="evict_first")
        eu = tl.load(s_ptrs + up_s, mask=ms, other=0)
    acc = tl.zeros((BLOCK_N, KB), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, KB), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kw = k0 // 8
        x_ok = (kw + rw) // 4 < blocks
        xp = x_ptrs + kw * 4
        x0, x1 = _x_pair(tl.load(xp, mask=x_ok, other=0), A_BF16, ASM)
        x2, x3 = _x_pair(tl.load(xp + 1, mask=x_ok, other=0), A_BF16, ASM)
        x4, x5 = _x_pair(tl.load(xp + 2, mask=x_ok, other=0), A_BF16, ASM)
        x6, x7 = _x_pair(tl.load(xp + 3, mask=x_ok, other=0), A_BF16, ASM)
        m = mask_n[:, None] & ((kw + W + rw) // 4 < blocks)[None, :]  # all false after the last chunk: nothing read
        ms = mask_n[:, None] & (k0 // 32 + KB + kb < blocks)[None, :]
        nv = tl.load(w_ptrs + kw + W, mask=m, other=0, eviction_policy="evict_first")
        ne = tl.load(s_ptrs + k0 // 32 + KB, mask=ms, other=0)
        if ASM:
            x02 = _f16_pack(x0, x2)[None, :]
            x46 = _f16_pack(x4, x6)[None, :]
            x13 = _f16_pack(x1, x3)[None, :]
            x57 = _f16_pack(x5, x7)[None, :]
            acc += _block_sums_f16(v, e, x02, x46, x13, x57, BLOCK_N, KB)
        else:
            x0, x1, x2, x3 = x0[None, :], x1[None, :], x2[None, :], x3[None, :]
            x4, x5, x6, x7 = x4[None, :], x5[None, :], x6[None, :], x7[None, :]
            acc += _block_sums(v, e, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, KB)
        v = nv
        e = ne
        if GATED:
            nv = tl.load(w_ptrs + up_w + kw + W, mask=m, other=0, eviction_policy="evict_first")
            ne = tl.load(s_ptrs + up_s + k0 // 32 + KB, mask=ms, other=0)
            if ASM:
                acc_up += _block_sums_f16(vu, eu, x02, x46, x13, x57, BLOCK_N, KB)
            else:
                acc_up += _block_sums(vu, eu, x0, x1, x2, x3, x4, x5, x6, x7, BLOCK_N, KB)
            vu = nv
            eu = ne
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _expert_gemv_kernel(a_ptr, w_ptr, s_ptr, b_ptr, c_ptr, rw_ptr, block_expert_ptr, logits_ptr, N, K, E, stride_a,
                        stride_we, stride_wn, stride_c, stride_se, stride_sn, stride_be, stride_l, limit, alpha,
                        A_DIV: tl.constexpr, GATED: tl.constexpr, ROUTE: tl.constexpr, HAS_SCALE: tl.constexpr,
                        MXFP4: tl.constexpr, A_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr,
                        RENORMALIZE: tl.constexpr, ASM: tl.constexpr, USE_PDL: tl.constexpr):
    """The GEMV form of `_expert_gemm_kernel`'s one-slot blocks (MoeConfig.block_m 1): program (slot, column tile)
    streams BLOCK_N rows of the slot's expert against its one activation row in fp32 multiply-adds, no MMA and no
    tile of 15 padding rows. MXFP4: a_ptr holds the activations as 32-bit pairs and w_ptr the codes as 32-bit words
    (strides in words); on CUDA each word's products are fp16 pairs (`_block_sums_f16`), under the interpreter fp32
    (`_block_sums`). ROUTE: gate/up
    picks its slots' experts (`_slot_expert`); else block_expert names them. The epilogue is `_finish`'s. ASM: inline
    PTX where it saves instructions (on CUDA; the interpreter runs the plain Triton)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = _slot_expert(logits_ptr, rw_ptr, block_expert_ptr, pid_m, pid_n, stride_l, E, A_DIV, ROUTE, K_P2, E_P2,
                          RENORMALIZE)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    x_ptr = a_ptr + (pid_m // A_DIV).to(tl.int64) * stride_a
    w_rows = w_ptr + expert * stride_we + rn.to(tl.int64) * stride_wn
    if MXFP4:  # each row starts 16-byte aligned (the host checks): a block's 4 words are one load
        w_rows = tl.multiple_of(w_rows, 16)
        s_rows = s_ptr + expert * stride_se + rn.to(tl.int64) * stride_sn
        acc, acc_up = _mxfp4_dots(x_ptr, w_rows, s_rows, N * stride_wn, N * stride_sn, mask_n, K, GATED, A_BF16,
                                  BLOCK_N, BLOCK_K, ASM)
    else:
        acc, acc_up = _dense_dots(x_ptr, w_rows, N * stride_wn, mask_n, K, GATED, BLOCK_N, BLOCK_K)
    slot = pid_m + tl.arange(0, 1)
    # (as_ptr: s_ptr in its place, unread with A_SCALE off; ROUTED: down scales by the slot's routing weight)
    _finish(acc[None, :], acc_up[None, :], slot, slot >= 0, rn, mask_n, expert, s_ptr, s_ptr, b_ptr, rw_ptr, c_ptr,
            N, stride_se, stride_be, stride_c, limit, alpha, A_DIV, GATED, not GATED, HAS_SCALE, False, HAS_BIAS,
            SWIGLU)


def is_mxfp4(w: torch.Tensor) -> bool:
    """Whether expert weights are MXFP4 bytes (their exponents ride in the scale's place)."""
    return w.dtype == torch.uint8


def align(ids: torch.Tensor, n_exp: int, block_m: int,
          pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted slot ids [rows], each block's expert [rows / block_m], padded total [1]) of expert ids [T, k]."""
    numel = ids.numel()
    rows = triton.cdiv(min(numel * block_m, numel + n_exp * (block_m - 1)), block_m) * block_m
    dev = ids.device
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=dev)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    e_p2 = triton.next_power_of_2(n_exp)
    chunk = 64 if numel <= 4096 else 256  # few programs at decode sizes, few count rows to sum at prefill sizes
    # _place_kernel's rank scans [chunk, E] in shared memory: at most 128 KB of it (256 experts: chunks of 128)
    chunk = min(chunk, max(16, 32768 // e_p2))
    n_chunks = triton.cdiv(numel, chunk)
    hist = torch.empty(n_chunks, e_p2, dtype=torch.int32, device=dev)  # unread when one chunk
    warps = 4 if chunk == 64 else 8
    if n_chunks > 1:
        _count_kernel[(n_chunks,)](ids, hist, numel, E_P2=e_p2, CHUNK=chunk, num_warps=warps, **pdl_kwargs(ids, pdl))
    _place_kernel[(n_chunks,)](ids, hist, sorted_ids, block_expert, total, numel, n_chunks, rows // block_m,
                               E_P2=e_p2, BLOCK_M=block_m, CHUNK=chunk, ONE_CHUNK=n_chunks == 1, BLOCKS=16,
                               num_warps=warps, **pdl_kwargs(ids, pdl))
    return sorted_ids, block_expert, total


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                  tiles: MoeTiles | None = None, pdl: bool = False, terms: bool = False,
                  swiglu: SwiGLUExperts | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t: [T, H] in x's dtype (`terms`: the
    [T, k, H] terms, unsummed).

    x [T, H]; gate_up [E, 2I, H] and down [E, H, I] in x's dtype, or e4m3 with fp32 scales [E, 2I] / [E, H], or
    MXFP4 (uint8: `is_mxfp4`) bytes [E, 2I, H / 2] / [E, H, I / 2] with e8m0 exponents [E, 2I, H / 32] / [E, H, I / 32];
    weights [T, k] fp32, ids [T, k]; `tiles` (default: `pick_tiles(T, fp8)`; FP8 weights and `tiles.fp8_act`:
    w8a8, x and the gate/up output quantized per row to e4m3 for the MMAs; MXFP4 always w4a16); `swiglu`: gpt-oss's
    experts; `block` (bn, bk): block-wise FP8 weights (DeepSeek-V3's), the scales fp32 [E, 2I / bn, H / bk] and
    [E, H / bn, I / bk], w8a8 quantizing the activations per token per bk columns as the dense block-FP8 linears do."""
    n_tok, k = ids.shape
    n_exp, two_i = gate_up.shape[:2]
    hidden = down.shape[1]
    mxfp4 = is_mxfp4(gate_up)
    tiles = tiles or pick_tiles(n_tok, gate_up_scale is not None, w8a8=False if mxfp4 else None, mxfp4=mxfp4)
    w8a8 = tiles.fp8_act and gate_up_scale is not None and not mxfp4
    numel = n_tok * k
    x = x.contiguous()
    out = torch.empty(numel, hidden, dtype=x.dtype, device=x.device)
    if numel == 0:
        return out.view(n_tok, k, hidden) if terms else out.view(n_tok, k, hidden).sum(dim=1)
    if tiles.gate_up.block_m == 1:  # the GEMV form: a slot a program, the choices as given (no alignment)
        slots = Slots(None, ids.to(torch.int32).contiguous().view(-1), None, weights.contiguous().view(-1), k)
    else:
        slots = Slots(*align(ids.contiguous(), n_exp, tiles.gate_up.block_m, pdl), weights.contiguous().view(-1), k)
    h = torch.empty(numel, two_i // 2, dtype=x.dtype, device=x.device)

    def codes(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """t as the GEMM takes it: w8a8's e4m3 codes with their scales (per row, or per row per group), else t."""
        if not w8a8:
            return t, None
        return quant_groups(t, block[1]) if block is not None else quant_rows(t, pdl=pdl)

    a = codes(x)
    expert_gemm(a[0], gate_up, gate_up_scale, h, slots, tiles.gate_up, gated=True, a_scale=a[1], pdl=pdl,
                swiglu=swiglu, block=block)
    a = codes(h)  # h rounded to x's dtype first, as the dense FP8 MLP does
    expert_gemm(a[0], down, down_scale, out, slots, tiles.down, gated=False, a_scale=a[1], pdl=pdl, swiglu=swiglu,
                block=block)
    return out.view(n_tok, k, hidden) if terms else out.view(n_tok, k, hidden).sum(dim=1)


def routed_experts(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                   renormalize: bool, gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None, pdl: bool = False, terms: bool = False,
                   swiglu: SwiGLUExperts | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """The MoE block after its gate's linear: up to SMALL_MAX_TOKENS tokens `one_slot_experts`, else `route` then
    `fused_experts`; [T, H], or with `terms` each token's k terms [T, k, H] for the caller to sum. Where the tiles
    take the GEMV form and the experts are ROUTE_APART_EXPERTS or more, `route` then the GEMV form on its choices.

    `pdl` reaches the 16-bit experts and the GEMV form only: under programmatic dependent launch the FP8 (w8a16)
    expert kernels' MMA tiles ran far slower (examples/moe_bench.py on an H100, one token, 4 layers: 52.8 against 33.0
    us a layer on one-slot blocks, 47.0 against 41.6 aligned; the 16-bit ones gain: 46.4 against 49.3 aligned). The
    GEMV form takes it for packed MXFP4 weights too; `examples/mxfp4_bench.py` on an H200 (2026-12-01, gpt-oss-20b,
    one token) put the packed layer at 51.0 / 50.9 us with / without it at the old tiles and 35.4 / 32.7 at the swept
    ones, but in the engine's step (other kernels between) it pays: gpt-oss-20b batch 1 544.9 tok/s with it, 525.2
    without (one H200 call, docs/benchmarks.md)."""
    few = pick_tiles(x.shape[0], gate_up_scale is not None, w8a8=False, mxfp4=is_mxfp4(gate_up))  # one_slot's
    gemv = few.gate_up.block_m == 1
    pdl = pdl and (gate_up_scale is None or gemv)
    if x.shape[0] <= SMALL_MAX_TOKENS and not (gemv and logits.shape[-1] >= ROUTE_APART_EXPERTS):
        return one_slot_experts(x, logits, gate_up, down, top_k, renormalize, gate_up_scale, down_scale, tiles=few,
                                pdl=pdl, terms=terms, swiglu=swiglu, block=block)
    weights, ids = route(logits, top_k, renormalize, pdl)
    return fused_experts(x, gate_up, down, weights, ids, gate_up_scale, down_scale, pdl=pdl, terms=terms,
                         swiglu=swiglu, block=block)


@dataclass
class Slots:
    """A layer's (token, choice) slots aligned to BLOCK_M (`align`), their routing weights, the choices a token.
    Unaligned (`sorted_ids` None): one slot a block, `block_expert` and `weights` written by the gate/up pass."""

    sorted_ids: torch.Tensor | None
    block_expert: torch.Tensor
    total: torch.Tensor | None
    weights: torch.Tensor  # [T k] fp32
    top_k: int


@dataclass
class SwiGLUExperts:
    """gpt-oss's experts: per-expert biases of both projections ([E, 2I] gate rows then up rows, [E, H]) and the
    clamped SwiGLU's `limit` and `alpha` (layers/moe.py's SwiGLU)."""

    gate_up_bias: torch.Tensor
    down_bias: torch.Tensor
    limit: float
    alpha: float


@dataclass
class Route:
    """The gate's logits [T, E] for a gate/up pass that routes its slots itself, and the model's renormalization."""

    logits: torch.Tensor
    renormalize: bool


def one_slot_experts(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int,
                     renormalize: bool, gate_up_scale: torch.Tensor | None = None,
                     down_scale: torch.Tensor | None = None, tiles: MoeTiles | None = None,
                     pdl: bool = False, terms: bool = False, swiglu: SwiGLUExperts | None = None,
                     block: tuple[int, int] | None = None) -> torch.Tensor:
    """`fused_experts` of a few tokens, routed inside the gate/up pass: one slot a block, no alignment, three launches
    (gate/up, down, the sum; `terms`: two, the [T, k, H] terms unsummed). FP8 experts run w8a16 (below
    W8A8_MIN_TOKENS)."""
    n_tok, hidden = x.shape
    numel = n_tok * top_k
    tiles = tiles or pick_tiles(n_tok, gate_up_scale is not None, w8a8=False, mxfp4=is_mxfp4(gate_up))  # w4a16
    out = torch.empty(numel, hidden, dtype=x.dtype, device=x.device)
    if numel == 0:
        return out.view(n_tok, top_k, hidden) if terms else out.view(n_tok, top_k, hidden).sum(dim=1)
    slots = Slots(None, torch.empty(numel, dtype=torch.int32, device=x.device), None,
                  torch.empty(numel, dtype=torch.float32, device=x.device), top_k)
    h = torch.empty(numel, gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    expert_gemm(x, gate_up, gate_up_scale, h, slots, tiles.gate_up, gated=True, pdl=pdl,
                route=Route(logits.contiguous(), renormalize), swiglu=swiglu, block=block)
    expert_gemm(h, down, down_scale, out, slots, tiles.down, gated=False, pdl=pdl, swiglu=swiglu, block=block)
    return out.view(n_tok, top_k, hidden) if terms else out.view(n_tok, top_k, hidden).sum(dim=1)


def expert_gemm(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, c: torch.Tensor, slots: Slots,
                cfg: MoeConfig, gated: bool, a_scale: torch.Tensor | None = None, pdl: bool = False,
                route: Route | None = None, swiglu: SwiGLUExperts | None = None,
                block: tuple[int, int] | None = None) -> None:
    """One of the two expert GEMMs into c [T k, N]: gated, gate/up from the tokens' rows a [T, H]; else down from
    the slots' rows a [T k, I], scaled by their routing weights. `a_scale` [rows, 1] fp32: a is e4m3 codes (w8a8).
    `swiglu`: gpt-oss's biases (this projection's) and activation. MXFP4 weights (uint8) take `scale` as their
    exponents; `block` (bn, bk): w block-wise FP8 with `scale` per block, `a_scale` (w8a8) per row per bk columns,
    each K step one group (BLOCK_K cut to bk where deeper)."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    mxfp4 = is_mxfp4(w)
    if mxfp4 and (a.shape[1] % 32 or cfg.block_k % 32):
        raise ValueError(f"MXFP4 experts need K ({a.shape[1]}) and BLOCK_K ({cfg.block_k}) multiples of 32")
    if cfg.block_m == 1:
        return _expert_gemv(a, w, scale, c, slots, cfg, gated, pdl, route, swiglu, a_scale is None and block is None)
    group_n, group_k = block or (1, 1)
    if block is not None:
        assert scale is not None and (not gated or n % group_n == 0), "gate and up rows each whole blocks"
        if group_k % cfg.block_k:  # each K step inside one group
            cfg = replace(cfg, block_k=group_k)
    grid = (slots.block_expert.numel(), triton.cdiv(n, cfg.block_n))
    one_slot = slots.sorted_ids is None
    assert not (one_slot and gated and route is None), "one-slot blocks: gate/up routes the slots"
    logits = route.logits if route is not None else slots.weights  # (unread without a route)
    n_exp = logits.shape[-1] if route is not None else 1
    sorted_ids = slots.sorted_ids if slots.sorted_ids is not None else slots.block_expert  # (unread: one slot)
    total = slots.total if slots.total is not None else slots.block_expert
    bias = None if swiglu is None else swiglu.gate_up_bias if gated else swiglu.down_bias
    _expert_gemm_kernel[grid](a, a_scale, w, scale, bias, c, slots.weights, sorted_ids, slots.block_expert, total,
                              logits, n, a.shape[1], c.shape[0], n_exp, a.stride(0),
                              a_scale.stride(0) if a_scale is not None else 0, w.stride(0), w.stride(1),
                              c.stride(0), scale.stride(0) if scale is not None else 0,
                              scale.stride(1) if scale is not None else 0, bias.stride(0) if bias is not None else 0,
                              logits.stride(0),
                              swiglu.limit if swiglu is not None else 0.0, swiglu.alpha if swiglu is not None else 0.0,
                              A_DIV=slots.top_k if gated else 1, GATED=gated, ROUTED=not gated,
                              HAS_SCALE=scale is not None and not mxfp4 and block is None, MXFP4=mxfp4,
                              A_SCALE=a_scale is not None, BLOCK_SCALE=block is not None, GROUP_N=group_n,
                              GROUP_K=group_k, HAS_BIAS=bias is not None,
                              SWIGLU=swiglu is not None, BLOCK_M=cfg.block_m,
                              BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ONE_SLOT=one_slot,
                              K_P2=triton.next_power_of_2(slots.top_k), E_P2=triton.next_power_of_2(n_exp),
                              RENORMALIZE=route is not None and route.renormalize, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages, **pdl_kwargs(a, pdl))


def _expert_gemv(a: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, c: torch.Tensor, slots: Slots,
                 cfg: MoeConfig, gated: bool, pdl: bool, route: Route | None, swiglu: SwiGLUExperts | None,
                 plain: bool) -> None:
    """`expert_gemm` in the GEMV form (`_expert_gemv_kernel`, cfg.block_m 1): a program a (slot, BLOCK_N columns),
    the slots unaligned. `plain`: neither w8a8 activations nor block-wise FP8 scales, which it does not take."""
    if slots.sorted_ids is not None or not plain:
        raise ValueError("the GEMV form (BLOCK_M 1) takes unaligned slots of 16-bit activations, and 16-bit, per-row "
                         "FP8 or MXFP4 weights")
    n = w.shape[1] // 2 if gated else w.shape[1]
    mxfp4 = is_mxfp4(w)
    k, a_bf16 = a.shape[1], a.dtype == torch.bfloat16
    if mxfp4:  # codes as 32-bit words, activations as 32-bit pairs (K is whole 32-value blocks)
        a, w = a.contiguous().view(torch.int32), w.view(torch.int32)
        if w.data_ptr() % 16 or w.stride(0) % 4 or w.stride(1) % 4:  # the kernel loads a block's 4 words at once
            raise ValueError("packed MXFP4 experts must start each row on a 16-byte boundary")
    logits = route.logits if route is not None else slots.weights  # (unread without a route)
    n_exp = logits.shape[-1] if route is not None else 1
    bias = None if swiglu is None else swiglu.gate_up_bias if gated else swiglu.down_bias
    grid = (slots.block_expert.numel(), triton.cdiv(n, cfg.block_n))
    _expert_gemv_kernel[grid](a, w, scale, bias, c, slots.weights, slots.block_expert, logits, n, k, n_exp,
                              a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                              scale.stride(0) if scale is not None else 0,
                              scale.stride(1) if scale is not None and scale.dim() > 1 else 0,
                              bias.stride(0) if bias is not None else 0, logits.stride(0),
                              swiglu.limit if swiglu is not None else 0.0, swiglu.alpha if swiglu is not None else 0.0,
                              A_DIV=slots.top_k if gated else 1, GATED=gated, ROUTE=route is not None,
                              HAS_SCALE=scale is not None and not mxfp4, MXFP4=mxfp4,
                              A_BF16=a_bf16, HAS_BIAS=bias is not None, SWIGLU=swiglu is not None,
                              BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, K_P2=triton.next_power_of_2(slots.top_k),
                              E_P2=triton.next_power_of_2(n_exp), RENORMALIZE=route is not None and route.renormalize,
                              ASM=a.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_kwargs(c, pdl))
