"""The gated delta rule (Gated DeltaNet's linear attention) over state slots: chunked for prefill, one step for decode.

Per value head, with q and k L2-normalized (q also scaled by k_dim^-1/2), a state S (k_dim x v_dim) carried from
token to token:  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t.
A prefill runs it a chunk of C tokens at a time: within a chunk the updates are one unit-lower-triangular solve
(the WY form) and a few matmuls, between chunks the state is carried (see `chunked`); every request of an extend
step goes at once (the chunks of all of them in one batch, the states carried a chunk index at a time): a step's
op count grows with its longest request's chunks, not with its number of requests. Decode is the one-step update
batched over requests (`step`). Each request's state lives in its slot of the pool (kvcache/state.py), beside the
last inputs of the causal conv before the rule (`conv_prefill`, `conv_step`): a prefill chunk starts from them and
writes them back, so a long prompt cut into chunks by the scheduler carries them across.
A speculative verify step runs each request's rows in order (row j of all of them at once) without writing the state
(`verify`); once the scheduler knows how many were accepted, `commit` advances the state over those only, so rejected
drafts never enter it.

Which path runs where: the torch code of this module everywhere by default; on CUDA with the fused ops on (16-bit
models), a decode step, a verify step and its commit through kernels/triton/gated_delta.py (a request's rows in one
program);
on CUDA with MINISGL_FLA=1, where flash-linear-attention (`fla-core`, Triton) imports, its `chunk_gated_delta_rule`
and `fused_recurrent_gated_delta_rule` for prefill and decode (opt-in: see `fla_ops`). All normalize q and k in fp32
and keep the states in fp32.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Chunks:
    """Where an extend step's tokens go when cut into chunks: chunk j of every request that has one, for j = 0, 1, ..
    in turn (requests with more chunks first), each chunk [heads, chunk] rows, a request's last one padded."""

    rows: torch.Tensor  # [T * H] int64: each (token, head)'s row of the layout [num_chunks * H * chunk]
    order: torch.Tensor  # [B] int64: the requests in the layout's order (most chunks first)
    steps: tuple[tuple[int, int], ...]  # for each j: (the first chunk j, how many requests have a chunk j)
    num_chunks: int


