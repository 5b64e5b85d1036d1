"""Tensor-parallel linear layers: column-split (with merged shards such as QKV, gate-up) and row-split."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_cli.distributed import TPInfo
from minisgl_cli.distributed.comm import all_reduce
from minisgl_cli.layers import cpu_kernels
from minisgl_cli.layers.activation import silu_and_mul
from minisgl_cli.layers.fused import Kernels
from minisgl_cli.loader.hf import Weight, whole


def _gemv_ops(x: torch.Tensor, weight: torch.Tensor, kernels: Kernels):
    """The Triton ops when x is one CUDA row in 16-bit (batch-1 decode): their GEMV beats cuBLAS there."""
    if x.dim() != 2 or x.shape[0] != 1 or weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    return kernels.triton(x)


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: Kernels) -> torch.Tensor:
    """x W^T (+ bias) through the fastest kernel for the shape: Triton GEMV, CPU packs, or F.linear."""
    ops = _gemv_ops(x, weight, kernels)
    if ops is not None:
        return ops.gemv(x.contiguous(), weight, bias, pdl=kernels.pdl)
    return cpu_kernels.linear(x, weight, bias, kernels.cpu_gemm)


def _divide(n: int, tp: TPInfo, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; `out_sizes` lists merged shards (q, k, v).

    Each shard is split on its own, so rank r holds [q_r; k_r; v_r] and one matmul serves all three.
    `ranges` gives this rank's (start, size) rows of each shard where an even split does not fit
    (attention heads: see ModelConfig.heads_of).
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPInfo = TPInfo(),
                 ranges: list[tuple[int, int]] | None = None, kernels: Kernels | None = None):
        super().__init__()
        self.tp = tp
        self.kernels = kernels or Kernels()
        if ranges is None:
            ranges = [(tp.rank * n, n) for n in (_divide(s, tp, "output size") for s in out_sizes)]
        self.ranges = ranges
        self.local_sizes = [n for _, n in ranges]
        self.weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        """Copy this rank's rows of merged shard `shard` (the checkpoint's unsplit tensor) into place."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise KeyError(f"checkpoint has a {name!r} this layer was built without")
        start, size = self.ranges[shard]
        offset = sum(self.local_sizes[:shard])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, start, size))
        cpu_kernels.invalidate(param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul(x, self.weight, self.bias, self.kernels)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums meet in an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPInfo = TPInfo(),
                 in_range: tuple[int, int] | None = None, kernels: Kernels | None = None):
        super().__init__()
        self.tp = tp
        self.kernels = kernels or Kernels()
        n = _divide(in_features, tp, "input size") if in_range is None else in_range[1]
        self.in_start, self.local_in = in_range if in_range is not None else (tp.rank * n, n)
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        if name == "bias":
            if self.bias is None:
                raise KeyError(f"checkpoint has a {name!r} this layer was built without")
            self.bias.data.copy_(whole(loaded))
            return
        self.weight.data.copy_(loaded.narrow(1, self.in_start, self.local_in))
        cpu_kernels.invalidate(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._finish(matmul(x, self.weight, None, self.kernels))

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) of a fused [T, 2I] gate-up; one kernel (GEMV reading gate-up) at T == 1."""
        ops = _gemv_ops(gate_up, self.weight, self.kernels)
        if ops is None:
            return self.forward(silu_and_mul(gate_up, self.kernels))
        return self._finish(ops.gemv(gate_up.contiguous(), self.weight, act_mul=True, pdl=self.kernels.pdl))

    def _finish(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial products, then add the (unsplit) bias once."""
        y = all_reduce(partial, self.tp)
        return y + self.bias if self.bias is not None else y
