"""The CUDA sampler's cut and draw: one Triton program per row, exact, no sort of the vocabulary, no host sync.

A row's kept set (top-k, top-p over the full distribution, min-p) is {s >= tau} for one threshold tau of the
temperature-scaled logits s. Rather than find tau (a sort), the kernel draws by rejection, flashinfer's sorting-free
scheme: draw j from the weights exp(s - max) over a support that still holds the kept set (the inverse CDF in
token-id order, as the torch path); j is kept when fewer than k tokens lie above it and their mass is at most
top_p; else every token at or below s_j is out too, so the support shrinks to {s > s_j} and the next round draws
again with the next uniform of the row's stream. An accepted draw is distributed exactly as the kept
distribution; the most likely token is always accepted, so the loop ends. Round 0's uniform is the torch path's
(engine/sampler.uniform), later rounds hash the round number in. Passes over the row: 2 + 2 per round (1 for a
row without a top-k or top-p cut).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl_cli.engine.sampling_state import Need, RowParams, SamplingBatch

BLOCK = 2048


@triton.jit
def _mix32(x):
    """Wellons' lowbias32 on uint32 (the torch path's _mix32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


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
        top_p = tl.load(top_p_ptr + row * fstride)
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
        total = tl.sum(vtot, axis=0)
        support = tl.sum(vsup, axis=0)
        h0 = _mix32(_mix32(_mix32(tl.load(seed_lo_ptr + row * istride).to(tl.uint32) ^ 0x9E3779B9)
                           ^ tl.load(seed_hi_ptr + row * istride).to(tl.uint32))
                    ^ tl.load(pos_ptr + row).to(tl.uint32))
        cut_bound = tl.where((k < V) | (top_p < 1.0), V, 0)  # rows without a top-k / top-p cut accept at once
        low = m - float("inf")  # the support is {s >= floor, s > low}
        rnd = k * 0
        go = k >= 0
        while go:
            h = tl.where(rnd == 0, h0, _mix32(h0 ^ rnd.to(tl.uint32)))
            target = (h >> 8).to(tl.float32) * (1.0 / 16777216.0) * support
            # Pass 3: the inverse CDF over the support, in token-id order.
            cum = total * 0.0
            found = V
            last = arg * 0 - 1
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
            # Pass 4: kept when fewer than k tokens lie above it and their mass is at most top_p.
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
    tl.store(out_ptr + row, pick.to(tl.int64))


def triton_draw(logits: torch.Tensor, p: RowParams, batch: SamplingBatch) -> torch.Tensor:
    """[B] token ids: sampled rows drawn from their cut distribution, greedy rows their argmax (any float dtype)."""
    b, v = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    fstride, istride = p.temperature.stride(0), p.top_k.stride(0)
    # The float / int columns are views of one gathered matrix each: a stride per kind covers them all.
    assert p.top_p.stride(0) == p.min_p.stride(0) == fstride and p.seed_lo.stride(0) == p.seed_hi.stride(0) == istride
    _draw_kernel[(b,)](
        logits, logits.stride(0), v, p.temperature, p.top_p, p.min_p, fstride, p.top_k, p.seed_lo, p.seed_hi,
        istride, p.greedy.contiguous().view(torch.int8), batch.positions.contiguous(), out, BLOCK=BLOCK,
        num_warps=8,
    )
    return out


def warm(vocab: int, device: torch.device) -> None:
    """Compile the kernel for the logits it will see (the CUDA graph's bf16 / fp16 buffer, fp32 after penalties)
    now, at engine start, rather than on the first sampled request."""
    f = torch.tensor([[0.7, 0.9, 0.01, 0.0, 0.0, 1.0]], device=device)
    i = torch.tensor([[5, 1, 2, 0]], dtype=torch.int64, device=device)
    p = RowParams(f[:, 0], f[:, 1], f[:, 2], f[:, 3], f[:, 4], f[:, 5], i[:, 0], i[:, 1], i[:, 2], i[:, 3].bool())
    batch = SamplingBatch(i[:, 3], torch.zeros(1, dtype=torch.int32, device=device), Need.SAMPLED, 0, [], None, 0,
                          None)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        triton_draw(torch.randn(1, vocab, device=device).to(dtype), p, batch)
