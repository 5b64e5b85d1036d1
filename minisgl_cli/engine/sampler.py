"""Sampling per request: greedy, temperature, top-k, top-p, seeded draws, presence/frequency penalties."""

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


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, row in enumerate(rows):
        p = row.params
        if _penalized(row):
            ids, counts = torch.tensor(row.output_ids, device=logits.device).unique(return_counts=True)
            logits[i, ids] -= p.presence_penalty + p.frequency_penalty * counts.to(logits.dtype)


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


def _penalized(row: SamplingRow) -> bool:
    return row.params.penalized and bool(row.output_ids)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """logits: [B, V] (model dtype) -> next token ids [B] (int64, on the logits' device).

    A greedy batch takes the argmax of the logits as they are (widening bf16 to fp32 changes no
    value, so no order); anything that computes on them does so in fp32, on a fresh copy.
    """
    greedy = [r.params.greedy for r in rows]
    penalized = any(_penalized(r) for r in rows)
    if all(greedy) and not penalized:
        return logits.argmax(dim=-1)
    if logits.dtype != torch.float32:
        logits = logits.float()
    elif penalized:  # penalties write in place: leave the caller's (e.g. a CUDA graph's) buffer alone
        logits = logits.clone()
    _apply_penalties(logits, rows)
    out = logits.argmax(dim=-1)
    if all(greedy):
        return out
    idx = [i for i, g in enumerate(greedy) if not g]
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
    return out
