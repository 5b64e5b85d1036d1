"""Tensor-parallel groups over torch.distributed: this rank's place and the collectives layers call."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1


def all_reduce(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPInfo) -> torch.Tensor:
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
