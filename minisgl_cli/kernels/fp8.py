"""FP8 (e4m3) numerics: the one definition of how a value becomes 8 bits and back, shared by the FP8 KV cache
(kvcache/pool.py) and the FP8 linear layers (layers/quant.py). The Triton kernels compute exactly this.

    q = fp8(clamp(x / scale, -448, 448))       round to nearest even; 448 is e4m3's largest finite value
    x ~ q * scale                                 the scale is fp32 and chosen per head (KV), per output
                                                  channel (weights) or per token (activations)
    row scale = max(amax(|row|), 1e-12) * INV_MAX      INV_MAX = fp32(1 / 448)

The division is IEEE (the kernels use div_rn; torch divides exactly by a tensor, but multiplies by the
reciprocal of a Python scalar on CUDA, hence the row scale's explicit multiply), so a kernel and this code
give the same scales and 8-bit codes.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_MAX = 1.0 / FP8_MAX  # (rounded to fp32 where it multiplies)
TINY = 1e-12  # floor of amax: an all-zero row gets a finite scale (and quantizes to zeros)
# What the Triton quant_rows applies to a row before quantizing it: nothing; silu(gate) * up of a fused [gate | up]
# row (the decoder's and Z-Image's MLP); GELU-tanh (Wan's MLP, diffusers' "gelu-approximate").
Act = Literal["none", "silu_mul", "gelu_tanh"]


def quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale (scale broadcasts against x) as e4m3, saturating at +-448."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in fp32 (exact for e4m3 codes), then `dtype`."""
    return (q.float() * scale).to(dtype)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """One scale per row of x [..., K] ([..., 1], fp32): the row's largest |value| lands on 448."""
    return x.float().abs().amax(-1, keepdim=True).clamp_(min=TINY) * INV_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scale [..., 1]) with one scale per row: weights per output channel, activations per token."""
    scale = row_scales(x)
    return quantize(x, scale), scale


def round_trip_rows(x: torch.Tensor) -> torch.Tensor:
    """x through per-row e4m3 and back, in fp32: what the FP8 GEMM sees of an activation."""
    q, scale = quantize_rows(x)
    return dequantize(q, scale)


def activate(x: torch.Tensor, act: Act) -> torch.Tensor:
    """act(x) as torch's unfused ops compute and round it: the numbers the Triton quant_rows quantizes."""
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "silu_mul":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    return x


class Fp8Rows(NamedTuple):
    """Activation rows already quantized per token for an FP8 linear (a norm kernel's output): the linear
    multiplies the codes without a pass of its own. `dtype` is the 16-bit type the rows had and its output takes."""

    codes: torch.Tensor  # [M, K] e4m3
    scales: torch.Tensor  # [M, 1] fp32
    dtype: torch.dtype


class KVQuant(NamedTuple):
    """One layer of an FP8 KV cache: what a kernel needs to write and read its codes (kvcache/pool.py).

    Stored: code = quantize(x - mean[head], scale[head]); the values are code * scale + mean. Attention may
    leave K's mean out (it shifts every logit of a query row by the same q . mean: softmax is unchanged)."""

    k_scale: torch.Tensor  # [Hkv] fp32
    v_scale: torch.Tensor  # [Hkv] fp32
    k_mean: torch.Tensor  # [Hkv, D] fp32
    v_mean: torch.Tensor  # [Hkv, D] fp32


KVCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVQuant | None]
"""A layer's pool tensors for a kernel that stores K/V itself: k, v [slots, Hkv, D], the new tokens' slots [T], and an
FP8 pool's KVQuant (attention.base.KVBuffers is this tuple, named)."""


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [M, K], fp32 scales [M, ceil(K / group)]) of x [M, K], one scale per token per `group` columns (the
    last group maybe partial): the activations of a block-wise FP8 GEMM (kernels/triton/fp8_block.py), as DeepSeek's
    and sglang's per-token-group quantization makes them."""
    m, k = x.shape
    xf = torch.nn.functional.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scale = xf.abs().amax(-1).clamp_(min=TINY) * INV_MAX
    return quantize(xf, scale[..., None]).view(m, -1)[:, :k], scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """quantize_groups' codes back to fp32 [M, K]."""
    return q.float() * scale.repeat_interleave(group, -1)[:, : q.shape[1]]
