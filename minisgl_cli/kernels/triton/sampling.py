"""The CUDA sampler's cut and draw: exact, no sort of the vocabulary, no host sync, a row on one program or many.

A row's kept set (top-k, top-p over the full distribution, min-p) is {s >= tau} for one threshold tau of the
temperature-scaled logits s. Rather than find tau (a sort), the kernel draws by rejection, flashinfer's sorting-free
scheme: draw j from the weights exp(s - max) over a support that still holds the kept set (the inverse CDF in
token-id order, as the torch path); j is kept when fewer than k tokens lie above it and their mass is at most
top_p; else every token at or below s_j is out too, so the support shrinks to {s > s_j} and the next round draws
again with the next uniform of the row's stream. An accepted draw is distributed exactly as the kept
distribution; the most likely token is always accepted, so the loop ends. Round 0's uniform is the torch path's
(sampling/sampler.uniform), later rounds hash the round number in. Passes over the row: 2 + 2 per round (1 for a
row without a top-k or top-p cut).

Two paths run this scheme. One program per row (`_draw_kernel`) fills the GPU only at a large batch: at batch 1 one
SM would make all the passes over 151,936 logits. The split path (up to SPLIT_MAX_ROWS rows) gives each row
cdiv(V, SPLIT) programs, one block each, and a launch per pass: each program stores its block's partials (max,
argmax, masses; counts and mass above the pick), and the row's last program to arrive (an atomic counter per row)
combines them, picks the block holding the draw's target from the blocks' masses and scans that block alone. A
launch's first pass (max and masses at once, each block relative to its own max; min-p rows need the row's max
first: one more launch) draws round 0; each of SPLIT_ROUNDS test launches accepts the pick or draws the next
round's; a row still rejected after them finishes in one program (rare: a round rejects at most the mass outside
the kept set). Both paths draw the same tokens, up to fp32 summation order.

A plain greedy row inside a decode graph takes `argmax_rows`: the split path's first pass alone, each block's max and
its first index, the row's last program picking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
SPLIT = 2048  # the split path's tokens per program
SPLIT_MAX_ROWS = 256  # the split path up to this many rows (the largest batch bench_sampling.py measures)
SPLIT_ROUNDS = 3  # rejection rounds the split path tests in parallel; a row rejected more finishes in one program


@triton.jit
def _mix32(x):
    """Wellons' lowbias32 on uint32 (the torch path's _mix32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _hash0(seed_lo_ptr, seed_hi_ptr, istride, pos_ptr, row):
    """The row's round-0 hash of (seed, position): sampling/sampler.uniform's."""
    return _mix32(_mix32(_mix32(tl.load(seed_lo_ptr + row * istride).to(tl.uint32) ^ 0x9E3779B9)
                         ^ tl.load(seed_hi_ptr + row * istride).to(tl.uint32))
                  ^ tl.load(pos_ptr + row).to(tl.uint32))


@triton.jit
def _uniform(h0, rnd):
    """Round `rnd`'s uniform in [0, 1) (24 bits): round 0 is h0's, later rounds hash the round in."""
    h = tl.where(rnd == 0, h0, _mix32(h0 ^ rnd.to(tl.uint32)))
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _reject(base, V, inv_t, m, floor, total, top_p, k, h0, low, support, rnd, cut_bound, BLOCK: tl.constexpr):
    """The rejection rounds of one row by one program, from round `rnd` over the support {s >= floor, s > low} of
    mass `support` (weights exp(s - m)): the accepted token."""
    offs = tl.arange(0, BLOCK)
    pick = k * 0
    go = k >= 0
    while go:
        target = _uniform(h0, rnd) * support
        # The inverse CDF over the support, in token-id order.
        cum = total * 0.0
        found = V
        last = k * 0 - 1
        for off in range(0, V, BLOCK):
            idx = off + offs
            s = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
            w = tl.where((s >= floor) & (s > low), tl.exp(s - m), 0.0)
            c = cum + tl.cumsum(w, axis=0)
            found = tl.minimum(found, tl.min(tl.where((c > target) & (w > 0), idx, V), axis=0))
            last = tl.maximum(last, tl.max(tl.where(w > 0, idx, -1), axis=0))
            cum += tl.sum(w, axis=0)
        # The target may round past the summed weights: the last token of the support then.
        pick = tl.where(found < V, found, last)
        sp = tl.load(base + pick).to(tl.float32) * inv_t
        # Kept when fewer than k tokens lie above it and their mass is at most top_p.
        above_n = k * 0
        above = total * 0.0
        for off in range(0, cut_bound, BLOCK):
            idx = off + offs
            s = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
            gt = s > sp
            above_n += tl.sum(gt.to(tl.int32), axis=0)
            above += tl.sum(tl.where(gt, tl.exp(s - m), 0.0), axis=0)
        go = (above_n >= k) | (above > top_p * total)
        low = sp
        support = above
        rnd += 1
    return pick


