"""The gated delta rule (Gated DeltaNet's linear attention) over state slots: chunked for prefill, one step for decode.

Per value head, with q and k L2-normalized (q also scaled by k_dim^-1/2), a state S (k_dim x v_dim) carried from
token to token:  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
A prefill runs it a chunk of C tokens at a time: within a chunk the updates are one unit-lower-triangular solve
(the WY form) and a few matmuls, between chunks the state is carried (see `chunked`). Decode is the one-step update
batched over requests (`step`). Each request's state lives in its slot of the pool (kvcache/state.py): a prefill
chunk starts from it and writes it back, so a long prompt cut into chunks by the scheduler carries it across them.
A speculative verify step runs each request's rows in order without writing the state (`verify`); once the scheduler
knows how many were accepted, `commit` advances the state over those only, so rejected drafts never enter it.

Which path runs where: the torch code of this module everywhere by default (and verify steps always); on CUDA with
MINISGL_FLA=1, where flash-linear-attention (`fla-core`, Triton) imports, its `chunk_gated_delta_rule` and
`fused_recurrent_gated_delta_rule` (opt-in: see `fla_ops`). Both normalize q and k in fp32 and keep the states in fp32.
"""

from __future__ import annotations

import functools
import itertools
from types import ModuleType

import torch
import torch.nn.functional as F

from minisgl_cli.env import use_fla

CHUNK = 64  # tokens per chunk of the torch prefill


@functools.cache
def _fla() -> ModuleType | None:
    try:
        from fla.ops import gated_delta_rule
    except Exception:  # not installed, or built for another torch / Triton
        return None
    return gated_delta_rule


def fla_ops(x: torch.Tensor) -> ModuleType | None:
    """fla's gated delta rule ops for a CUDA tensor `x` where MINISGL_FLA=1 asks for them and fla imports, else None
    (the torch path). Opt-in: on an H200 (fla-core 0.6.0, Triton 3.6) its fused_recurrent kernel hit an illegal
    memory access in a decode step of 256 rows, and its fp32 kernels did not finish compiling in a minute."""
    return _fla() if x.is_cuda and use_fla() else None


