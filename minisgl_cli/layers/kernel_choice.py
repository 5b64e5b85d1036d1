"""Kernels: one engine's choice of implementation for the layers (fused Triton ops, sgl_kernel's, PDL, the CPU GEMM).

The engine builds one `Kernels` and hands it to the model and the attention backend at construction;
every layer reads that object, so two engines in one process never see each other's choice. Flipping a
field takes effect at the next forward (then recapture the CUDA graphs: `Engine.capture_graphs()`).

The Triton module is imported only on the first CUDA call, so the CPU path never touches Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from minisgl_cli.layers.cpu_gemm import POLICIES

GEMV_MAX_ROWS = 4  # kernels/triton/gemv.py's MAX_ROWS (kept here: this module imports no Triton)


@functools.cache
def _triton_ops() -> ModuleType:
    from minisgl_cli.kernels.triton import ops as triton_ops

    return triton_ops


def load_sgl_kernel(device: torch.device) -> tuple[ModuleType | None, str | None]:
    """sgl_kernel for an engine on `device` (--engine sgl), or None and why it cannot run there (one line)."""
    if device.type != "cuda":
        return None, f"sgl_kernel's ops run on CUDA only, and this engine is on {device.type}"
    try:
        import sgl_kernel
    except Exception as exc:  # not installed, or built for another torch / CUDA (an ImportError or OSError)
        first = (str(exc).strip().splitlines() or [""])[0]
        return None, f"sgl_kernel does not import ({type(exc).__name__}: {first})"
    return sgl_kernel, None


@dataclass
class Kernels:
    fused: bool = True  # CUDA: fused Triton ops (add+RMSNorm, q/k-norm+RoPE+KV store, SiLU-and-mul, GEMV)
    # CUDA, with `fused`: the decode-step fusions of a few rows (`gemv_rows`, `gate_up_silu`, `qkv_rope`), opt-in
    # (MINISGL_FUSED_DECODE=1): on an H200 they did not beat the kernels they replace (docs/benchmarks.md, issue 50).
    fused_decode: bool = False
    pdl: bool = True  # CUDA, Hopper and newer: programmatic dependent launch between our Triton kernels
    cpu_gemm: str = "auto"  # CPU: the GEMM policy of layers/cpu_gemm.py (auto, invariant, mkl, fp16)
    ordered_sums: bool = False  # RMSNorm sums through ATen's cumsum, as a compiled CPU step does (layers/norm.py)
    # --engine sgl: sgl_kernel's RMSNorm (+add), SiLU-and-mul and RoPE take those ops' place on CUDA;
    # the batch-1 GEMV (SiLU fused in) and attention stay ours.
    sgl: ModuleType | None = None

    def __post_init__(self) -> None:
        if self.cpu_gemm not in POLICIES:
            raise ValueError(f"unknown CPU GEMM policy {self.cpu_gemm!r}; choose one of {', '.join(POLICIES)}")

    def triton(self, x: torch.Tensor) -> ModuleType | None:
        """The Triton ops module when `x` is on CUDA and fusion is on, else None (use torch)."""
        if not (self.fused and x.is_cuda):
            return None
        return _triton_ops()

    def gemv_rows(self, x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
        """The Triton ops when x W^T is a GEMV of theirs (kernels/triton/gemv.py): x one CUDA row over 16-bit or FP8
        weights (batch-1 decode), or with `fused_decode` up to GEMV_MAX_ROWS rows over 16-bit weights. Else None."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if rows == 1:
            ok = weight.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
        else:
            ok = self.fused_decode and 1 < rows <= GEMV_MAX_ROWS and weight.dtype in (torch.bfloat16, torch.float16)
        return self.triton(x) if ok else None

    def gate_up_silu(self, x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
        """The Triton ops when silu(x Wg^T) * (x Wu^T) of a merged gate-up weight is one GEMV with the SiLU-and-mul in
        its epilogue (`fused_decode` and a GEMV's rows), saving the activation's launch and round trip. Else None."""
        return self.gemv_rows(x, weight) if self.fused_decode and x.dtype in (torch.bfloat16, torch.float16) else None

    def qkv_rope(self, x: torch.Tensor, weight: torch.Tensor) -> ModuleType | None:
        """The Triton ops when the fused qkv projection of x takes RoPE and the K/V store in its GEMV's epilogue
        (`fused_decode`, x a GEMV's rows over 16-bit weights; no q/k norm, which needs a whole head): one launch a
        layer fewer than ops.qk_norm_rope_ after the GEMV. Else None."""
        if not self.fused_decode or weight.dtype not in (torch.bfloat16, torch.float16):
            return None
        return self.gemv_rows(x, weight)

    def sgl_ops(self, x: torch.Tensor) -> ModuleType | None:
        """sgl_kernel when `x` is on CUDA and the engine runs its ops, else None."""
        return self.sgl if self.sgl is not None and x.is_cuda else None
