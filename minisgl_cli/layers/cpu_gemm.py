"""CPU GEMM choice for linear layers: pre-packed oneDNN / MKL / fbgemm weights, picked per batch size.

MKL's plain sgemm is slow on small-M (decode) shapes on AMD CPUs; oneDNN with a weight packed once
is 2-3x faster for 2 <= M <= 64. Packs are built lazily on first CPU use and cached on the weight
Parameter itself, so tied weights (embedding / LM head) share one pack; `invalidate` drops them
when a loader overwrites the weight in place.

Policies (the engine's `Kernels.cpu_gemm`, from `MINISGL_CPU_GEMM`; --deterministic takes `invariant`):
  auto       fp32, the default: MKL for M == 1 and large M, packed oneDNN in between; bf16 weights (--dtype
             bfloat16, where the CPU has AVX-512 BF16): packed oneDNN at every M (faster than F.linear's). A model
             with int4 / int8 weights takes `invariant` for it (`for_quantized`).
  invariant  packed oneDNN at every M for fp32 too: each row's result whatever the other rows (MKL's blocking,
             and the switch between the two, change a row's rounding with M).
  mkl        fp32: always F.linear (MKL sgemm), torch's stock path.
  fp16       opt-in, NOT bit-faithful: fbgemm fp16 weights with fp32 activations/accumulation (half the
             weight bytes); greedy output may drift from the fp32 reference.

Packed oneDNN runs one row as two (the row twice): its one-row kernel sums in another order than its kernel for
more rows, and a prompt's last token must come out the same whether it is prefilled with the rest or extended
alone after a prefix hit. Two rows cost what one does (the step reads the weight either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POLICIES = ("auto", "invariant", "mkl", "fp16")
_ONEDNN_MAX_M = 64  # above this MKL's sgemm is already efficient (prefill)


# torch.bfloat16 where oneDNN runs bf16 natively (AVX-512 BF16 / AMX), else None. A constant, not a cached function:
# torch.compile traces `linear` (the compiled CPU decode) and warns about a functools cache in its path.
_BF16_NATIVE: torch.dtype | None = torch.bfloat16 if torch.cpu._is_avx512_bf16_supported() else None


def for_quantized(policy: str) -> str:
    """The policy of a model with int4 / int8 weights: `auto` is `invariant` there. Those modes promise a row's result
    whatever the rows beside it, and their dense weights (prefill steps, the MoE gate) are fp32 where the CPU lacks
    AVX-512 BF16; an explicit policy stands."""
    return "invariant" if policy == "auto" else policy


def invalidate(weight: torch.Tensor) -> None:
    """Forget the packs of `weight` (call after writing new values into it)."""
    weight.__dict__.pop("_cpu_packs", None)


def _pack(weight: torch.Tensor, kind: str) -> torch.Tensor:
    packs = weight.__dict__.setdefault("_cpu_packs", {})
    if kind not in packs:
        w = weight.detach()
        if kind == "onednn":
            packs[kind] = torch.ops.mkldnn._reorder_linear_weight(w, None)
        else:  # fp16
            packs[kind] = torch.ops.aten.fbgemm_pack_gemm_matrix_fp16(w.contiguous())
    return packs[kind]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, policy: str) -> torch.Tensor:
    """F.linear(x, weight, bias), through the fastest kernel of `policy` for this shape."""
    if x.device.type != "cpu" or policy == "mkl" or weight.dtype not in (torch.float32, _BF16_NATIVE):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if weight.dtype == torch.bfloat16 or policy == "invariant":  # packed oneDNN at every M
        y = _onednn(x2, weight, bias)
    elif policy == "fp16":
        y = torch.ops.aten.fbgemm_linear_fp16_weight_fp32_activation(x2.contiguous(), _pack(weight, "fp16"), bias)
    elif 1 < m <= _ONEDNN_MAX_M:
        y = _onednn(x2, weight, bias)
    else:
        return F.linear(x, weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


def _onednn(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 W^T (+ bias) through the packed oneDNN weight; one row as two (see the module docstring)."""
    rows = x2.expand(2, -1) if x2.shape[0] == 1 else x2
    y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), _pack(weight, "onednn"), bias, "none", [], "")
    return y[: x2.shape[0]]
