"""FP8 DiT weights (`--quantization fp8`): the denoiser's block linears as e4m3 weights with one scale per output
channel, activations quantized per token on the fly, one `torch._scaled_mm` (row-wise scales, bf16 out).

The numbers are kernels/fp8.py's (the engine's FP8 linears use the same). Only the linears inside the DiT's
repeated blocks are swapped (attention projections and MLPs: where the FLOPs are); the patch / caption / time
embedders, the final layer and the per-block modulation (adaLN: one row per image, no GEMM to speed up) stay in
bf16, as vLLM-Omni and SGLang Diffusion keep them. `torch._scaled_mm` needs CUDA with compute capability 8.9
(Ada, Hopper) or later; on other devices `Fp8Linear` computes the same numbers by quantize / dequantize in fp32
(what the CPU tests check), and load_pipeline refuses the option there.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.kernels import fp8

MIN_CAPABILITY = (8, 9)
# Linears left in bf16 inside a block: adaLN modulation (one row per image a step).
_KEEP = ("adaLN", "modulation")


class Fp8Linear(nn.Module):
    """y = x W^T + b with W as e4m3 codes [N, K] and an fp32 scale per output channel [N]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        codes, scale = fp8.quantize_rows(w)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, not parameters: diffusers takes a model's dtype from its first floating parameter, and an e4m3
        # one would make the pipeline cast its text embeddings to 8 bits.
        self.register_buffer("weight", codes)
        self.register_buffer("weight_scale", scale[:, 0].contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.out_dtype = w.dtype

    weight: torch.Tensor
    weight_scale: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x.is_cuda:
            xq, xs = _quant_rows(x2)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale[None, :],
                                 out_dtype=torch.bfloat16, bias=None)
        else:  # the same numbers in fp32: per-token codes times per-channel codes
            w = fp8.dequantize(self.weight, self.weight_scale[:, None])
            y = F.linear(fp8.round_trip_rows(x2), w)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 codes and scales. Under torch.compile: kernels/fp8.py's torch ops, which inductor fuses into
    the block's graph; eager: the engine's one-pass Triton kernel (the same codes, bit for bit: test_gpu_fp8.py)."""
    if not torch.compiler.is_compiling():
        try:
            from minisgl_cli.kernels.triton.fp8 import quant_rows
        except ImportError:  # no Triton
            pass
        else:
            return quant_rows(x.contiguous(), pdl=False)
    return fp8.quantize_rows(x)


def check_device(device: str) -> None:
    """FP8 GEMMs need CUDA with compute capability >= 8.9: a clear error elsewhere."""
    from minisgl_cli.media.jobs import MediaError

    if not device.startswith("cuda"):
        raise MediaError(f"--quantization fp8 needs a CUDA GPU (compute capability >= 8.9), this run uses {device}",
                         "quantization")
    cap = torch.cuda.get_device_capability(torch.device(device))
    if cap < MIN_CAPABILITY:
        raise MediaError(f"--quantization fp8 needs compute capability >= 8.9 (Ada, Hopper), "
                         f"{torch.cuda.get_device_name(torch.device(device))} has {cap[0]}.{cap[1]}", "quantization")


def _blocks(denoiser: nn.Module) -> list[nn.Module]:
    names = set(getattr(denoiser, "_repeated_blocks", None) or ())
    return [m for m in denoiser.modules() if type(m).__name__ in names]


def quantize_denoiser(denoiser: Any) -> int:
    """Swap the linears of the DiT's repeated blocks for Fp8Linear in place; returns how many were swapped.
    A linear whose sides are not multiples of 16 (what _scaled_mm takes) stays as it is."""
    from minisgl_cli.media.jobs import MediaError

    blocks = _blocks(denoiser)
    if not blocks:
        raise MediaError(f"--quantization fp8: {type(denoiser).__name__} declares no repeated blocks to quantize",
                         "quantization")
    swapped = 0
    for block in blocks:
        for name, child in list(block.named_modules()):
            if not isinstance(child, nn.Linear) or any(k in name for k in _KEEP):
                continue
            if child.in_features % 16 or child.out_features % 16:
                continue
            parent_name, _, attr = name.rpartition(".")
            setattr(block.get_submodule(parent_name) if parent_name else block, attr, Fp8Linear(child))
            swapped += 1
    return swapped