@triton.jit
def _draw_kernel(logits_ptr, stride, V, temp_ptr, top_p_ptr, min_p_ptr, fstride, top_k_ptr, seed_lo_ptr,
                 seed_hi_ptr, istride, greedy_ptr, pos_ptr, out_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    offs = tl.arange(0, BLOCK)
    # Pass 1: the largest logit and its first index (the greedy token, and the scale of the weights).
    vmax = tl.full([BLOCK], float("-inf"), tl.float32)
    vidx = tl.zeros([BLOCK], tl.int32)
    for off in range(0, V, BLOCK):
        idx = off + offs
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        upd = x > vmax
        vmax = tl.where(upd, x, vmax)
        vidx = tl.where(upd, idx, vidx)
    top = tl.max(vmax, axis=0)
    arg = tl.min(tl.where(vmax == top, vidx, V), axis=0)
    pick = arg
    if tl.load(greedy_ptr + row) == 0:
        inv_t = 1.0 / tl.load(temp_ptr + row * fstride)
        m = top * inv_t
        floor = m + tl.log(tl.load(min_p_ptr + row * fstride))  # min-p: s >= floor (log 0 = -inf: no cut)
        k = tl.load(top_k_ptr + row * istride).to(tl.int32)
        # Pass 2: the mass of the whole distribution (top-p's reference) and of the min-p support.
        vtot = tl.zeros([BLOCK], tl.float32)
        vsup = tl.zeros([BLOCK], tl.float32)
        for off in range(0, V, BLOCK):
            idx = off + offs
            s = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
            w = tl.exp(s - m)
            vtot += w
            vsup += tl.where(s >= floor, w, 0.0)
        top_p = tl.load(top_p_ptr + row * fstride)
        cut_bound = tl.where((k < V) | (top_p < 1.0), V, 0)  # rows without a top-k / top-p cut accept at once
        pick = _reject(base, V, inv_t, m, floor, tl.sum(vtot, axis=0), top_p, k,
                       _hash0(seed_lo_ptr, seed_hi_ptr, istride, pos_ptr, row), m - float("inf"),
                       tl.sum(vsup, axis=0), k * 0, cut_bound, BLOCK)
    tl.store(out_ptr + row, pick.to(tl.int64))


# --- the split path: a row's passes spread over cdiv(V, SPLIT) programs ----------------------------------------
# Between the launches: per block [B, NB, 3] fp32 (its max, its mass, its support mass) and [B, NB] int32 (its
# argmax, or its count above the pick); per row [B, 4] fp32 (m, the largest scaled logit; the total mass; the pick's
# scaled logit) and [B, 4] int32 (the pick, also in out; done); a counter per row for the last arrival.


@triton.jit
def _last_arrival(cnt_ptr, row, NB):
    """Whether this program is the last of its row's NB to get here (then it resets the row's counter). The caller
    stored its partials before: the barrier and the counter's acquire-release make them visible to the last one."""
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr + row, 1) == NB - 1
    if last:
        tl.store(cnt_ptr + row, 0)
    return last


