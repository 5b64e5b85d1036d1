"""Tensor-parallel linear layers: column-split (with merged shards such as QKV, gate-up) and row-split."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_cli.distributed import TPInfo, all_reduce
from minisgl_cli.layers import cpu_kernels


def _divide(n: int, tp: TPInfo, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; `out_sizes` lists merged shards (q, k, v).

    Each shard is split on its own, so rank r holds [q_r; k_r; v_r] and one matmul serves all three.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPInfo = TPInfo()):
        super().__init__()
        self.tp = tp
        self.local_sizes = [_divide(s, tp, "output size") for s in out_sizes]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        """Copy the full (unsplit) tensor of merged shard `shard` into this rank's rows."""
        param = self.weight if name == "weight" else self.bias
        size = self.local_sizes[shard]
        offset = sum(self.local_sizes[:shard])
        part = loaded.narrow(0, self.tp.rank * size, size)
        param.data.narrow(0, offset, size).copy_(part)
        cpu_kernels.invalidate(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums meet in an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPInfo = TPInfo()):
        super().__init__()
        self.tp = tp
        self.local_in = _divide(in_features, tp, "input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_shard(self, name: str, loaded: torch.Tensor, shard: int = 0) -> None:
        if name == "bias":
            self.bias.data.copy_(loaded)
            return
        self.weight.data.copy_(loaded.narrow(1, self.tp.rank * self.local_in, self.local_in))
        cpu_kernels.invalidate(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(cpu_kernels.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y
