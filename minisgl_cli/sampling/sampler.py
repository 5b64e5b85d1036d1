"""Sampling per step: penalties, logit bias, grammar token masks, temperature / top-k / top-p / min-p draws from
counter-based random streams, and the logprobs of the distribution each token was drawn from.

Every row's parameters come from the device-side `SamplingState` (gathered by the batch's page-table rows); the host
only decides, from facts known when a request took its row, which of these ops the step runs, so a step never reads a
device value.
A draw is the inverse CDF, in token-id order, of the row's kept distribution at a uniform number hashed from
(seed, position of the drawn token): the same seed gives the same tokens whatever else shares the batch, with
no per-request generator. Implementations of the cut and draw, all exact: `triton` (CUDA: by rejection, no sort,
kernels/triton/sampling.py), and `torch`: on the CPU top-k candidates or the same rejection scheme (a host check
per round is free there), on a GPU without Triton the cut as a mask (a sort of the vocabulary only for a top-p
row without a top-k of at most MAX_BOUNDED_TOP_K beside it) and one draw, reading nothing back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl_cli.sampling.state import MAX_BOUNDED_TOP_K, Need, RowParams, SamplingBatch, SamplingState

log = logging.getLogger("minisgl.sampler")


@dataclass
class Sampled:
    """One step's draws: the next token per row, and logprobs for the rows that asked (all on the device).

    `lp_rows` are the rows with logprobs, in order; `logprob[j]` is row lp_rows[j]'s chosen token's
    logprob, `top_ids[j]` / `top_logprobs[j]` its k most likely candidates (k = the most any row asked).
    """

    next_ids: torch.Tensor  # [B] int64
    lp_rows: list[int] | None = None
    logprob: torch.Tensor | None = None  # [n] fp32
    top_ids: torch.Tensor | None = None  # [n, k] int64
    top_logprobs: torch.Tensor | None = None  # [n, k] fp32


# --- counter-based uniforms ----------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32, in halves so no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, position: torch.Tensor, round_: int = 0) -> torch.Tensor:
    """[B] float32 in [0, 1): a pure function of (seed, position, round), 24 random bits each."""
    h = _mix32(_mix32(_mix32(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ (position.to(torch.int64) & _M32))
    if round_:
        h = _mix32(h ^ round_)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


# --- masks ---------------------------------------------------------------------------------------
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits of disallowed tokens to -inf. bitmask: [B, ceil(V/32)] int32, bit j of word w allows token
    32*w + j (xgrammar's layout); an all-ones row leaves its row alone."""
    b, v = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(b, -1)[:, :v].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def _threshold(vals: torch.Tensor, lse: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[B, 1] the smallest logit each row keeps, from its candidates `vals` (sorted, largest first) and the log of
    its whole distribution's mass: a token stays when fewer than top_k tokens lie strictly above it and their mass
    is at most top_p (the top token always stays). Tied tokens share one fate, as in HF's and vLLM's top-k and in
    the Triton kernel: a tie at the boundary keeps all of its tokens."""
    n = vals.shape[-1]
    ranks = torch.arange(n, device=vals.device)[None, :].expand_as(vals)
    starts = torch.ones_like(vals, dtype=torch.bool)
    starts[:, 1:] = vals[:, 1:] != vals[:, :-1]
    first = torch.where(starts, ranks, 0).cummax(dim=-1).values  # where each token's group of ties begins
    probs = (vals - lse).exp()
    above = (probs.cumsum(dim=-1) - probs).gather(-1, first)  # the mass strictly above each token
    keep = (first < top_k[:, None]) & (above <= top_p[:, None])  # a prefix: both sides grow down the order
    last = keep.sum(dim=-1, keepdim=True).clamp_(min=1) - 1
    return vals.gather(-1, last)


def _cut_sorted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) sets with -inf: a sort of the whole vocabulary."""
    vals = scaled.sort(dim=-1, descending=True).values
    tau = _threshold(vals, scaled.logsumexp(dim=-1, keepdim=True), top_k, top_p)
    return scaled.masked_fill(scaled < tau, float("-inf"))


def _cut_bounded(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, k: int) -> torch.Tensor:
    """The same cut when every cut row keeps at most k tokens (ties aside): the k largest as candidates, no full
    sort. Rows without a top-k cut (top_k = vocab) are left alone (they have no top-p cut either, or we would not
    be here)."""
    vals = scaled.topk(k, dim=-1).values  # sorted, largest first
    tau = _threshold(vals, scaled.logsumexp(dim=-1, keepdim=True), top_k, top_p)
    kept = scaled.masked_fill(scaled < tau, float("-inf"))  # over the whole row: ties past the k candidates stay
    return torch.where((top_k < scaled.shape[-1])[:, None], kept, scaled)


def _min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one (p_i < min_p p_max <=> s_i < s_max + ln min_p)."""
    floor = scaled.max(dim=-1, keepdim=True).values + min_p.log()[:, None]  # log 0 = -inf: no cut
    return scaled.masked_fill(scaled < floor, float("-inf"))


def cut(scaled: torch.Tensor, p: RowParams, batch: SamplingBatch) -> torch.Tensor:
    """The row's kept distribution as logits (temperature applied; -inf outside top-k, top-p and min-p)."""
    needs = batch.needs
    if needs & Need.TOP_P and not batch.k_bound:
        scaled = _cut_sorted(scaled, p.top_k, p.top_p)
    elif needs & (Need.TOP_K | Need.TOP_P):
        scaled = _cut_bounded(scaled, p.top_k, p.top_p, batch.k_bound)
    if needs & Need.MIN_P:
        scaled = _min_p(scaled, p.min_p)
    return scaled


def draw_weights(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in token-id order: the first token whose cumulative weight passes u times the total."""
    # fp64 on the CPU: an fp32 sum over a flat vocabulary rounds by more than a small weight (a tiny change of
    # the logits, e.g. another batch size's GEMM, would then move the draw).
    cdf = weights.double().cumsum(dim=-1) if weights.device.type == "cpu" else weights.cumsum(dim=-1)
    x = (u.to(cdf.dtype) * cdf[:, -1])[:, None]
    ids = torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=weights.shape[-1] - 1)
    # u * total may round up to the total: then no entry passes it; take the last token of weight > 0.
    hit = weights.gather(1, ids[:, None])[:, 0] > 0
    if weights.device.type == "cpu" and bool(hit.all()):  # a host check is free on the CPU: skip the fallback's pass
        return ids
    last = weights.shape[-1] - 1 - (weights.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
    return torch.where(hit, ids, last)


def draw(kept: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A draw from the kept distribution (logits, -inf outside it)."""
    return draw_weights((kept - kept.max(dim=-1, keepdim=True).values).exp(), u)


def torch_draw(logits: torch.Tensor, p: RowParams, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, the cut as a mask, then the inverse-CDF draw (sampled rows; greedy rows get the argmax): the
    torch path on a GPU without Triton, where it never reads a device value."""
    kept = cut(logits / p.temperature[:, None], p, batch)
    drawn = draw(kept, uniform(p.seed_lo, p.seed_hi, batch.positions))
    return torch.where(p.greedy, logits.argmax(dim=-1), drawn)


def cpu_draw(logits: torch.Tensor, p: RowParams, batch: SamplingBatch) -> torch.Tensor:
    """The CPU's torch path. A row with a top-k cut of at most MAX_BOUNDED_TOP_K draws from its candidates (topk,
    no sort of the vocabulary); any other sampled row by the Triton kernel's rejection scheme
    (kernels/triton/sampling.py: exact, no sort, the same uniforms round by round). Which rows are done is read on
    the host each round: free on the CPU, where a sort of the vocabulary costs ten rounds or more. The split is by
    each row's own parameters, so a row draws alike whatever shares its batch."""
    scaled = logits.float() / p.temperature[:, None]
    out = scaled.argmax(dim=-1)
    sampled = ~p.greedy
    bounded = sampled & (p.top_k < scaled.shape[-1]) & (p.top_k <= MAX_BOUNDED_TOP_K)  # top_k = vocab: no cut
    if bounded.any():
        rows = bounded.nonzero()[:, 0]
        sub = RowParams(*(getattr(p, f)[rows] for f in RowParams.__dataclass_fields__))
        kept = _cut_bounded(scaled[rows], sub.top_k, sub.top_p, int(sub.top_k.max()))
        if batch.needs & Need.MIN_P:
            kept = _min_p(kept, sub.min_p)
        out[rows] = draw(kept, uniform(sub.seed_lo, sub.seed_hi, batch.positions[rows]))
    rows = (sampled & ~bounded).nonzero()[:, 0]
    if not rows.numel():
        return out
    scaled, top_k, top_p, min_p = scaled[rows], p.top_k[rows], p.top_p[rows], p.min_p[rows]
    seed_lo, seed_hi, positions = p.seed_lo[rows], p.seed_hi[rows], batch.positions[rows]
    top = scaled.gather(1, out[rows][:, None])
    weights = (scaled - top).exp()
    total = weights.sum(dim=-1)
    # Which rows have a cut that can reject a draw: one with temperature alone (the OpenAI default) takes its first.
    # The min-p mask, the top-k count and the first round's copies are skipped where no row needs them, each being
    # a pass over the vocabulary (low = -inf masks only weights that are 0 already).
    cuts = (top_k < scaled.shape[-1]) | (top_p < 1) | (min_p > 0)
    support = weights.masked_fill(scaled < top + min_p.log()[:, None], 0.0) if bool((min_p > 0).any()) else weights
    counted = bool((top_k < scaled.shape[-1]).any())
    todo = torch.arange(rows.shape[0], device=logits.device)  # rows (of `rows`) not yet accepted
    low = torch.full((rows.shape[0],), float("-inf"), device=logits.device)  # the support is s > low
    rnd = 0
    while todo.numel():
        s, w, mass = (scaled, support, weights) if rnd == 0 else (scaled[todo], support[todo], weights[todo])
        if rnd:
            w = w.masked_fill(s <= low[:, None], 0.0)
        ids = draw_weights(w, uniform(seed_lo[todo], seed_hi[todo], positions[todo], rnd))
        ok = ~cuts[todo]
        if bool(ok.all()):
            out[rows[todo]] = ids
            break
        picked = s.gather(1, ids[:, None])
        above = s > picked
        # Rejected only where the cut surely excludes the pick (the kernel's test): a row of non-finite logits (a
        # repetition penalty that overflows them) compares false and takes its first draw instead of looping forever.
        cut_off = (mass * above).sum(dim=-1) > top_p[todo] * total[todo]
        if counted:
            cut_off |= above.sum(dim=-1) >= top_k[todo]
        ok |= ~cut_off
        out[rows[todo[ok]]] = ids[ok]
        todo, low = todo[~ok], picked[~ok, 0]
        rnd += 1
    return out


# What draws a step's tokens: (fp32 or model-dtype logits after penalties / masks, the rows, the batch) -> [B] ids.
DrawFn = Callable[[torch.Tensor, RowParams, SamplingBatch], torch.Tensor]


@dataclass(frozen=True)
class Sampler:
    """One engine's sampler implementation: `name` shows in the logs and /metrics."""

    name: str
    draw: DrawFn


def triton_draw(logits: torch.Tensor, p: RowParams, batch: SamplingBatch, split: bool | None = None) -> torch.Tensor:
    """The CUDA draw (kernels/triton/sampling.py) of a batch's rows: the kernels' passes chosen by what its rows ask."""
    from minisgl_cli.kernels.triton.sampling import draw

    return draw(logits, p.temperature, p.top_p, p.min_p, p.top_k, p.seed_lo, p.seed_hi, p.greedy, batch.positions,
                bool(batch.needs & (Need.TOP_K | Need.TOP_P)), bool(batch.needs & Need.MIN_P), split)


def create_sampler(device: torch.device, vocab: int, choice: str = "auto") -> Sampler:
    """`triton` on CUDA where Triton imports and its kernel compiles (auto; compiled here, not on the first
    request), else `torch`: on the CPU `cpu_draw`, elsewhere the cut as a mask (`torch_draw`)."""
    if choice in ("auto", "triton") and device.type == "cuda":
        try:
            from minisgl_cli.kernels.triton.sampling import warm

            warm(vocab, device)
        except Exception as exc:
            if choice == "triton":
                raise
            log.warning("triton sampler unavailable (%s: %s); sampling with torch", type(exc).__name__, exc)
        else:
            return Sampler("triton", triton_draw)
    elif choice == "triton":
        raise ValueError("the triton sampler needs CUDA")
    return Sampler("torch", cpu_draw if device.type == "cpu" else torch_draw)


def sample(logits: torch.Tensor, batch: SamplingBatch, state: SamplingState, sampler: Sampler,
           bitmask: torch.Tensor | None = None) -> Sampled:
    """logits: [B, V] (model dtype) -> the next token per row, and logprobs where a row asked (on this rank).

    A plain greedy batch (no penalties, bias, grammar or logprobs) takes the argmax of the logits as they
    are (widening bf16 to fp32 changes no value, so no order); anything that writes on them does so in
    fp32, on a fresh copy. A row's logprobs are the log-softmax of the distribution its token was drawn
    from: after penalties, bias and the grammar mask, and for a sampled row after temperature, top-k, top-p
    and min-p (a greedy row's at temperature 1), so a greedy token is always the top candidate.
    """
    needs = batch.needs
    if batch.plain and bitmask is None:
        return Sampled(logits.argmax(dim=-1))
    p = state.params(batch.req_rows)
    if needs & (Need.PENALTY | Need.REPETITION | Need.BIAS) or bitmask is not None:
        # These write in place: leave the caller's (e.g. a CUDA graph's) buffer alone.
        logits = logits.float() if logits.dtype != torch.float32 else logits.clone()
        state.penalize(logits, batch, p)
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask)
    out = sampler.draw(logits, p, batch) if needs & Need.SAMPLED else logits.argmax(dim=-1)
    if batch.lp_index is None:
        return Sampled(out)
    return _logprobs(logits.float(), p, batch, out)


def _logprobs(logits: torch.Tensor, p: RowParams, batch: SamplingBatch, out: torch.Tensor) -> Sampled:
    """Log-softmax of each asking row's distribution, its chosen token's entry and its top k."""
    assert batch.lp_index is not None
    idx = batch.lp_index
    dist = logits[idx]
    if batch.needs & Need.SAMPLED:  # sampled rows: the temperature-scaled, cut logits they were drawn from
        sub = RowParams(*(getattr(p, f)[idx] for f in RowParams.__dataclass_fields__))
        kept = cut(dist / sub.temperature[:, None], sub, batch)
        dist = torch.where(sub.greedy[:, None], dist, kept)
    logp = dist.log_softmax(dim=-1)
    chosen = out[idx]
    k = batch.top_logprobs
    top = logp.topk(k, dim=-1) if k else None
    return Sampled(
        out, batch.lp_rows, logp.gather(-1, chosen[:, None])[:, 0],
        top.indices if top is not None else None, top.values if top is not None else None,
    )