@triton.jit
def _block_draw(base, V, inv_t, m, floor, low, mass, target, SPLIT: tl.constexpr, NBP: tl.constexpr):
    """The inverse CDF over the support {s >= floor, s > low} from its per-block masses ([NBP], 0 past the last
    block): the block holding the target, then that block's scan (the last token of the support in that block where
    the target rounds past it)."""
    bs = tl.arange(0, NBP)
    ends = tl.cumsum(mass, axis=0)
    hit = (ends > target) & (mass > 0)
    b = tl.min(tl.where(hit, bs, NBP), axis=0)
    none = b == NBP  # the target rounds past the summed masses: the support's last token
    b = tl.where(none, tl.maximum(tl.max(tl.where(mass > 0, bs, -1), axis=0), 0), b)  # (0: an empty support)
    cum = tl.sum(tl.where(bs < b, mass, 0.0), axis=0)
    target = tl.where(none, float("inf"), target)
    idx = b * SPLIT + tl.arange(0, SPLIT)
    s = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
    w = tl.where((s >= floor) & (s > low), tl.exp(s - m), 0.0)
    c = cum + tl.cumsum(w, axis=0)
    found = tl.min(tl.where((c > target) & (w > 0), idx, V), axis=0)
    last = tl.max(tl.where(w > 0, idx, -1), axis=0)
    return tl.where(found < V, found, last)


@triton.jit
def _first_of(x, top, idx, V):
    """The first of x's lanes `idx` that holds `top` (V where none does): a block's argmax from its max, or the row's
    from its blocks' maxima and their first indices (blocks in index order)."""
    return tl.min(tl.where(x == top, idx, V), axis=0)


@triton.jit
def _split_max_kernel(logits_ptr, stride, V, part_f, part_i, SPLIT: tl.constexpr):
    """Each block's largest logit (unscaled) and its first index: the min-p rows' floor needs the row's max before
    the masses."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    nb = tl.num_programs(1)
    idx = blk * SPLIT + tl.arange(0, SPLIT)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    pf = part_f + (row * nb + blk) * 3
    tl.store(pf, top)
    tl.store(part_i + row * nb + blk, _first_of(x, top, idx, V))


@triton.jit
def _split_first_kernel(logits_ptr, stride, V, temp_ptr, top_p_ptr, min_p_ptr, fstride, top_k_ptr, seed_lo_ptr,
                        seed_hi_ptr, istride, greedy_ptr, pos_ptr, out_ptr, part_f, part_i, state_f, state_i,
                        cnt_ptr, SPLIT: tl.constexpr, NBP: tl.constexpr, HAS_MAX: tl.constexpr):
    """Each block's max, argmax, mass (relative to its own max) and min-p support mass; the row's last block to
    finish combines them and draws round 0 (the greedy token for a greedy row)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    nb = tl.num_programs(1)
    base = logits_ptr + row.to(tl.int64) * stride
    bs = tl.arange(0, NBP)
    pf = part_f + row * nb * 3
    pi = part_i + row * nb
    idx = blk * SPLIT + tl.arange(0, SPLIT)
    x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    inv_t = 1.0 / tl.load(temp_ptr + row * fstride)
    log_min_p = tl.log(tl.load(min_p_ptr + row * fstride))
    if HAS_MAX:  # the max pass ran: the row's max, so the min-p floor, is known
        top = tl.max(tl.load(pf + bs * 3, mask=bs < nb, other=float("-inf")), axis=0)
    else:
        top = tl.max(x, axis=0)
        tl.store(pf + blk * 3, top)
        tl.store(pi + blk, _first_of(x, top, idx, V))
    if HAS_MAX:
        floor = top * inv_t + log_min_p  # min-p: s >= floor (log 0 = -inf: no cut)
    else:
        floor = top * 0.0 - float("inf")  # no row of the batch has a min-p
    mb = tl.max(x, axis=0) * inv_t
    mb = tl.where(mb == float("-inf"), 0.0, mb)  # an all -inf block: zero mass, not NaN
    s = x * inv_t
    w = tl.exp(s - mb)
    tl.store(pf + blk * 3 + 1, tl.sum(w, axis=0))
    tl.store(pf + blk * 3 + 2, tl.sum(tl.where(s >= floor, w, 0.0), axis=0))
    if _last_arrival(cnt_ptr, row, nb):
        bmax = tl.load(pf + bs * 3, mask=bs < nb, other=float("-inf"), cache_modifier=".cg")
        top = tl.max(bmax, axis=0)
        arg = _first_of(bmax, top, tl.load(pi + bs, mask=bs < nb, other=V, cache_modifier=".cg"), V)
        pick = arg
        done = arg * 0 + 1
        if tl.load(greedy_ptr + row) == 0:
            m = top * inv_t
            # Each block's masses relative to the row's max: exp(mb - m) of its own.
            bm = tl.where(bmax == float("-inf"), 0.0, bmax * inv_t)
            scale = tl.where(bs < nb, tl.exp(bm - m), 0.0)
            tot = tl.load(pf + bs * 3 + 1, mask=bs < nb, other=0.0, cache_modifier=".cg") * scale
            sup = tl.load(pf + bs * 3 + 2, mask=bs < nb, other=0.0, cache_modifier=".cg") * scale
            total = tl.sum(tot, axis=0)
            support = tl.sum(sup, axis=0)
            target = _uniform(_hash0(seed_lo_ptr, seed_hi_ptr, istride, pos_ptr, row), pick * 0) * support
            pick = _block_draw(base, V, inv_t, m, floor, m - float("inf"), sup, target, SPLIT, NBP)
            k = tl.load(top_k_ptr + row * istride)
            done = ((k >= V) & (tl.load(top_p_ptr + row * fstride) >= 1.0)).to(tl.int32)  # no cut: accepted
            tl.store(state_f + row * 4 + 0, m)
            tl.store(state_f + row * 4 + 1, total)
            tl.store(state_f + row * 4 + 2, tl.load(base + pick).to(tl.float32) * inv_t)
        tl.store(state_i + row * 4 + 0, pick)
        tl.store(state_i + row * 4 + 1, done)
        tl.store(out_ptr + row, pick.to(tl.int64))


