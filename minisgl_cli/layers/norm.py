"""RMSNorm computed in fp32 exactly as HF transformers does, so greedy outputs match token for token.

Where the engine's decode may run compiled (Kernels.ordered_sums: the int4 / int8 CPU modes) the mean square is a
cumsum's last entry instead of a mean: inductor would generate its own reduction for a mean, whose order of sums
rounds unlike ATen's now and then (enough to flip a greedy token), while it calls ATen's cumsum as it is, so the
compiled step (cpu_step/compiled.py) and eager normalize bit for bit alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import nn

from minisgl_cli.distributed.comm import all_reduce
from minisgl_cli.distributed.push_rows import Partial
from minisgl_cli.kernels.fp8 import Fp8Rows
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.loader.hf import Weight, whole


@dataclass
class Terms:
    """A layer's output rows still as k terms each, [T, k, hidden] contiguous, for the norm after it to sum in its
    own launch (the MoE experts' per-choice outputs on CUDA): one kernel a layer less than summing them apart."""

    terms: torch.Tensor

    @property
    def rows(self) -> torch.Tensor:
        """A [T, hidden] view with the summed rows' shape, dtype and device (the first terms' values)."""
        return self.terms[:, 0]

    def select(self, idx: torch.Tensor) -> Terms:
        return Terms(self.terms[idx])

    def summed(self) -> torch.Tensor:
        return self.terms.sum(dim=1)


LayerOut = torch.Tensor | Partial | Terms  # a decoder layer's output, summed or left for the next norm to sum


def rows_of(x: LayerOut) -> torch.Tensor:
    """The rows a layer's output holds, summed or not yet (their shape, dtype, device alike)."""
    return x if isinstance(x, torch.Tensor) else x.rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, kernels: Kernels | None = None):
        super().__init__()
        self.eps = eps
        self.kernels = kernels or Kernels()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        self.weight.data.copy_(whole(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sgl = self.kernels.sgl_ops(x)
        if sgl is not None:  # 2-D rows only: q/k head norms come as [T, heads, D]
            return sgl.rmsnorm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        ops = self.kernels.triton(x)
        if ops is not None:
            return ops.rmsnorm(x, self.weight, self.eps, pdl=self.kernels.pdl)
        h = x.float()
        if self.kernels.ordered_sums:  # cumsum: one ATen kernel, summing in order, that inductor calls as it is
            mean_sq = h.pow(2).cumsum(-1)[..., -1:] / h.shape[-1]
        else:
            mean_sq = h.pow(2).mean(-1, keepdim=True)
        return self.weight * (h * torch.rsqrt(mean_sq + self.eps)).to(x.dtype)

    @overload
    def forward_residual(self, x: LayerOut, residual: torch.Tensor,
                         fp8: Literal[False] = False) -> tuple[torch.Tensor, torch.Tensor]: ...

    @overload
    def forward_residual(self, x: LayerOut, residual: torch.Tensor,
                         fp8: bool) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]: ...

    def forward_residual(self, x: LayerOut, residual: torch.Tensor,
                         fp8: bool = False) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """Add the residual, then normalise: returns (normed, new residual).

        The fused CUDA kernels update `residual` in place (callers own it; sgl_kernel's `x` too); the torch
        path does not. fp8: the next linear takes rows quantized per token (its `takes_fp8_rows`), which the
        Triton kernel then writes in place of the 16-bit rows; the other paths return the 16-bit rows.
        A `Partial` x (TP: a rank's share of a row-split linear) is summed over the ranks first: in the same
        kernel where the Triton ops run (distributed/push_rows.py), else by the group's all-reduce. `Terms`
        are summed in the Triton kernel too, else by torch."""
        if isinstance(x, Terms):
            ops = self.kernels.triton(x.terms)
            if ops is not None and residual.is_contiguous() and x.terms.is_contiguous():
                normed = ops.rmsnorm(x.terms.view(-1, x.terms.shape[-1]), self.weight, self.eps, residual=residual,
                                     pdl=self.kernels.pdl, quant=fp8, terms=x.terms.shape[1])
                return normed, residual
            x = x.summed()
        if isinstance(x, Partial):
            ops = self.kernels.triton(x.rows)
            if ops is not None and residual.is_contiguous():
                normed = ops.all_reduce_rmsnorm(x.rows, residual, self.weight, self.eps, x.tp.push_rows,
                                                pdl=self.kernels.pdl, quant=fp8)
                return normed, residual
            x = all_reduce(x.rows, x.tp)
        sgl = self.kernels.sgl_ops(x)
        if sgl is not None and x.is_contiguous() and residual.is_contiguous():
            sgl.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        ops = self.kernels.triton(x)
        if ops is not None and residual.is_contiguous():
            normed = ops.rmsnorm(x, self.weight, self.eps, residual=residual, pdl=self.kernels.pdl, quant=fp8)
            return normed, residual
        residual = x + residual
        return self.forward(residual), residual
