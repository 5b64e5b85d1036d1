"""FP8 Triton kernels (CUDA): activations to e4m3 per token for the FP8 GEMM, alone or fused after the MLP's
activation (SiLU-and-mul, or a bias then GELU-tanh).

Each program owns one row, so the row's amax, its scale and its codes come out of one pass over the row
(for `torch._scaled_mm`'s row-wise scaling: codes [M, K] and an fp32 scale per row [M, 1]). `fp8_codes`
is kernels/fp8.py's quantize in Triton (IEEE division), shared with the KV-store kernels, so both give the
same 8-bit codes as the torch code they are tested against. The activation rounds to the input's dtype where
torch's unfused ops round, so the codes are those of `quantize_rows(act(x))`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from minisgl_cli.kernels.fp8 import FP8, INV_MAX, TINY, Act
from minisgl_cli.kernels.triton.pdl import pdl_kwargs


@triton.jit
def fp8_codes(x, scale, dtype: tl.constexpr):
    """kernels/fp8.py's quantize: x / scale (IEEE division) clamped to +-448, rounded to e4m3 `dtype`."""
    return tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0).to(dtype)


_GELU_C = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)


@triton.jit
def _quant_rows_kernel(x_ptr, b_ptr, q_ptr, s_ptr, stride_x, stride_q, K, tiny, inv_max,
                       ACT: tl.constexpr, HAS_BIAS: tl.constexpr, EXACT: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_BIAS:  # rounded as the unfused `y + bias` in x's dtype
        x = (x.to(tl.float32) + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
    if ACT == "silu_mul":  # x is [gate | up] of 2K: silu(gate) * up, rounded as kernels/triton/ops.py's silu_and_mul
        u = tl.load(x_ptr + row * stride_x + K + offs, mask=mask, other=0.0)
        xf = x.to(tl.float32)
        act = (xf / (1.0 + tl.exp(-xf))).to(x.dtype).to(tl.float32)
        x = (act * u.to(tl.float32)).to(x.dtype)
    if ACT == "gelu_tanh":  # 0.5 x (1 + tanh(c (x + 0.044715 x^3))) = x / (1 + exp(-2 c (x + 0.044715 x^3)))
        xf = x.to(tl.float32)
        z = 2.0 * _GELU_C * (xf + 0.044715 * xf * xf * xf)
        x = (xf / (1.0 + tl.exp(-z))).to(x.dtype)
    xf = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(xf), axis=0), tiny) * inv_max  # kernels/fp8.py's row_scales
    if EXACT:
        codes = fp8_codes(xf, scale, q_ptr.dtype.element_ty)
    else:  # times the reciprocal: ~2x faster on wide rows than IEEE division (examples/fp8_act_quant_probe.py)
        codes = tl.clamp(xf * (1.0 / scale), -448.0, 448.0).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + row * stride_q + offs, codes, mask=mask)
    tl.store(s_ptr + row, scale)


def quant_rows(x: torch.Tensor, act: Act = "none", bias: torch.Tensor | None = None, exact: bool = True,
               pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit) -> (e4m3 codes [M, K], fp32 scales [M, 1]), one scale per row: kernels/fp8.py's
    quantize_rows(activate(x + bias, act)).

    act "silu_mul": x is a fused [M, 2K] gate-up and the rows quantized are silu(gate) * up (no bias then).
    exact=False multiplies by the scale's reciprocal instead of dividing: one rounding more, so a code lands one
    e4m3 step from torch's where x / scale falls within an fp32 ulp of a rounding boundary (rare; the DiT's
    approximate FP8 path takes it, the engine's tested-bit-for-bit paths do not)."""
    m, k = x.shape
    if act == "silu_mul":
        k //= 2
    assert x.stride(1) == 1 and (bias is None or (bias.shape == (k,) and bias.is_contiguous() and act != "silu_mul"))
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quant_rows_kernel[(m,)](
            x, x if bias is None else bias, q, s, x.stride(0), q.stride(0), k, TINY, INV_MAX, ACT=act,
            HAS_BIAS=bias is not None, EXACT=exact, BLOCK=block, num_warps=min(16, max(1, block // 512)),
            **pdl_kwargs(x, pdl),
        )
    return q, s


@torch.library.custom_op("minisgl::fp8_quant_rows", mutates_args=())
def quant_rows_op(x: torch.Tensor, act: str, bias: torch.Tensor | None,
                  exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """quant_rows (no PDL) as one opaque op: a compiled DiT block calls it where inductor's own fusion of the same
    numbers makes a multi-pass reduction (GELU + quantization of Wan's MLP: ~2x the one pass's time)."""
    return quant_rows(x, act, bias, exact, pdl=False)  # type: ignore[arg-type]


@quant_rows_op.register_fake
def _(x: torch.Tensor, act: str, bias: torch.Tensor | None, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[1] // 2 if act == "silu_mul" else x.shape[1]
    return x.new_empty((x.shape[0], k), dtype=FP8), x.new_empty((x.shape[0], 1), dtype=torch.float32)