def _upload(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host index tensor on `device`, through pinned memory on CUDA (a copy from pageable memory may wait for the
    steps in flight)."""
    return x.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else x.to(device)


@functools.lru_cache(maxsize=8)  # every linear layer of a step asks for the same one
def _chunks(lens: tuple[int, ...], chunk: int, heads: int, device: torch.device) -> _Chunks:
    n = torch.tensor(lens, dtype=torch.long)
    counts = (n + chunk - 1) // chunk
    order = torch.argsort(counts, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(lens))
    active = (counts[None, :] > torch.arange(int(counts.max()) if len(lens) else 0)[:, None]).sum(1)  # per j
    first = active.cumsum(0) - active
    req = torch.repeat_interleave(torch.arange(len(lens)), n)
    at = torch.arange(int(n.sum())) - (n.cumsum(0) - n)[req]  # each token's place in its request
    rows = (((first[at // chunk] + rank[req]) * heads)[:, None] + torch.arange(heads)) * chunk + (at % chunk)[:, None]
    return _Chunks(_upload(rows.reshape(-1), device), _upload(order, device),
                   tuple(zip(first.tolist(), active.tolist())), int(active.sum()))


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            ssm: torch.Tensor, slots: torch.Tensor, lens: list[int], chunk: int = CHUNK) -> torch.Tensor:
    """B sequences of `lens` tokens, packed: q, k [T, H, K] (normalized), v [T, H, V], g (log decay, <= 0) and beta
    [T, H], all fp32; sequence i's state in `ssm` [slots, H, K, V] at slots[i], read before its first token and
    left there after its last. Returns o [T, H, V].

    Within a chunk, with G_i = g_1 + .. + g_i and D_ij = exp(G_i - G_j) (j <= i): the values each token writes,
    u_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} D_ij (k_i . k_j) u_j), solve (I + A) U = beta V - beta exp(G) K S0
    with A_ij = beta_i D_ij (k_i . k_j) strictly below the diagonal; then O = exp(G) Q S0 + (D * Q K^T) U and the
    state after the chunk is exp(G_C) S0 + (exp(G_C - G) K)^T U. Everything but S0 is computed for every chunk of
    every sequence at once; then the states are carried chunk by chunk, all sequences together (as many rounds as
    the longest has chunks). A pad row (q = k = v = beta = g = 0) writes nothing and decays by exp(0) = 1."""
    longest = max(lens, default=1)
    if longest < chunk:  # short sequences only (a chat turn, a decode-sized extend): a power of 2 past them
        chunk = 1 << (longest - 1).bit_length()
    T, H, K, V = v.shape[0], v.shape[1], k.shape[-1], v.shape[-1]
    plan = _chunks(tuple(lens), chunk, H, q.device)
    n = plan.num_chunks

    def laid(x: torch.Tensor) -> torch.Tensor:  # [T, H, *] -> [chunks, H, chunk, *], the pad rows zero
        rows = x.reshape(T * H, -1)
        return rows.new_zeros(n * H * chunk, rows.shape[1]).index_copy_(0, plan.rows, rows).view(n, H, chunk, -1)

    q, k, v = laid(q), laid(k), laid(v)
    g, beta = laid(g)[..., 0], laid(beta)[..., 0]  # [chunks, H, chunk]
    cum = g.cumsum(-1)  # [chunks, H, chunk]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # D, zero above
    lower = ((k @ k.mT) * decay * beta[..., None]).tril(-1)  # the solve reads the strict lower triangle (A)
    rhs = torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1)
    u0, w = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True).split([V, K], dim=-1)
    within = (q @ k.mT) * decay
    last = cum[..., -1:]
    reads = torch.cat([w, cum.exp()[..., None] * q], dim=2)  # what a chunk reads of S0: W, exp(G) Q
    fade, writes = last.exp()[..., None], ((last - cum).exp()[..., None] * k).mT.contiguous()
    order = slots.index_select(0, plan.order)
    states = ssm.index_select(0, order)
    o = torch.empty_like(v)
    for first, b in plan.steps:  # chunk j of the b sequences that have one: layout rows first .. first + b
        s, at = states[:b], slice(first, first + b)
        r = reads[at] @ s
        u = u0[at] - r[:, :, :chunk]
        torch.add(r[:, :, chunk:], within[at] @ u, out=o[at])
        s.mul_(fade[at]).view(b * H, K, V).baddbmm_(writes[at].view(b * H, K, chunk), u.view(b * H, chunk, V))
    ssm.index_copy_(0, order, states)
    return o.view(n * H * chunk, V).index_select(0, plan.rows).view(T, H, V)


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
            ssm: torch.Tensor, slots: torch.Tensor, lens: list[int], batched: bool | None = None) -> torch.Tensor:
    """An extend step's tokens (`lens` tokens each, their states in `ssm` [slots, H, K, V] at `slots` [B]): q, k
    [T, Hk, K], v [T, H, V] in the model dtype, g and beta [T, H]. Returns o [T, H, V] (fp32) and leaves each
    request's state after its last token in its slot. `batched`: all requests at once (default: off the CPU)."""
    groups = v.shape[1] // q.shape[1]
    fla = fla_ops(q)
    if fla is not None:
        q, k, v = _for_fla(q, k, v, groups)
        cu = _upload(torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.long), q.device)
        o, final = fla.chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None].to(q.dtype),
                                              initial_state=ssm.index_select(0, slots), output_final_state=True,
                                              cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        ssm.index_copy_(0, slots, final.float())
        return o[0].float()
    qn, kn = _normalized(q, k, groups)
    vf, gf, bf = v.float(), g.float(), beta.float()
    if (q.device.type != "cpu" if batched is None else batched) or len(lens) == 1:
        return chunked(qn, kn, vf, gf, bf, ssm, slots, lens)
    # On a CPU one request at a time: its state and chunks stay in cache (all requests' at once ran 0.5-0.8x there,
    # examples/gated_delta_bench.py); on a GPU the batch's launches are what a step pays for.
    out = torch.empty_like(vf)
    at = 0
    for i, n in enumerate(lens):
        rows = slice(at, at + n)
        out[rows] = chunked(qn[rows], kn[rows], vf[rows], gf[rows], bf[rows], ssm, slots[i : i + 1], [n])
        at += n
    return out


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm: torch.Tensor, slots: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """A decode step (one token a request, its state at `slots` [B] of `ssm`): o [B, H, V] (fp32), the states
    updated in place. No host reads: CUDA graphs capture it. `fused` (CUDA): the step in one Triton launch, each state
    read and written once (kernels/triton/gated_delta.py's rows in order, one row a request), where torch gathers,
    steps and scatters it in ~8 launches."""
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
    if fused:
        from minisgl_cli.kernels.triton.gated_delta import rows_in_order

        out = torch.empty(slots.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
        rows_in_order(qn, kn, v.float(), g.float(), beta.float(), ssm, slots, None, None, out, write=True)
        return out
    o, state = step(qn, kn, v.float(), g.float(), beta.float(), ssm.index_select(0, slots))
    ssm.index_copy_(0, slots, state)
    return o


@dataclass(frozen=True)
class _Rounds:
    """A verify step's rows taken one round at a time: round j steps row j of every request that has one (requests
    with more rows first)."""

    order: torch.Tensor  # [B] int64: the requests by their number of rows, most first
    rows: torch.Tensor  # the rows of round 0, then those of round 1, ..
    counts: tuple[int, ...]  # rows in each round


@functools.lru_cache(maxsize=8)
def _rounds(runs: tuple[int, ...], upto: tuple[int, ...], device: torch.device) -> _Rounds:
    """Rounds over the first upto[i] of each request's runs[i] rows."""
    order = sorted(range(len(runs)), key=lambda i: -upto[i])
    starts = [0, *itertools.accumulate(runs)]
    rounds = [[starts[i] + j for i in order if upto[i] > j] for j in range(max(upto, default=0))]
    return _Rounds(_upload(torch.tensor(order), device), _upload(torch.tensor(sum(rounds, [])), device),
                   tuple(len(r) for r in rounds))


def _advance(inputs: tuple[torch.Tensor, ...], ssm: torch.Tensor, slots: torch.Tensor, runs: list[int],
             upto: list[int], out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's state (in `ssm` at `slots`) one `step` a row over its first upto[i] rows of a verify step's
    normalized inputs (q, k, v, g, beta), all requests together row by row; the outputs into `out` where given.
    Returns (the requests' slots, their states after), in `_Rounds` order."""
    plan = _rounds(tuple(runs), tuple(upto), inputs[0].device)
    slots = slots.index_select(0, plan.order)
    states = ssm.index_select(0, slots)
    at = 0
    for b in plan.counts:
        rows = plan.rows[at : at + b]
        q, k, v, g, beta = (x.index_select(0, rows) for x in inputs)
        o, states[:b] = step(q, k, v, g, beta, states[:b])
        if out is not None:
            out.index_copy_(0, rows, o)
        at += b
    return slots, states


@functools.lru_cache(maxsize=16)  # every linear layer of a verify step asks for the same ones
def _device_ints(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Host ints as [n] int64 on `device`, uploaded once a step (not a pageable copy a layer: that one may wait for
    the steps in flight)."""
    return _upload(torch.tensor(values, dtype=torch.int64), device)


def first_rows(runs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Each request's first row in a step of `runs` rows a request, [B] int64 on `device`."""
    return _device_ints(tuple(itertools.accumulate(runs, initial=0))[:-1], device)


def verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           ssm: torch.Tensor, slots: torch.Tensor, runs: list[int],
           fused: bool = False) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A verify step (speculative decoding): each request's `runs[i]` rows in order, one step each from the state in
    its slot (`slots` [B], one a request), as decode would run them (row j of every request at once); the slots are
    left as they were. Returns o [T, H, V] and the step's normalized inputs, for `commit` to advance each state over
    the rows accepted. `fused` (CUDA): each request's rows in one Triton launch (kernels/triton/gated_delta.py)."""
    qn, kn = _normalized(q, k, v.shape[1] // q.shape[1])
    vf, gf, bf = v.float(), g.float(), beta.float()
    inputs = (qn, kn, vf, gf, bf)
    out = torch.empty_like(vf)
    if fused:
        from minisgl_cli.kernels.triton.gated_delta import rows_in_order

        spans = first_rows(tuple(runs), q.device), _device_ints(tuple(runs), q.device)
        rows_in_order(qn, kn, vf, gf, bf, ssm, slots, *spans, out, write=False)
    else:
        _advance(inputs, ssm, slots, runs, runs, out)
    return out, inputs


def commit(inputs: tuple[torch.Tensor, ...], ssm: torch.Tensor, slots: torch.Tensor, runs: list[int],
           accepted: list[int], fused: bool = False) -> None:
    """After a verify step: each request's state advanced over its first `accepted[i]` rows (the steps `verify`
    ran), the rejected drafts' never written. `fused`: as `verify`'s."""
    if fused:
        from minisgl_cli.kernels.triton.gated_delta import rows_in_order

        qn, kn, vf, gf, bf = inputs
        spans = first_rows(tuple(runs), ssm.device), _device_ints(tuple(accepted), ssm.device)
        rows_in_order(qn, kn, vf, gf, bf, ssm, slots, *spans, None, write=True)
    else:
        ssm.index_copy_(0, *_advance(inputs, ssm, slots, runs, accepted))


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


@dataclass(frozen=True)
class _Packed:
    """An extend or verify step's conv input packed as one sequence of rows: each request's conv state (`width`
    rows), then its own rows, request after request."""

    rows: torch.Tensor  # [T] int64: where each row of the step goes
    states: torch.Tensor  # [B * width] int64: where each request's state goes
    outputs: torch.Tensor  # [T] int64: each row's window's first row (its row of the conv's output)
    starts: tuple[int, ...]  # each request's first row


@functools.lru_cache(maxsize=8)
def _packed(lens: tuple[int, ...], width: int, device: torch.device) -> _Packed:
    n = torch.tensor(lens, dtype=torch.long)
    starts = n.cumsum(0) - n + torch.arange(len(lens)) * width
    rows = torch.arange(int(n.sum())) + torch.repeat_interleave(starts + width - (n.cumsum(0) - n), n)
    states = (starts[:, None] + torch.arange(width)).reshape(-1)
    return _Packed(_upload(rows, device), _upload(states, device), _upload(rows - width, device),
                   tuple(starts.tolist()))


@functools.lru_cache(maxsize=8)
def _state_rows(starts: tuple[int, ...], after: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
    """The packed rows of each request's conv state after its first `after` rows: [B * width]."""
    return _upload(torch.tensor([s + a + j for s, a in zip(starts, after) for j in range(width)]), device)


def conv_verify(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                runs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv + SiLU over a step's mixed q, k, v rows x [T, C], `runs[i]` rows a request, each
    continuing from the last kernel - 1 inputs in its slot of `conv` [slots, C, kernel - 1], all requests at once
    over their inputs packed (`_Packed`); the slots are left as they were. weight [C, kernel]. Returns the output
    and the packed input [T + B (kernel - 1), C], for `conv_commit`.

    The conv is `kernel` multiply-adds of shifted rows in fp32 (on the CPU the very sums F.conv1d makes), in the
    rows' own layout: no transposes to [C, T] and back, and no cuDNN (whose fp32 convs take TF32 by default)."""
    width, channels = conv.shape[2], x.shape[1]
    plan = _packed(tuple(runs), width, x.device)
    seq = conv.new_empty(x.shape[0] + len(runs) * width, channels)
    seq.index_copy_(0, plan.states, conv.index_select(0, slots).transpose(1, 2).reshape(-1, channels))
    seq.index_copy_(0, plan.rows, x.to(conv.dtype))
    n, w = seq.shape[0] - width, weight.float().t()  # row r of y: the window seq[r : r + kernel]
    y = seq[:n].float() * w[0]
    for j in range(1, width + 1):
        y.addcmul_(seq[j : j + n], w[j])
    return F.silu(y.index_select(0, plan.outputs)).to(x.dtype), seq


def conv_commit(conv: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor, runs: list[int],
                accepted: list[int]) -> None:
    """Each slot's conv state: the last kernel - 1 inputs up to its request's first `accepted` rows, from
    `conv_verify`'s packed input."""
    width = conv.shape[2]
    cols = _state_rows(_packed(tuple(runs), width, seq.device).starts, tuple(accepted), width, seq.device)
    conv.index_copy_(0, slots, seq.index_select(0, cols).view(len(runs), width, -1).transpose(1, 2))


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor,
                 lens: list[int]) -> torch.Tensor:
    """`conv_verify` over an extend step's rows (`lens` a request), each slot left with its request's last inputs."""
    out, seq = conv_verify(x, weight, conv, slots, lens)
    conv_commit(conv, slots, seq, lens, lens)
    return out


def conv_step(x: torch.Tensor, weight: torch.Tensor, conv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """conv_prefill for one token a request, x [B, C]: no host reads."""
    seq = torch.cat([conv.index_select(0, slots), x[:, :, None].to(conv.dtype)], dim=2)  # [B, C, K]
    y = _depthwise(seq.to(weight.dtype), weight[:, None, :])[:, :, 0]
    conv.index_copy_(0, slots, seq[:, :, 1:])
    return F.silu(y).to(x.dtype)