def _normalized(q: torch.Tensor, k: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in fp32, L2-normalized over k_dim (eps inside the root, as fla does), q scaled by k_dim^-1/2, each
    query / key head repeated over the `groups` value heads it serves."""
    q, k = q.float(), k.float()
    q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q, k


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [T, H, K] (normalized), v [T, H, V], g (log decay, <= 0) and beta [T, H], all fp32; state
    [H, K, V] before the first token. Returns (o [T, H, V], the state after the last token).

    Within a chunk, with G_i = g_1 + .. + g_i and D_ij = exp(G_i - G_j) (j <= i): the values each token writes,
    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} D_ij (k_i . k_j) u_j), solve (I + A) U = beta V - beta exp(G) K S0
    with A_ij = beta_i D_ij (k_i . k_j) strictly below the diagonal; then O = exp(G) Q S0 + (D * Q K^T) U and the
    state after the chunk is exp(G_C) S0 + (exp(G_C - G) K)^T U."""
    out = torch.empty_like(v)
    for s in range(0, q.shape[0], chunk):
        qc, kc, vc = (x[s : s + chunk].transpose(0, 1) for x in (q, k, v))  # [H, C, *]
        gc, bc = g[s : s + chunk].t(), beta[s : s + chunk].t()  # [H, C]
        n = qc.shape[1]
        cum = gc.cumsum(-1)
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # D, zero above
        a = (kc @ kc.transpose(-1, -2)) * decay * bc[:, :, None]
        lower = a.tril(-1)  # the solve reads the strict lower triangle only (unit diagonal)
        u = torch.linalg.solve_triangular(lower, bc[:, :, None] * vc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(lower, (bc * cum.exp())[:, :, None] * kc, upper=False, unitriangular=True)
        u = u - w @ state
        o = (cum.exp()[:, :, None] * qc) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ u
        last = cum[:, -1:]
        state = last.exp()[:, :, None] * state + ((last - cum).exp()[:, :, None] * kc).transpose(-1, -2) @ u
        out[s : s + chunk] = o.transpose(0, 1)
    return out, state


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences: q, k [B, H, K] (normalized), v [B, H, V], g and beta [B, H] (fp32); state
    [B, H, K, V]. Returns (o [B, H, V], the states after it)."""
    state = state * g.exp()[:, :, None, None]
    written = beta[:, :, None] * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k[:, :, :, None] * written[:, :, None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def _for_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k repeated over their value heads' groups, and all three contiguous: fla's kernels index their inputs as
    dense [B, T, H, D] (the model's are views of one projection's output, rows strided by its whole width)."""
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=-2), k.repeat_interleave(groups, dim=-2)
    return q.contiguous(), k.contiguous(), v.contiguous()


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            ssm: torch.Tensor, slots: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """An extend step's tokens, request after request (`lens` tokens each, their states in `ssm` [slots, H, K, V]
    at `slots` [B]): q, k [T, Hk, K], v [T, H, V] in the model dtype, g and beta [T, H]. Returns o [T, H, V]
    (fp32) and leaves each request's state after its last token in its slot."""
    groups = v.shape[1] // q.shape[1]
    fla = fla_ops(q)
    if fla is not None:
        q, k, v = _for_fla(q, k, v, groups)
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long).to(q.device, non_blocking=True)
        o, final = fla.chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None].to(q.dtype),
                                              initial_state=ssm.index_select(0, slots), output_final_state=True,
                                              cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        ssm.index_copy_(0, slots, final.float())
        return o[0].float()
    qn, kn = _normalized(q, k, groups)
    vf, gf, bf = v.float(), g.float(), beta.float()
    out = torch.empty_like(vf)
    at = 0
    for i, n in enumerate(lens):
        slot = slots[i : i + 1]
        rows = slice(at, at + n)
        out[rows], state = chunked(qn[rows], kn[rows], vf[rows], gf[rows], bf[rows], ssm.index_select(0, slot)[0])
        ssm.index_copy_(0, slot, state[None])
        at += n
    return out


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """A decode step (one token a request, its state at `slots` [B] of `ssm`): o [B, H, V] (fp32), the states
    updated in place. No host reads: CUDA graphs capture it."""
    groups = v.shape[1] // q.shape[1]
    fla = fla_ops(q)
    if fla is not None:
        q, k, v = _for_fla(q, k, v, groups)
        o, final = fla.fused_recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None].float(), beta[:, None].to(q.dtype),
            initial_state=ssm.index_select(0, slots), output_final_state=True, use_qk_l2norm_in_kernel=True)
        ssm.index_copy_(0, slots, final.float())
        return o[:, 0].float()
    qn, kn = _normalized(q, k, groups)
    o, state = step(qn, kn, v.float(), g.float(), beta.float(), ssm.index_select(0, slots))
    ssm.index_copy_(0, slots, state)
    return o


def verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm: torch.Tensor, slots: torch.Tensor, runs: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A verify step (speculative decoding): each request's `runs[i]` rows in order, one step each from the state in
    its slot (`slots` [B], one a request), as decode would run them; the slots are left as they were. Returns o
    [T, H, V] and the step's normalized inputs, for `commit` to advance each state over the rows accepted."""
    qn, kn = _normalized(q, k, v.shape[1] // q.shape[1])
    inputs = (qn, kn, v.float(), g.float(), beta.float())
    out = torch.empty_like(inputs[2])
    at = 0
    for i, n in enumerate(runs):
        state = ssm.index_select(0, slots[i : i + 1])
        for j in range(at, at + n):
            o, state = _step_at(inputs, j, state)
            out[j] = o[0]
        at += n
    return out, inputs


def _step_at(inputs: tuple[torch.Tensor, ...], j: int, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`step` on row j of a verify step's normalized inputs (q, k, v, g, beta)."""
    q, k, v, g, beta = (x[j : j + 1] for x in inputs)
    return step(q, k, v, g, beta, state)


def commit(inputs: tuple[torch.Tensor, ...], ssm: torch.Tensor, slots: torch.Tensor, runs: list[int],
           accepted: list[int]) -> None:
    """After a verify step: each request's state advanced over its first `accepted[i]` rows (the same steps as
    `verify` ran: the same numbers), the rejected drafts' never written."""
    at = 0
    for i, (n, a) in enumerate(zip(runs, accepted)):
        state = ssm.index_select(0, slots[i : i + 1])
        for j in range(at, at + a):
            _, state = _step_at(inputs, j, state)
        ssm.index_copy_(0, slots[i : i + 1], state)
        at += n


def _depthwise(seq: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The causal conv's depthwise F.conv1d (seq [B, C, L], weight [C, 1, K]), without TF32 on CUDA: cuDNN's convs
    take it by default (torch.backends.cudnn.allow_tf32), which would round an fp32 model's (the exact mode's)
    conv inputs to 10-bit mantissas."""
    if seq.device.type != "cuda" or seq.dtype != torch.float32:  # TF32 touches fp32 on CUDA only: no flag flips
        return F.conv1d(seq, weight, groups=seq.shape[1])
    cudnn = torch.backends.cudnn
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        return F.conv1d(seq, weight, groups=seq.shape[1])


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                 lens: list[int]) -> torch.Tensor:
    """The causal depthwise conv + SiLU over an extend step's mixed q, k, v rows x [T, C], request after request,
    each continuing from the last kernel - 1 columns in its slot of `conv` [slots, C, kernel - 1] (and leaving its
    own last ones there). weight [C, kernel]."""
    out = torch.empty_like(x)
    at, w = 0, weight[:, None, :]
    for i, n in enumerate(lens):
        slot = slots[i : i + 1]
        seq = torch.cat([conv.index_select(0, slot)[0], x[at : at + n].t().to(conv.dtype)], dim=1)  # [C, K-1+n]
        y = _depthwise(seq[None].to(weight.dtype), w)[0]  # [C, n]
        conv.index_copy_(0, slot, seq[None, :, seq.shape[1] - conv.shape[2] :])
        out[at : at + n] = F.silu(y).t().to(x.dtype)
        at += n
    return out


def conv_verify(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                runs: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """conv_prefill over a verify step's runs, leaving the slots' conv states as they were: also returns each run's
    input columns after its state's ([C, kernel - 1 + n]), for `conv_commit`."""
    out, seqs = torch.empty_like(x), []
    at, w = 0, weight[:, None, :]
    for i, n in enumerate(runs):
        seq = torch.cat([conv.index_select(0, slots[i : i + 1])[0], x[at : at + n].t().to(conv.dtype)], dim=1)
        out[at : at + n] = F.silu(_depthwise(seq[None].to(weight.dtype), w)[0]).t().to(x.dtype)
        seqs.append(seq)
        at += n
    return out, seqs


def conv_commit(conv: torch.Tensor, slots: torch.Tensor, seqs: list[torch.Tensor], accepted: list[int]) -> None:
    """Each slot's conv state: the last kernel - 1 inputs up to its request's accepted rows."""
    width = conv.shape[2]
    for i, (seq, a) in enumerate(zip(seqs, accepted)):
        conv.index_copy_(0, slots[i : i + 1], seq[None, :, a : a + width])


def conv_step(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """conv_prefill for one token a request, x [B, C]: no host reads."""
    seq = torch.cat([conv.index_select(0, slots), x[:, :, None].to(conv.dtype)], dim=2)  # [B, C, K]
    y = _depthwise(seq.to(weight.dtype), weight[:, None, :])[:, :, 0]
    conv.index_copy_(0, slots, seq[:, :, 1:])
    return F.silu(y).to(x.dtype)