@triton.jit
def _split_test_kernel(logits_ptr, stride, V, temp_ptr, top_p_ptr, min_p_ptr, fstride, top_k_ptr, seed_lo_ptr,
                       seed_hi_ptr, istride, pos_ptr, out_ptr, part_f, part_i, state_f, state_i, cnt_ptr,
                       RND: tl.constexpr, SPLIT: tl.constexpr, NBP: tl.constexpr, LAST: tl.constexpr):
    """Round RND's acceptance test of the row's pick: each block counts the tokens above it and their mass; the
    last block to finish accepts the pick or draws the next round's from the blocks' masses above it (the next
    support). The last of these launches finishes a row still rejected by one program's rounds."""
    row = tl.program_id(0)
    if tl.load(state_i + row * 4 + 1) == 0:  # a row whose pick an earlier round accepted skips the launch
        _split_test(logits_ptr, stride, V, temp_ptr, top_p_ptr, min_p_ptr, fstride, top_k_ptr, seed_lo_ptr,
                    seed_hi_ptr, istride, pos_ptr, out_ptr, part_f, part_i, state_f, state_i, cnt_ptr, row, RND,
                    SPLIT, NBP, LAST)


@triton.jit
def _split_test(logits_ptr, stride, V, temp_ptr, top_p_ptr, min_p_ptr, fstride, top_k_ptr, seed_lo_ptr,
                seed_hi_ptr, istride, pos_ptr, out_ptr, part_f, part_i, state_f, state_i, cnt_ptr, row,
                RND: tl.constexpr, SPLIT: tl.constexpr, NBP: tl.constexpr, LAST: tl.constexpr):
    blk = tl.program_id(1)
    nb = tl.num_programs(1)
    base = logits_ptr + row.to(tl.int64) * stride
    pf = part_f + row * nb * 3
    pi = part_i + row * nb
    inv_t = 1.0 / tl.load(temp_ptr + row * fstride)
    m = tl.load(state_f + row * 4 + 0)
    sp = tl.load(state_f + row * 4 + 2)
    idx = blk * SPLIT + tl.arange(0, SPLIT)
    s = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * inv_t
    gt = s > sp
    tl.store(pi + blk, tl.sum(gt.to(tl.int32), axis=0))
    tl.store(pf + blk * 3 + 2, tl.sum(tl.where(gt, tl.exp(s - m), 0.0), axis=0))
    if _last_arrival(cnt_ptr, row, nb):
        bs = tl.arange(0, NBP)
        above_n = tl.sum(tl.load(pi + bs, mask=bs < nb, other=0, cache_modifier=".cg"), axis=0)
        mass = tl.load(pf + bs * 3 + 2, mask=bs < nb, other=0.0, cache_modifier=".cg")
        above = tl.sum(mass, axis=0)
        total = tl.load(state_f + row * 4 + 1)
        top_p = tl.load(top_p_ptr + row * fstride)
        k = tl.load(top_k_ptr + row * istride).to(tl.int32)
        if (above_n >= k) | (above > top_p * total):
            h0 = _hash0(seed_lo_ptr, seed_hi_ptr, istride, pos_ptr, row)
            floor = m + tl.log(tl.load(min_p_ptr + row * fstride))
            nxt = k * 0 + (RND + 1)
            if LAST:  # rare: one program's rounds from here
                pick = _reject(base, V, inv_t, m, floor, total, top_p, k, h0, sp, above, nxt, V, SPLIT)
            else:
                pick = _block_draw(base, V, inv_t, m, floor, sp, mass, _uniform(h0, nxt) * above, SPLIT, NBP)
                tl.store(state_f + row * 4 + 2, tl.load(base + pick).to(tl.float32) * inv_t)
                tl.store(state_i + row * 4 + 0, pick)
            tl.store(out_ptr + row, pick.to(tl.int64))
        else:
            tl.store(state_i + row * 4 + 1, 1)


