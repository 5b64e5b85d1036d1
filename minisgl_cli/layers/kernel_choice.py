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

    def sgl_ops(self, x: torch.Tensor) -> ModuleType | None:
        """sgl_kernel when `x` is on CUDA and the engine runs its ops, else None."""
        return self.sgl if self.sgl is not None and x.is_cuda else None
