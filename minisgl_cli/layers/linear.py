"""Tensor-parallel linear layers: column-split (with merged shards such as QKV, gate-up) and row-split.

Each holds its weight the way its LinearMethod (layers/quant.py) says: dense, int4 / int8 on CPU, or FP8."""

from __future__ import annotations

import torch
from torch import nn

from minisgl_cli.distributed import TPInfo
from minisgl_cli.distributed.comm import all_reduce
from minisgl_cli.distributed.push_rows import Partial
from minisgl_cli.kernels.fp8 import Fp8Rows, KVCache
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.layers.rotary import RopeTable
from minisgl_cli.loader.hf import Weight, whole


def divide(n: int, tp: TPInfo, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's output rows split across ranks; `out_sizes` lists merged shards (q, k, v).

    Each shard is split on its own, so rank r holds [q_r; k_r; v_r] and one matmul serves all three.
    `ranges` gives this rank's (start, size) rows of each shard where an even split does not fit
    (attention heads: see ModelConfig.heads_of).
    """

    weight: torch.Tensor  # [out, in] in the engine dtype, made by the method (layers/quant.py)

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPInfo = TPInfo(),
                 ranges: list[tuple[int, int]] | None = None, kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        super().__init__()
        self.tp = tp
        self.kernels = kernels or Kernels()
        self.method = method or LinearMethod()
        if ranges is None:
            ranges = [(tp.rank * n, n) for n in (divide(s, tp, "output size") for s in out_sizes)]
        self.ranges = ranges
        self.local_sizes = [n for _, n in ranges]
        self.method.create(self, sum(self.local_sizes), in_features)
        self.bias = nn.Parameter(torch.empty(sum(self.local_sizes)), requires_grad=False) if bias else None

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        """Copy this rank's rows of merged shard `shard` (the checkpoint's unsplit tensor) into place."""
        start, size = self.ranges[shard]
        offset = sum(self.local_sizes[:shard])
        if name == "weight":
            self.method.load(self, loaded.narrow(0, start, size), offset)
        elif self.bias is not None:
            self.bias.data.narrow(0, offset, size).copy_(whole(loaded.narrow(0, start, size)))
        else:
            raise KeyError(f"checkpoint has a {name!r} this layer was built without")

    def finish_loading(self) -> None:
        self.method.finish(self)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether forward takes x already quantized per token (kernels/fp8.Fp8Rows: the norm before it writes them)."""
        return self.method.takes_fp8_rows(self, x)

    def forward(self, x: torch.Tensor | Fp8Rows, decode: bool = False) -> torch.Tensor:
        """`decode`: x is a decode step's rows (the method may hold a copy for them: layers/quant.py)."""
        if isinstance(x, Fp8Rows):
            return self.method.apply_fp8_rows(self, x, self.bias)
        return self.method.apply(self, x, self.bias, decode)

    def forward_rope_kv(self, x: torch.Tensor | Fp8Rows, rope: RopeTable, heads: tuple[int, int, int],
                        kv: KVCache) -> torch.Tensor | None:
        """This fused qkv layer's output with RoPE on its q and k heads (heads: Hq, Hkv, D) and k, v stored to `kv`,
        in one kernel where the method has it for x (a decode step's few CUDA rows: the GEMV's epilogue), else None:
        then forward, and the RoPE and the store after it."""
        if isinstance(x, Fp8Rows):
            return None
        return self.method.apply_rope_kv(self, x, self.bias, rope, heads, kv)

    def forward_gate_up_silu(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor | None:
        """silu(gate) * up of this merged [gate; up] layer's output in one kernel where the method has it for x (a
        decode step's few CUDA rows: the GEMV's epilogue), else None: then forward, and the activation after it."""
        halves = len(self.local_sizes) == 2 and self.local_sizes[0] == self.local_sizes[1]
        if isinstance(x, Fp8Rows) or self.bias is not None or not halves:
            return None
        return self.method.apply_gate_up_silu(self, x)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; partial sums meet in an all-reduce."""

    weight: torch.Tensor  # [out, in] in the engine dtype, made by the method (layers/quant.py)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp: TPInfo = TPInfo(),
                 in_range: tuple[int, int] | None = None, kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        super().__init__()
        self.tp = tp
        self.kernels = kernels or Kernels()
        self.method = method or LinearMethod()
        n = divide(in_features, tp, "input size") if in_range is None else in_range[1]
        self.in_start, self.local_in = in_range if in_range is not None else (tp.rank * n, n)
        self.method.create(self, out_features, self.local_in)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        if name == "bias":
            if self.bias is None:
                raise KeyError(f"checkpoint has a {name!r} this layer was built without")
            self.bias.data.copy_(whole(loaded))
            return
        # `full`: a per-channel scale is the whole row's, so this rank's columns hold TP 1's numbers (layers/quant.py)
        self.method.load(self, loaded.narrow(1, self.in_start, self.local_in), 0, full=loaded)

    def finish_loading(self) -> None:
        self.method.finish(self)

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:
        bias = self._own_bias
        return self._sum(self.method.apply(self, x, bias, decode), added=bias is not None)

    def forward_silu_mul(self, gate_up: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """forward(silu(gate) * up) of a fused [T, 2I] gate-up (fused into one kernel where the method can)."""
        return self._sum(self.method.apply_silu_mul(self, gate_up, decode))

    def to_norm(self, x: torch.Tensor, decode: bool = False, silu_mul: bool = False) -> torch.Tensor | Partial:
        """forward (or forward_silu_mul) for an RMSNorm's forward_residual to take: where the TP group has the
        fused all-reduce + RMSNorm and the rows fit, this rank's `Partial` sum, which that norm sums (push_rows.py)."""
        m, bias = self.method, None if silu_mul else self._own_bias
        partial = m.apply_silu_mul(self, x, decode) if silu_mul else m.apply(self, x, bias, decode)
        push = self.tp.push_rows
        if self.bias is None and push is not None and push.takes(partial):
            return Partial(partial, self.tp)
        return self._sum(partial, added=bias is not None)

    @property
    def _own_bias(self) -> torch.Tensor | None:
        """The bias the product itself adds: on one rank, where its kernel adds it before rounding (the GEMV's
        epilogue, cuBLAS's addmm, as transformers' nn.Linear does) instead of a launch of its own after it (gpt-oss's
        o_proj: 24 elementwise kernels a decode step, ~43 us of an H200's 1.97 ms). Split over ranks: None."""
        return self.bias if self.tp.size == 1 else None

    def _sum(self, partial: torch.Tensor, added: bool = False) -> torch.Tensor:
        """Sum the ranks' partial products, then add the (unsplit) bias once, unless the product `added` it."""
        y = all_reduce(partial, self.tp)
        return y + self.bias if self.bias is not None and not added else y
