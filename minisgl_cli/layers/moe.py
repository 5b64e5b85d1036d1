"""Mixture-of-experts block: a softmax top-k gate and stacked, TP-sliced expert weights run as a grouped GEMM.

Each of a layer's E experts is a SiLU-gated MLP. The weights are stacked per layer: `gate_up_proj` [E, 2 I, H]
(every expert's gate rows, then its up rows) and `down_proj` [E, H, I], the layout and names of transformers'
own MoE modules. Under TP every rank holds its slice of every expert's intermediate size, as the dense MLP is
split: gate/up rows (column-parallel), down columns (row-parallel), and one all-reduce after the block.

The computation (`fused_experts`): each token's k (expert, weight) choices flattened to T k rows, sorted by
expert, the token rows gathered in that order, one matmul per expert over its contiguous rows, scaled by the
routing weights and put back in slot order, then summed per token. Where the matmuls run:

  grouped  torch._grouped_mm over the sorted rows with the experts' row offsets on the device: no host sync, so
           CUDA graphs capture it (its CUTLASS kernel: bf16 on SM 9.x / 10.x, torch 2.8+)
  loop     one GEMM per expert that received rows, the offsets read back once a step: the CPU path (reading
           them costs nothing there), through the dense linears' packed GEMMs (`Experts.dense_matmul`) or, for
           a decode step under int4 / int8, the experts' low-bit copies (`Experts.decode_matmul`)

On CUDA with the fused ops on (16-bit activations) the whole block but the gate's linear runs in Triton instead
(kernels/triton/moe.py: routing, block alignment, gate/up with SiLU fused, down with the routing weights) up to
its FUSED_MAX_TOKENS, and at every size for FP8 experts or where torch's grouped kernel is missing, so decode is
graph-safe there too.

gpt-oss's experts (`SwiGLU`): a bias after each projection and the clamped SwiGLU in place of SiLU-and-mul, its
gate's bias, and its routing (a softmax over the k largest logits, which is the softmax top-k renormalized); on the
fused Triton path (16-bit experts, its MXFP4 checkpoints' experts kept packed on CUDA, or FP8 ones) the kernels add
the biases and apply that activation (kernels/triton/moe.py `SwiGLUExperts`).

DeepSeek's blocks (`GroupedRouting`, layers/routing.py): the router's logits in fp32 from an fp32 gate, sigmoid or
softmax scores, grouped top-k with V3's correction bias for the choice only, the routed scaling factor
(`route_grouped`), and shared experts: a dense MLP the model hands in, added to the routed experts' sum. They take
the torch paths (the fused Triton experts route by softmax themselves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.distributed import TPInfo
from minisgl_cli.distributed.comm import all_reduce
from minisgl_cli.kernels.fp8 import (
    FP8,
    Fp8Rows,
    dequantize,
    dequantize_groups,
    quantize,
    quantize_groups,
    round_trip_rows,
    row_scales,
)
from minisgl_cli.kernels.triton.moe_tiles import fp8_act
from minisgl_cli.layers import cpu_gemm
from minisgl_cli.layers.activation import silu_and_mul
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import divide
from minisgl_cli.layers.norm import Terms
from minisgl_cli.layers.quant import LinearMethod, gemv_ops
from minisgl_cli.layers.routing import GroupedRouting
from minisgl_cli.loader.blocks import Fp8Blocks, Int4Groups, Int8Groups, quantize_fp8_blocks
from minisgl_cli.loader.hf import Weight, whole
from minisgl_cli.loader.mxfp4 import BLOCK as MXFP4_BLOCK
from minisgl_cli.loader.mxfp4 import dequantize as mxfp4_dequantize

# Checkpoint names of one expert's projections: Qwen3-MoE's and Mixtral's (w1 gate, w3 up, w2 down).
EXPERT_PROJ = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
               "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class SwiGLU:
    """gpt-oss's expert activation, as transformers computes it on its [gate, up] halves: the gate clamped above at
    `limit`, the up both ways, then gate * sigmoid(alpha * gate) * (up + 1)."""

    limit: float
    alpha: float

    def __call__(self, gate_up: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up.clamp(-self.limit, self.limit) + 1)


Activation = Callable[[torch.Tensor, Kernels], torch.Tensor]  # [rows, 2I] gate and up -> [rows, I]


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k]): softmax over the experts in fp32, the k largest, renormalized to
    sum to 1 where the model says so (Qwen3-MoE's norm_topk_prob; Mixtral always); `topk_first` (gpt-oss): the k
    largest logits, then a softmax over them (the same weights, rounded as transformers rounds them)."""
    if topk_first:
        top, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(logits: torch.Tensor, top_k: int, r: GroupedRouting, bias: torch.Tensor | None,
                  ops: ModuleType | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] ascending): DeepSeek's choice from fp32 `logits` [T, E], step for step
    as transformers computes it (see GroupedRouting); `bias`: V3's e_score_correction_bias [E]. With the Triton
    `ops`, everything after the scores in one launch (kernels/triton/moe.py's route_grouped) instead of ~15 small
    ones, its ids int32 (as the fused experts take them)."""
    scores = logits.sigmoid() if r.scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)
    if ops is not None:
        w, ids = ops.moe_route_grouped(scores.contiguous(), top_k, bias, r.n_group, r.topk_group,
                                       r.group_score == "top2_sum", float("-inf") if r.scoring == "sigmoid" else 0.0,
                                       r.renormalize, r.routed_scaling_factor)
        return w, ids
    choice = scores + bias if bias is not None else scores
    if r.n_group > 1 or r.group_score == "top2_sum":  # V3 scores its groups even when there is one
        n_tok, n_exp = choice.shape
        grouped = choice.view(n_tok, r.n_group, n_exp // r.n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if r.group_score == "top2_sum" else grouped.amax(-1)
        group_idx = torch.topk(group_scores, k=r.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        keep = keep[:, :, None].expand(grouped.shape).reshape(n_tok, n_exp)
        # V3 masks the biased scores to -inf, V2 its scores to 0 (as each of transformers' routers does)
        choice = choice.masked_fill(~keep, float("-inf") if r.scoring == "sigmoid" else 0.0)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if r.renormalize:  # summed in topk's order, as transformers sums them
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    ids, order = ids.sort(dim=-1)  # each token's experts ascending: the order its terms are summed in
    return (weights * r.routed_scaling_factor).gather(1, order), ids


def grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the experts run as torch._grouped_mm's device kernel there (no host sync: CUDA graphs capture it)."""
    # torch's CUTLASS kernel is built for Hopper and datacenter Blackwell; elsewhere _grouped_mm is a host loop.
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


def triton_experts(x: torch.Tensor, kernels: Kernels, fp8: bool = False) -> ModuleType | None:
    """The Triton ops when the experts of a step with activations `x` [T, H] take the fused path
    (kernels/triton/moe.py), else None. FP8 and MXFP4 experts (`fp8`: quantized ones) take it at every size (the
    grouped GEMM would need them dequantized per call)."""
    ops = kernels.triton(x)
    if ops is None or x.dtype not in (torch.bfloat16, torch.float16):  # fp32's tl.dot would round through tf32
        return None
    if fp8 or x.shape[0] <= ops.MOE_FUSED_MAX_TOKENS or not grouped_mm_runs(x.device, x.dtype):
        return ops
    return None


def fp8_expert_blocks(method: LinearMethod, intermediate_size: int, tp: TPInfo) -> tuple[int, int] | None:
    """The blocks a block-wise FP8 checkpoint's experts keep (layers/quant.py's fp8-block), or None where they load
    dense: another method, or a TP rank's share of an expert's width that splits a block."""
    block: tuple[int, int] | None = getattr(method, "block", None) if method.name == "fp8-block" else None
    if block is None or intermediate_size % tp.size:
        return None
    n = intermediate_size // tp.size
    return None if n % block[0] or n % block[1] else block


ExpertMatmul = Callable[[int, str, torch.Tensor], torch.Tensor]  # (expert, "gate_up" | "down", rows) -> rows W^T


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, kernels: Kernels, grouped: bool, fp8_rows: bool = False,
                  matmul: ExpertMatmul | None = None, act_fn: Activation = silu_and_mul,
                  biases: tuple[torch.Tensor, torch.Tensor] | None = None, fp8_groups: int = 0) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for each token t: [T, H].

    gate_up [E, 2I, H], down [E, H, I]; `grouped`: one torch._grouped_mm per projection (see the module docstring),
    else one F.linear per expert that received rows (`matmul`, where given, in its place: `Experts.dense_matmul`
    or `decode_matmul`). Every shape is static but the loop's. `fp8_rows`: the inputs of both projections through
    e4m3 per row and back (the w8a8 kernels' activations, simulated); `fp8_groups`: per row per that many columns
    (block-wise FP8 experts' w8a8)."""
    def act(t: torch.Tensor) -> torch.Tensor:
        if fp8_groups:
            return dequantize_groups(*quantize_groups(t, fp8_groups), fp8_groups).to(t.dtype)
        return round_trip_rows(t).to(t.dtype) if fp8_rows else t

    x = act(x)
    n_tok, k = ids.shape
    n_exp = gate_up.shape[0]
    flat = ids.flatten()
    order = flat.argsort(stable=True)  # slots grouped by expert, tokens ascending within each
    row_expert = flat[order]  # each sorted row's expert
    # ends[e]: one past expert e's last sorted row (searchsorted, not bincount: CUDA's bincount reads its max back)
    ends = torch.searchsorted(row_expert, torch.arange(1, n_exp + 1, device=flat.device, dtype=flat.dtype))
    rows = x[order // k]
    if grouped:
        offs = ends.to(torch.int32)
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
        if biases is not None:
            h = h + biases[0][row_expert]
        y = torch._grouped_mm(act(act_fn(h, kernels)), down.transpose(1, 2), offs=offs)
        if biases is not None:
            y = y + biases[1][row_expert]
    else:
        def linear(e: int, proj: str, t: torch.Tensor) -> torch.Tensor:
            return F.linear(t, gate_up[e] if proj == "gate_up" else down[e])

        mm = matmul or linear
        y = torch.empty_like(rows)
        start = 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                h = mm(e, "gate_up", rows[start:end])
                if biases is not None:
                    h = h + biases[0][e]
                y[start:end] = mm(e, "down", act(act_fn(h, kernels)))
                if biases is not None:
                    y[start:end] += biases[1][e]
            start = end
    y = y * weights.flatten()[order, None].to(y.dtype)
    # Back to slot order, then each token's k contributions summed: no atomics, so the sum is deterministic.
    return torch.empty_like(y).index_copy_(0, order, y).view(n_tok, k, -1).sum(dim=1)


class Gate(nn.Module):
    """The gate: logits over the experts from the hidden state, replicated on every rank (E x H is small)."""

    def __init__(self, hidden_size: int, num_experts: int, kernels: Kernels, bias: bool = False,
                 routing: GroupedRouting | None = None):
        """`routing` (DeepSeek): the weight kept fp32 (as transformers keeps it), and V3's correction bias."""
        super().__init__()
        self.kernels = kernels
        dtype = torch.float32 if routing is not None else None
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if bias else None  # gpt-oss
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
            if routing is not None and routing.correction_bias else None)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        param = {"weight": self.weight, "bias": self.bias,
                 "e_score_correction_bias": self.e_score_correction_bias}.get(name)
        if param is None:
            raise KeyError(f"checkpoint has a gate {name!r} this gate was built without")
        param.data.copy_(whole(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = gemv_ops(x, self.weight, self.kernels)  # batch-1 decode on CUDA: the Triton GEMV
        if ops is not None:
            return ops.gemv(x.contiguous(), self.weight, self.bias, pdl=self.kernels.pdl)
        return cpu_gemm.linear(x, self.weight, self.bias, self.kernels.cpu_gemm)  # on CPU: as the dense linears


class _DecodeCopy(nn.Module):
    """One expert matrix's int4 / int8 copy for decode steps (buffers `qweight`, `qscale`; `weight`: the dense view)."""


class Experts(nn.Module):
    """Every expert's gate/up and down weights, stacked; this rank's slice of each expert's intermediate size.

    `fp8` (--quantization fp8): e4m3 codes with an fp32 scale per output row (`gate_up_scale` [E, 2I],
    `down_scale` [E, H]), each matrix quantized as it loads. The Triton kernels run them w8a16 (the codes widened
    in the tile) or, from `moe_tiles.W8A8_MIN_TOKENS` tokens, w8a8 (activations per token to e4m3). The torch
    paths (the CPU, the fused ops off) multiply by the dequantized weights (`dense`), the activations through
    e4m3 and back where the kernels would run w8a8: the same numbers, simulated.

    `copies` (--quantization int4 / int8, the CPU): once loaded, each expert matrix also gets the method's low-bit
    copy, which decode steps multiply by: a GGUF's own blocks where it shipped them, else quantized from the dense
    matrix (as a linear layer's are); prefill steps keep the dense weights (layers/quant.py says why).

    `mxfp4` (an MXFP4 checkpoint on CUDA, layers/quant.py's mxfp4): the checkpoint's bytes and exponents as shipped
    (loader/mxfp4.py), rows de-interleaved into gate then up: `gate_up_proj` uint8 [E, 2I, H / 2] with
    `gate_up_scale` uint8 [E, 2I, H / 32], `down_proj` [E, H, I / 2] with `down_scale` [E, H, I / 32]; the Triton
    kernels widen them in registers (w4a16), the torch paths (the fused ops off) multiply by them dequantized per
    call (`dense`).

    `fp8_block` (bn, bk) (a block-wise FP8 checkpoint on CUDA 8.9+, layers/quant.py's fp8-block: DeepSeek-V3's): e4m3
    codes as shipped with an fp32 scale per bn x bk block, `gate_up_scale` [E, 2I / bn, H / bk] (gate's row blocks,
    then up's), `down_scale` [E, H / bn, I / bk]; each TP rank's rows and columns whole blocks (else the model keeps
    its experts dense). The Triton kernels scale each K step's dot by its blocks' scales: w8a16 below
    `moe_tiles.W8A8_MIN_TOKENS` tokens, from there w8a8 with the activations per token per bk columns (as the dense
    block-FP8 linears take them); the torch paths multiply by the dequantized blocks, the activations through e4m3
    per group and back where the kernels would run w8a8."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPInfo, fp8: bool = False,
                 copies: LinearMethod | None = None, bias: bool = False, mxfp4: bool = False,
                 fp8_block: tuple[int, int] | None = None):
        super().__init__()
        self.local = n = divide(intermediate_size, tp, "moe intermediate size")
        if fp8_block is not None and (n % fp8_block[0] or n % fp8_block[1]):
            raise ValueError(f"block-wise FP8 experts need a TP rank's width ({n}) in whole {fp8_block} blocks")
        if mxfp4 and (n % MXFP4_BLOCK or hidden_size % MXFP4_BLOCK):
            raise ValueError(f"MXFP4 experts stay packed where their widths are whole {MXFP4_BLOCK}-value blocks, not "
                             f"{n} (a TP rank's) by {hidden_size}: use --quantization none")
        self.start = tp.rank * n
        self.tp = tp
        # gpt-oss: [E, 2I] (this rank's gate and up rows) and [E, H] (rank 0 holds it: added once before the
        # all-reduce, zeros elsewhere)
        self.gate_up_bias = self.down_bias = None
        if bias:
            self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * n), requires_grad=False)
            self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size), requires_grad=False)
        self.fp8 = fp8
        self.mxfp4 = mxfp4
        self.fp8_block = fp8_block
        self.copies = copies if copies is not None and copies.decode_copy else None
        self.gate_up_copies = self.down_copies = None
        self._blocks: dict[tuple[int, str], Int4Groups | Int8Groups] = {}  # (expert, proj): a GGUF's, until copied
        self._down_rows: dict[int, Weight] = {}  # expert: its whole down_proj, whose rows give the int8 copy's scales
        self._views: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None  # see dense_matmul
        self._dense: tuple[torch.Tensor, torch.Tensor] | None = None  # FP8 experts dequantized once on the CPU
        # the stored widths and element type: MXFP4 bytes and their exponents, e4m3 codes, or the engine dtype
        dtype, per = (torch.uint8, 2) if mxfp4 else (FP8 if fp8 or fp8_block else None, 1)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * n, hidden_size // per, dtype=dtype),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, n // per, dtype=dtype), requires_grad=False)
        self.gate_up_scale = self.down_scale = None
        if mxfp4:  # bytes and exponents, as shipped (see the class docstring)
            b, u8 = MXFP4_BLOCK, torch.uint8
            self.gate_up_scale = nn.Parameter(torch.empty(num_experts, 2 * n, hidden_size // b, dtype=u8),
                                              requires_grad=False)
            self.down_scale = nn.Parameter(torch.empty(num_experts, hidden_size, n // b, dtype=u8), requires_grad=False)
        if fp8_block is not None:
            bn, bk = fp8_block
            self.gate_up_scale = nn.Parameter(torch.ones(num_experts, 2 * n // bn, -(-hidden_size // bk),
                                                         dtype=torch.float32), requires_grad=False)
            self.down_scale = nn.Parameter(torch.ones(num_experts, -(-hidden_size // bn), n // bk,
                                                      dtype=torch.float32), requires_grad=False)
        if fp8:
            self.gate_up_scale = nn.Parameter(torch.ones(num_experts, 2 * n, dtype=torch.float32), requires_grad=False)
            self.down_scale = nn.Parameter(torch.ones(num_experts, hidden_size, dtype=torch.float32),
                                           requires_grad=False)

    @property
    def quantized(self) -> bool:
        """Whether the experts hold codes (FP8 rows or blocks, MXFP4) the fused kernels take at every batch size."""
        return self.fp8 or self.mxfp4 or self.fp8_block is not None

    def load_expert(self, expert: int, proj: str, loaded: Weight) -> None:
        """One checkpoint matrix of expert `expert` (`proj`: gate_proj [I, H], up_proj [I, H], down_proj [H, I]):
        only this rank's rows or columns are read."""
        n, start = self.local, self.start
        part = loaded.narrow(1, start, n) if proj == "down_proj" else loaded.narrow(0, start, n)
        if self.fp8_block is not None:
            row = 0 if proj in ("gate_proj", "down_proj") else n
            self._put_blocks(self.down_proj if proj == "down_proj" else self.gate_up_proj,
                             self.down_scale if proj == "down_proj" else self.gate_up_scale, expert, row, part)
            return
        if proj == "down_proj":  # a per-row scale is the whole row's, as TP 1 holds it (layers/quant.py's `full`)
            self._put(self.down_proj, self.down_scale, expert, slice(None), whole(part), full=loaded)
            if self.copies is not None:
                self._down_rows[expert] = loaded
        else:
            row = 0 if proj == "gate_proj" else n
            self._put(self.gate_up_proj, self.gate_up_scale, expert, slice(row, row + n), whole(part))
        if self.copies is not None and isinstance(part, Int4Groups | Int8Groups):  # a GGUF's blocks: the copy's
            self._blocks[(expert, proj)] = part

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        """gpt-oss's stacked experts as its checkpoints carry them: `gate_up_proj` [E, H, 2I] with gate and up
        interleaved (even columns gate), `down_proj` [E, I, H], and their `_bias`es ([E, 2I] interleaved, [E, H]);
        MXFP4 experts kept packed: their `_blocks` and `_scales` instead of the projections."""
        n, start = self.local, self.start
        if self.mxfp4 and name.endswith(("_blocks", "_scales")):
            self._load_packed(name, loaded)
            return
        if self.mxfp4 and name in ("gate_up_proj", "down_proj"):
            raise KeyError(f"checkpoint expert tensor {name!r} is dense but these experts hold MXFP4 bytes")
        w = whole(loaded)
        if name in ("gate_up_proj", "gate_up_proj_bias"):
            gate, up = w[..., 0::2], w[..., 1::2]  # [E, (H,) I] each
            mine = torch.cat((gate[..., start:start + n], up[..., start:start + n]), dim=-1)
            if name == "gate_up_proj_bias" and self.gate_up_bias is not None:
                self.gate_up_bias.data.copy_(mine)
                return
            if name == "gate_up_proj":
                for e in range(mine.shape[0]):
                    self._put(self.gate_up_proj, self.gate_up_scale, e, slice(None), mine[e].t())
                return
        if name == "down_proj":
            for e in range(w.shape[0]):
                self._put(self.down_proj, self.down_scale, e, slice(None), w[e, start:start + n].t(), full=w[e].t())
            return
        if name == "down_proj_bias" and self.down_bias is not None:
            if self.tp.rank == 0:
                self.down_bias.data.copy_(w)
            return
        if name.endswith(("_blocks", "_scales")):
            raise KeyError(f"checkpoint expert tensor {name!r} is MXFP4 but config.json's quantization_config "
                           "does not say quant_method mxfp4 (loader/mxfp4.py)")
        raise KeyError(f"checkpoint has an experts tensor {name!r} this layer was built without")

    def _load_packed(self, name: str, loaded: Weight) -> None:
        """An MXFP4 part as loader/mxfp4.py yields it (checked): bytes [E, rows, G, 16] or exponents [E, rows, G] of
        gate/up (rows interleaved, even ones gate: this rank's gate rows, then its up rows) or down (this rank's
        blocks of each row)."""
        n, start, b = self.local, self.start, MXFP4_BLOCK
        proj, part = name.rsplit("_", 1)
        dst = {("gate_up_proj", "blocks"): self.gate_up_proj, ("gate_up_proj", "scales"): self.gate_up_scale,
               ("down_proj", "blocks"): self.down_proj, ("down_proj", "scales"): self.down_scale}.get((proj, part))
        if dst is None:
            raise KeyError(f"checkpoint has an MXFP4 experts tensor {name!r} this layer was built without")
        if proj == "down_proj":
            w = whole(loaded.narrow(2, start // b, n // b))
        else:
            w = whole(loaded)
            w = torch.cat((w[:, 0::2][:, start:start + n], w[:, 1::2][:, start:start + n]), dim=1)
        dst.data.copy_(w.flatten(2) if part == "blocks" else w)

    def _put_blocks(self, param: nn.Parameter, scale: nn.Parameter | None, expert: int, row: int, w: Weight) -> None:
        """w into the expert's rows from `row` as e4m3 blocks: a checkpoint's own (Fp8Blocks, this rank's part of
        them), else (a dense tensor: dummy weights, a bf16 checkpoint) quantized into blocks as DeepSeek's were."""
        assert self.fp8_block is not None and scale is not None
        if not (isinstance(w, Fp8Blocks) and w.block == self.fp8_block):
            w = quantize_fp8_blocks(whole(w).to(param.device), self.fp8_block)
        param.data[expert].narrow(0, row, w.q.shape[0]).copy_(w.q)
        scale.data[expert].narrow(0, row // self.fp8_block[0], w.scale_inv.shape[0]).copy_(w.scale_inv)

    @staticmethod
    def _put(param: nn.Parameter, scale: nn.Parameter | None, expert: int, rows: slice, w: torch.Tensor,
             full: Weight | None = None) -> None:
        """w into the expert's rows; fp8 (`scale`): as e4m3 codes by each row's scale (of `full`'s rows where w is
        some of their columns)."""
        if scale is None:
            param.data[expert, rows].copy_(w)
            return
        w = w.to(param.device)
        s = row_scales(w if full is None else whole(full).to(param.device))
        codes = quantize(w, s)
        param.data[expert, rows].copy_(codes)
        scale.data[expert, rows].copy_(s[:, 0])

    def finish_loading(self) -> None:
        """Every expert in: build the decode copies (int4 / int8)."""
        if self.copies is None:
            return
        blocks = self._blocks
        for name, stacked, projs in (("gate_up_copies", self.gate_up_proj, ("gate_proj", "up_proj")),
                                     ("down_copies", self.down_proj, ("down_proj",))):
            held = nn.ModuleList(_DecodeCopy() for _ in range(stacked.shape[0]))
            for e, holder in enumerate(held):
                shipped = [blocks[(e, p)] for p in projs if (e, p) in blocks]
                full = self._down_rows.get(e) if name == "down_copies" else None
                self.copies.low_bit_copy(holder, stacked.data[e], shipped if len(shipped) == len(projs) else None, full)
            setattr(self, name, held)
        blocks.clear()
        self._down_rows.clear()

    def dense_matmul(self, kernels: Kernels) -> ExpertMatmul | None:
        """The torch loop's multiply by the dense experts on the CPU: the dense linears' GEMMs (layers/cpu_gemm.py:
        in the quantized modes a row's result whatever the rows beside it, so an expert's share of a prompt's rows
        gives a token the same value cold or after a prefix hit), each matrix a view kept for its cached pack."""
        if self.gate_up_proj.device.type != "cpu" or self.quantized:
            return None
        if self._views is None:  # made once loaded (the first call), kept: the packs are cached by the view
            self._views = (self.gate_up_proj.data.unbind(0), self.down_proj.data.unbind(0))
        views = self._views

        def mm(e: int, proj: str, x: torch.Tensor) -> torch.Tensor:
            return cpu_gemm.linear(x, views[0][e] if proj == "gate_up" else views[1][e], None, kernels.cpu_gemm)

        return mm

    def decode_matmul(self) -> ExpertMatmul | None:
        """The decode steps' multiply by the low-bit copies, or None without copies."""
        method, gate_up, down = self.copies, self.gate_up_copies, self.down_copies
        if method is None or gate_up is None or down is None:
            return None

        def mm(e: int, proj: str, x: torch.Tensor) -> torch.Tensor:
            return method.apply(gate_up[e] if proj == "gate_up" else down[e], x, None, decode=True)

        return mm

    def dense(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) in `dtype` for the torch paths: the weights, or FP8's dequantized (kept on the CPU,
        rebuilt per call on CUDA, where the fused kernels read the codes themselves), or MXFP4's (per call: CUDA)."""
        if self.fp8_block is not None:  # per call (CUDA only)
            assert self.gate_up_scale is not None and self.down_scale is not None
            return tuple(torch.stack([Fp8Blocks(q, s, self.fp8_block).dequantize(dtype) for q, s in zip(w, sc)])
                         for w, sc in ((self.gate_up_proj, self.gate_up_scale),
                                       (self.down_proj, self.down_scale)))  # type: ignore[return-value]
        if self.mxfp4:
            assert self.gate_up_scale is not None and self.down_scale is not None
            return tuple(mxfp4_dequantize(w.unflatten(-1, (-1, MXFP4_BLOCK // 2)), s, dtype)  # type: ignore[return-value]
                         for w, s in ((self.gate_up_proj, self.gate_up_scale), (self.down_proj, self.down_scale)))
        if not self.fp8:
            return self.gate_up_proj, self.down_proj
        if self._dense is not None and self._dense[0].dtype == dtype:
            return self._dense
        assert self.gate_up_scale is not None and self.down_scale is not None
        pair = (dequantize(self.gate_up_proj, self.gate_up_scale[..., None], dtype),
                dequantize(self.down_proj, self.down_scale[..., None], dtype))
        if self.gate_up_proj.device.type == "cpu":
            self._dense = pair
        return pair


class MoE(nn.Module):
    """The sparse MLP of one decoder layer: route each token to its top-k experts, run them, all-reduce."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 tp: TPInfo, kernels: Kernels, fp8: bool = False, copies: LinearMethod | None = None,
                 swiglu: SwiGLU | None = None, routing: GroupedRouting | None = None,
                 shared_experts: nn.Module | None = None, mxfp4: bool = False,
                 fp8_block: tuple[int, int] | None = None):
        """`swiglu`: gpt-oss's experts (its activation, biases, the gate's bias and its routing); `routing`: DeepSeek's
        router; `shared_experts`: a dense MLP (forward(x, decode), TP-split like the experts) added to their sum;
        `mxfp4`, `fp8_block`: the experts kept as an MXFP4 or a block-wise FP8 checkpoint ships them (Experts)."""
        super().__init__()
        self.top_k, self.renormalize, self.tp, self.kernels = top_k, renormalize, tp, kernels
        self.swiglu = swiglu
        self.routing = routing
        self.gate = Gate(hidden_size, num_experts, kernels, bias=swiglu is not None, routing=routing)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, tp, fp8, copies, bias=swiglu is not None,
                               mxfp4=mxfp4, fp8_block=fp8_block)
        self.shared_experts = shared_experts

    def _swiglu_experts(self, ops: ModuleType) -> Any:
        """gpt-oss's biases and activation as the Triton experts take them (None for SiLU experts)."""
        e, s = self.experts, self.swiglu
        if s is None or e.gate_up_bias is None or e.down_bias is None:
            return None
        return ops.SwiGLUExperts(e.gate_up_bias, e.down_bias, s.limit, s.alpha)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return False  # the experts take 16-bit activations (FP8 experts too): the norm before them writes plain rows

    def forward(self, x: torch.Tensor | Fp8Rows, decode: bool = False) -> torch.Tensor | Terms:
        """`decode`: a decode step's rows, which take the experts' int4 / int8 copies where they have them."""
        assert isinstance(x, torch.Tensor)  # takes_fp8_rows said no
        e = self.experts
        ops = triton_experts(x, self.kernels, e.quantized)
        if self.routing is not None:
            logits = F.linear(x.float(), self.gate.weight.float())  # fp32, as transformers' DeepSeek routers
            weights, ids = route_grouped(logits, self.top_k, self.routing, self.gate.e_score_correction_bias, ops)
            if ops is not None:  # DeepSeek's own choice through the fused kernels
                y = ops.moe_fused(x, e.gate_up_proj, e.down_proj, weights, ids.to(torch.int32), e.gate_up_scale,
                                  e.down_scale, pdl=self.kernels.pdl and e.gate_up_scale is None, block=e.fp8_block)
                return self._plus_shared(all_reduce(y, self.tp), x, decode)
        elif ops is not None:  # one rank: the choices' terms left for the next norm to sum (layers/norm.py)
            # gpt-oss's softmax over its k largest logits is the renormalized softmax top-k
            y = ops.moe_routed(x, self.gate(x), e.gate_up_proj, e.down_proj, self.top_k,
                               self.renormalize or self.swiglu is not None, e.gate_up_scale, e.down_scale,
                               self.kernels.pdl, terms=True, swiglu=self._swiglu_experts(ops), block=e.fp8_block)
            return Terms(y) if self.tp.size == 1 else all_reduce(y.sum(dim=1), self.tp)
        else:
            weights, ids = route(self.gate(x), self.top_k, self.renormalize, topk_first=self.swiglu is not None)
        matmul = (e.decode_matmul() if decode else None) or e.dense_matmul(self.kernels)
        biases = None if e.gate_up_bias is None or e.down_bias is None else (e.gate_up_bias, e.down_bias)
        y = fused_experts(x, *e.dense(x.dtype), weights, ids, self.kernels,
                          grouped_mm_runs(x.device, x.dtype) and matmul is None,
                          fp8_rows=e.fp8 and fp8_act(x.shape[0]), matmul=matmul, act_fn=self.swiglu or silu_and_mul,
                          biases=biases, fp8_groups=e.fp8_block[1] if e.fp8_block and fp8_act(x.shape[0]) else 0)
        return self._plus_shared(all_reduce(y, self.tp), x, decode)

    def _plus_shared(self, y: torch.Tensor, x: torch.Tensor, decode: bool) -> torch.Tensor:
        """The routed experts' all-reduced sum plus the shared experts' output, where the model has them."""
        if self.shared_experts is None:
            return y
        shared = self.shared_experts(x, decode)
        return y + (shared if isinstance(shared, torch.Tensor) else all_reduce(shared.rows, self.tp))  # a Partial
