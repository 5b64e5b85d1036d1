"""Triton kernel for the gated delta rule's rows in order (attention/gated_delta.py): a decode step, a verify step and
its commit.

A speculative verify step gives each request of a linear-attention model (Qwen3-Next, Qwen3.5) a run of rows (its
last token and its drafts) that must step its state one row at a time, as decode would. The torch path does this a
round at a time (row j of every request at once), ~20 launches a round and a layer, and then again over the accepted
rows at the commit: on an H200 a Qwen3.5-9B verify step of 2 rows took 70.7 ms against a 7.9 ms decode step
(docs/benchmarks.md; with this kernel 63.2 ms: the rest is the forward's eager launches, not the rule). Here one
program a (request, value head, block of value columns) holds its block of the state S [K, BLOCK_V] in registers and
walks the request's rows:

    S <- exp(g_t) S;  w = beta_t (v_t - S^T k_t);  S <- S + k_t w^T;  o_t = S^T q_t

(q and k normalized and repeated over the value heads beforehand, all fp32, as `gated_delta.step` takes them); the
value columns are independent of one another, so the blocks need nothing from each other. `WRITE` stores the state
after the request's rows back in its slot (the commit; a decode step: one row a request, its output and its state);
without it the slots are only read (the verify step).
The sums over K run in another order than torch's einsum: fp32 rounding apart, the same numbers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_in_order_kernel(Q, K, V, G, BETA, SSM, SLOTS, STARTS, COUNTS, OUT,
                          stride_qt, stride_qh, stride_vt, stride_vh, stride_gt, stride_ot, stride_oh,
                          stride_ss, stride_sh,
                          DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, WRITE: tl.constexpr,
                          HAS_OUT: tl.constexpr, ONE_ROW: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    keys = tl.arange(0, DK)
    live = cols < DV
    slot = tl.load(SLOTS + b).to(tl.int64)
    if ONE_ROW:  # a decode step: request b's one row is row b
        start = b.to(tl.int64)
        count = 1
    else:
        start = tl.load(STARTS + b).to(tl.int64)
        count = tl.load(COUNTS + b).to(tl.int32)
    state = SSM + slot * stride_ss + h * stride_sh + keys[:, None] * DV + cols[None, :]
    s = tl.load(state, mask=live[None, :], other=0.0)
    for i in range(count):
        t = start + i
        q = tl.load(Q + t * stride_qt + h * stride_qh + keys)
        k = tl.load(K + t * stride_qt + h * stride_qh + keys)
        v = tl.load(V + t * stride_vt + h * stride_vh + cols, mask=live, other=0.0)
        g = tl.load(G + t * stride_gt + h)
        beta = tl.load(BETA + t * stride_gt + h)
        s = s * tl.exp(g)
        w = beta * (v - tl.sum(k[:, None] * s, axis=0))
        s = s + k[:, None] * w[None, :]
        if HAS_OUT:
            tl.store(OUT + t * stride_ot + h * stride_oh + cols, tl.sum(q[:, None] * s, axis=0), mask=live)
    if WRITE:
        tl.store(state, s, mask=live[None, :])


def rows_in_order(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  ssm: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor | None, counts: torch.Tensor | None,
                  out: torch.Tensor | None, write: bool) -> None:
    """Request b's rows starts[b] .. starts[b] + counts[b] - 1 of q, k [T, H, K], v [T, H, V], g, beta [T, H] (fp32)
    stepped in order from its state ssm[slots[b]] ([slots, H, K, V], fp32); each row's output into `out` [T, H, V]
    where given, and with `write` the state after its last row back in its slot. slots, starts, counts: [B] int64
    on the device (a count of 0 leaves the request's slot as it was); starts and counts None: row b alone (a decode
    step, no index tensors to make in its graph)."""
    n_req, heads, dk, dv = slots.shape[0], v.shape[1], k.shape[-1], v.shape[-1]
    assert q.dtype == k.dtype == v.dtype == g.dtype == beta.dtype == ssm.dtype == torch.float32
    assert dk & (dk - 1) == 0 and q.stride() == k.stride() and q.stride(2) == v.stride(2) == 1
    assert g.stride() == beta.stride() and g.stride(1) == 1 and ssm.is_contiguous()
    if n_req == 0:
        return
    block_v = min(32, triton.next_power_of_2(dv))
    o = out if out is not None else v  # never written without HAS_OUT
    one_row = starts is None
    _rows_in_order_kernel[(n_req, heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, ssm, slots, slots if one_row else starts, slots if one_row else counts, o,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0), o.stride(0), o.stride(1),
        ssm.stride(0), ssm.stride(1),
        DK=dk, DV=dv, BLOCK_V=block_v, WRITE=write, HAS_OUT=out is not None, ONE_ROW=one_row, num_warps=4,
    )
