"""Sampling per request: greedy, temperature, top-k, top-p, seeded draws, presence/frequency penalties,
logit bias, grammar token masks, and the logprobs of the distribution each token was drawn from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_cli.types import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one request for one step."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request stream, so seeded draws ignore batch makeup
    output_ids: list[int]  # for penalties


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


def _penalized(row: SamplingRow) -> bool:
    return row.params.penalized and bool(row.output_ids)


def _apply_penalties_and_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if _penalized(row):
            ids, counts = torch.tensor(row.output_ids, device=logits.device).unique(return_counts=True)
            logits[i, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits of disallowed tokens to -inf. bitmask: [B, ceil(V/32)] int32, bit j of word w allows token
    32*w + j (xgrammar's layout); an all-ones row leaves its row alone."""
    b, v = logits.shape
    bitmask = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(b, -1)[:, :v].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) sets with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    cut = ranks >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep a token while the mass before it is below top_p (the top token always stays).
    cut |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, rows: list[SamplingRow], bitmask: torch.Tensor | None = None,
           logprobs: bool = True) -> Sampled:
    """logits: [B, V] (model dtype) -> the next token per row, and logprobs where a row asked (and `logprobs`).

    A plain greedy batch (no penalties, bias, grammar or logprobs) takes the argmax of the logits as they
    are (widening bf16 to fp32 changes no value, so no order); anything that computes on them does so in
    fp32, on a fresh copy. A row's logprobs are the log-softmax of the distribution its token was drawn
    from: after penalties, bias and the grammar mask, and for a sampled row after temperature, top-k and
    top-p (a greedy row's at temperature 1), so a greedy token is always the top candidate.
    """
    greedy = [r.params.greedy for r in rows]
    penalized = any(_penalized(r) or r.params.logit_bias for r in rows)
    lp_rows = [i for i, r in enumerate(rows) if r.params.wants_logprobs] if logprobs else []
    if all(greedy) and not penalized and bitmask is None and not lp_rows:
        return Sampled(logits.argmax(dim=-1))
    if logits.dtype != torch.float32:
        logits = logits.float()
    elif penalized or bitmask is not None:  # these write in place: leave the caller's (e.g. a CUDA graph's) buffer
        logits = logits.clone()
    if penalized:
        _apply_penalties_and_bias(logits, rows)
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
    out = logits.argmax(dim=-1)
    idx = [i for i, g in enumerate(greedy) if not g]
    sub = None
    if idx:
        dev = logits.device
        sub = logits[idx] / torch.tensor([rows[i].params.temperature for i in idx], device=dev)[:, None]
        vocab = logits.shape[-1]
        top_k = torch.tensor([rows[i].params.top_k if rows[i].params.top_k > 0 else vocab for i in idx], device=dev)
        top_p = torch.tensor([rows[i].params.top_p for i in idx], device=dev, dtype=sub.dtype)
        if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
            sub = _top_k_top_p(sub, top_k, top_p)
        probs = sub.softmax(dim=-1)
        # Exponential race (Gumbel-max in disguise): argmax p/E with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(idx):
            if rows[i].generator is not None:  # seeded rows redraw from their own stream
                noise[j].exponential_(generator=rows[i].generator)
        out[idx] = (probs / noise).argmax(dim=-1)
    if not lp_rows:
        return Sampled(out)
    return _logprobs(logits, sub, idx, out, rows, lp_rows)


def _logprobs(logits: torch.Tensor, sub: torch.Tensor | None, idx: list[int], out: torch.Tensor,
              rows: list[SamplingRow], lp_rows: list[int]) -> Sampled:
    """Log-softmax of each asking row's distribution, its chosen token's entry and its top k."""
    dist = logits[lp_rows]
    if sub is not None:
        pos = {i: j for j, i in enumerate(idx)}
        sampled = [(n, pos[i]) for n, i in enumerate(lp_rows) if i in pos]
        if sampled:  # sampled rows: the temperature-scaled, top-k/top-p-cut logits they were drawn from
            dist[[n for n, _ in sampled]] = sub[[j for _, j in sampled]]
    logp = dist.log_softmax(dim=-1)
    chosen = out[lp_rows]
    k = max(rows[i].params.top_logprobs for i in lp_rows)
    top = logp.topk(k, dim=-1) if k else None
    return Sampled(
        out, lp_rows, logp.gather(-1, chosen[:, None])[:, 0],
        top.indices if top is not None else None, top.values if top is not None else None,
    )