@triton.jit
def _argmax_kernel(logits_ptr, stride, V, part_f, part_i, out_ptr, cnt_ptr, SPLIT: tl.constexpr, NBP: tl.constexpr):
    """Each block's largest logit and its first index; the row's last block to finish takes the first of the largest
    (torch.argmax's choice; a NaN counts as the largest, as there, tied with +inf)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    nb = tl.num_programs(1)
    idx = blk * SPLIT + tl.arange(0, SPLIT)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    top = tl.max(x, axis=0)
    tl.store(part_f + row * nb + blk, top)
    tl.store(part_i + row * nb + blk, _first_of(x, top, idx, V))
    if _last_arrival(cnt_ptr, row, nb):
        bs = tl.arange(0, NBP)
        bmax = tl.load(part_f + row * nb + bs, mask=bs < nb, other=float("-inf"), cache_modifier=".cg")
        first = tl.load(part_i + row * nb + bs, mask=bs < nb, other=V, cache_modifier=".cg")
        tl.store(out_ptr + row, _first_of(bmax, tl.max(bmax, axis=0), first, V).to(tl.int64))


def argmax_rows(logits: torch.Tensor, out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """out[b] = torch.argmax(logits[b]) (int64) for logits [B, V] in one launch of cdiv(V, SPLIT) programs a row, not
    torch's reduction (one block for a row of a 128k vocabulary: 28.5 µs on an H200). `counts`: >= B int32 zeros the
    caller keeps (left zero; a CUDA graph replays with the same buffer)."""
    b, v = logits.shape
    assert logits.stride(1) == 1 and counts.numel() >= b and out.dtype == torch.int64
    nb = triton.cdiv(v, SPLIT)
    part_f = torch.empty((b, nb), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((b, nb), dtype=torch.int32, device=logits.device)
    if b:
        _argmax_kernel[(b, nb)](logits, logits.stride(0), v, part_f, part_i, out, counts, SPLIT=SPLIT,
                                NBP=triton.next_power_of_2(nb), num_warps=4)
    return out


def _counters(device: torch.device, rows: int) -> torch.Tensor:
    """The split path's per-row arrival counters: zero between launches (each launch's last program resets its row's),
    so one buffer per device serves every call on its stream."""
    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < rows:
        cnt = _COUNTERS[device] = torch.zeros(max(rows, SPLIT_MAX_ROWS), dtype=torch.int32, device=device)
    return cnt


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def draw(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
         top_k: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor, greedy: torch.Tensor,
         positions: torch.Tensor, cut: bool, min_p_pass: bool, split: bool | None = None) -> torch.Tensor:
    """[B] token ids: sampled rows drawn from their cut distribution, greedy rows their argmax (any float dtype).

    Each row's parameters are [B] tensors (float32 temperature / top_p / min_p, int64 top_k and 32-bit seed halves, bool
    greedy); `positions` the drawn tokens' positions (the uniforms' counter). `cut`: some row has a top-k or top-p
    cut (else every row accepts its first pick); `min_p_pass`: some row has min-p (the split path's max pass).
    `split`: each row's passes over cdiv(V, SPLIT) programs (default: when the batch has at most SPLIT_MAX_ROWS rows,
    where one program per row would leave most of the GPU idle); both draw the same tokens up to summation order."""
    b, v = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    fstride, istride = temperature.stride(0), top_k.stride(0)
    # The float / int columns are views of one gathered matrix each: a stride per kind covers them all.
    assert top_p.stride(0) == min_p.stride(0) == fstride and seed_lo.stride(0) == seed_hi.stride(0) == istride
    rows = (logits, logits.stride(0), v, temperature, top_p, min_p, fstride, top_k, seed_lo, seed_hi, istride)
    greedy, positions = greedy.contiguous().view(torch.int8), positions.contiguous()
    if not (b <= SPLIT_MAX_ROWS if split is None else split):
        _draw_kernel[(b,)](*rows, greedy, positions, out, BLOCK=BLOCK, num_warps=8)
        return out
    nb = triton.cdiv(v, SPLIT)
    nbp = triton.next_power_of_2(nb)
    part_f = torch.empty((b, nb, 3), dtype=torch.float32, device=logits.device)
    part_i = torch.empty((b, nb), dtype=torch.int32, device=logits.device)
    state_f = torch.empty((b, 4), dtype=torch.float32, device=logits.device)
    state_i = torch.empty((b, 4), dtype=torch.int32, device=logits.device)
    cnt = _counters(logits.device, b)
    if min_p_pass:
        _split_max_kernel[(b, nb)](logits, logits.stride(0), v, part_f, part_i, SPLIT=SPLIT, num_warps=4)
    _split_first_kernel[(b, nb)](*rows, greedy, positions, out, part_f, part_i, state_f, state_i, cnt, SPLIT=SPLIT,
                                 NBP=nbp, HAS_MAX=min_p_pass, num_warps=4)
    if cut:
        for r in range(SPLIT_ROUNDS):
            _split_test_kernel[(b, nb)](*rows, positions, out, part_f, part_i, state_f, state_i, cnt, RND=r,
                                        SPLIT=SPLIT, NBP=nbp, LAST=r == SPLIT_ROUNDS - 1, num_warps=4)
    return out


def warm(vocab: int, device: torch.device) -> None:
    """Compile the kernels for the logits it will see (the CUDA graph's bf16 / fp16 buffer, fp32 after penalties)
    now, at engine start, rather than on the first sampled request."""
    f = torch.tensor([[0.7, 0.9, 0.01]], device=device)
    i = torch.tensor([[5, 1, 2, 0]], dtype=torch.int64, device=device)
    positions = torch.zeros(1, dtype=torch.int32, device=device)
    for min_p_pass in (False, True):  # the split path's variants: with and without the min-p max pass
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for split in (False, True):
                draw(torch.randn(1, vocab, device=device).to(dtype), f[:, 0], f[:, 1], f[:, 2], i[:, 0], i[:, 1],
                     i[:, 2], i[:, 3].bool(), positions, True, min_p_pass, split)
