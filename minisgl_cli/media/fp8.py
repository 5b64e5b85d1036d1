"""FP8 DiT weights (`--quantization fp8`): the denoiser's block linears as e4m3 weights with one scale per output
channel, activations quantized per token on the fly, one `torch._scaled_mm` (row-wise scales, bf16 out).

The numbers are kernels/fp8.py's (the engine's FP8 linears use the same). Only the linears inside the DiT's
repeated blocks are swapped (attention projections and MLPs: where the FLOPs are); the patch / caption / time
embedders, the final layer and the per-block modulation (adaLN: one row per image, no GEMM to speed up) stay in
bf16, as vLLM-Omni and SGLang Diffusion keep them. `torch._scaled_mm` needs CUDA with compute capability 8.9
(Ada, Hopper) or later; on other devices `Fp8Linear` computes the same numbers by quantize / dequantize in fp32
(what the CPU tests check), and load_pipeline refuses the option there.

A block's MLP becomes one `Fp8MLP`: its up projection's bias, its activation (Wan's GELU-tanh, Z-Image's
SiLU-and-mul, whose two up projections become one GEMM) and the down projection's per-token quantization run as one
pass over each row (kernels/triton/fp8.py), where inductor's fusion of the same numbers made a multi-pass reduction
(Wan: 1.13 ms a layer against 0.57, examples/fp8_act_quant_probe.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.kernels import fp8
from minisgl_cli.kernels.fp8 import Act

MIN_CAPABILITY = (8, 9)
# Linears left in bf16 inside a block: adaLN modulation (one row per image a step).
_KEEP = ("adaLN", "modulation")


class Fp8Linear(nn.Module):
    """y = x W^T + b with W as e4m3 codes [N, K] and an fp32 scale per output channel [N]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        w = weight.detach()
        codes, scale = fp8.quantize_rows(w)
        self.out_features, self.in_features = w.shape
        # Buffers, not parameters: diffusers takes a model's dtype from its first floating parameter, and an e4m3
        # one would make the pipeline cast its text embeddings to 8 bits.
        self.register_buffer("weight", codes)
        self.register_buffer("weight_scale", scale[:, 0].contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    weight: torch.Tensor
    weight_scale: torch.Tensor

    @classmethod
    def of(cls, *linears: nn.Linear) -> Fp8Linear:
        """One FP8 linear of nn.Linears stacked along their outputs (one GEMM for Z-Image's two up projections)."""
        biases = [lin.bias for lin in linears]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        return cls(torch.cat([lin.weight.detach() for lin in linears]), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        y = self.matmul(*_quant_rows(x2)) if x.is_cuda else self.emulate(x2)
        return self.add_bias(y.to(x.dtype)).view(*x.shape[:-1], self.out_features)

    def matmul(self, xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
        """x W^T (bf16, no bias) of per-token codes and scales."""
        return torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.weight_scale[None, :],
                                out_dtype=torch.bfloat16, bias=None)

    def emulate(self, x2: torch.Tensor) -> torch.Tensor:
        """matmul's numbers in fp32 (off CUDA): per-token codes times per-channel codes."""
        return F.linear(fp8.round_trip_rows(x2), fp8.dequantize(self.weight, self.weight_scale[:, None]))

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


class Fp8MLP(nn.Module):
    """A DiT block's MLP, down(act(up(x))), on two FP8 GEMMs; on CUDA the up projection's bias, the activation and
    the down projection's input quantization are one pass over each row (kernels/triton/fp8.py's quant_rows)."""

    def __init__(self, up: Fp8Linear, down: Fp8Linear, act: Act):
        super().__init__()
        self.up, self.down, self.act = up, down, act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.up.in_features)
        if x.is_cuda:
            h = self.up.matmul(*_quant_rows(x2))
            y = self.down.matmul(*_quant_rows(h.to(x.dtype), self.act, self.up.bias))
        else:
            h = self.up.add_bias(self.up.emulate(x2).to(x.dtype))
            y = self.down.emulate(fp8.activate(h, self.act))
        return self.down.add_bias(y.to(x.dtype)).view(*x.shape[:-1], self.down.out_features)

    def extra_repr(self) -> str:
        return f"act={self.act}"


def _quant_rows(x: torch.Tensor, act: Act = "none",
                bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 codes and scales of act(x + bias). With no activation, under torch.compile: kernels/fp8.py's
    torch ops, which inductor fuses into the norm ahead of it; otherwise the one-pass Triton kernel, as an opaque op
    while compiling, multiplying by the scale's reciprocal (quant_rows' exact=False: rarely a code one step from
    torch's, in a path that is approximate anyway, for ~2x less time on wide rows)."""
    if act == "none" and bias is None and torch.compiler.is_compiling():
        return fp8.quantize_rows(x)
    try:
        from minisgl_cli.kernels.triton.fp8 import quant_rows, quant_rows_op
    except ImportError:  # no Triton
        return fp8.quantize_rows(fp8.activate(x if bias is None else x + bias.to(x.dtype), act))
    if torch.compiler.is_compiling():
        return quant_rows_op(x, act, bias, False)
    return quant_rows(x.contiguous(), act, bias, exact=False, pdl=False)


def _mlp(module: nn.Module) -> Fp8MLP | None:
    """The Fp8MLP of a block's MLP this file knows (diffusers' FeedForward with GELU-tanh, Z-Image's SiLU-gated
    FeedForward), or None."""
    net = getattr(module, "net", None)
    if (isinstance(net, nn.ModuleList) and len(net) in (3, 4) and type(net[0]).__name__ == "GELU"
            and getattr(net[0], "approximate", None) == "tanh" and isinstance(up := net[0].proj, nn.Linear)
            and isinstance(down := net[2], nn.Linear)
            and all(isinstance(m, nn.Dropout) and (m.p == 0 or not m.training) for m in net[1::2])):
        return Fp8MLP(Fp8Linear.of(up), Fp8Linear.of(down), "gelu_tanh")
    w1, w2, w3 = (getattr(module, w, None) for w in ("w1", "w2", "w3"))
    if (type(module).__name__ == "FeedForward" and isinstance(w1, nn.Linear) and isinstance(w2, nn.Linear)
            and isinstance(w3, nn.Linear)):
        return Fp8MLP(Fp8Linear.of(w1, w3), Fp8Linear.of(w2), "silu_mul")
    return None


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


def _fits(*linears: nn.Linear) -> bool:
    """_scaled_mm takes sides that are multiples of 16."""
    return not any(lin.in_features % 16 or lin.out_features % 16 for lin in linears)


def quantize_denoiser(denoiser: Any) -> int:
    """Swap the MLPs of the DiT's repeated blocks for Fp8MLP and their other linears for Fp8Linear, in place; returns
    how many FP8 linears there are then. A linear whose sides are not multiples of 16 stays as it is."""
    from minisgl_cli.media.jobs import MediaError

    blocks = _blocks(denoiser)
    if not blocks:
        raise MediaError(f"--quantization fp8: {type(denoiser).__name__} declares no repeated blocks to quantize",
                         "quantization")
    for block in blocks:
        for name, child in list(block.named_modules()):  # MLPs first: their linears go with them
            if not any(k in name for k in _KEEP) and _fits(*_linears(child)) and (mlp := _mlp(child)) is not None:
                _replace(block, name, mlp)  # (fits first: _mlp quantizes the weights it finds)
        for name, child in list(block.named_modules()):
            if isinstance(child, nn.Linear) and not any(k in name for k in _KEEP) and _fits(child):
                _replace(block, name, Fp8Linear.of(child))
    return sum(isinstance(m, Fp8Linear) for block in blocks for m in block.modules())


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def _replace(block: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(block.get_submodule(parent_name) if parent_name else block, attr, new)
