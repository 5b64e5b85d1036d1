"""Attention backends and `create_backend`, which picks one by name (GPU kernels are imported only when chosen)."""

from __future__ import annotations

import logging

import torch

from minisgl_cli import env
from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.attention.torch_backend import TorchBackend
from minisgl_cli.kvcache.pool import KVPool
from minisgl_cli.layers.kernel_choice import Kernels

BACKEND_NAMES = ("auto", "torch", "triton", "flashinfer")
log = logging.getLogger(__name__)


def create_backend(
    name: str,
    pool: KVPool,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    device: torch.device | str,
    kernels: Kernels | None = None,
    variants: bool = False,
    layer_heads: tuple[int, ...] = (),
) -> AttentionBackend:
    """Build the attention backend `name` over `pool`; `kernels` is the engine's choice (PDL for Triton's);
    `variants`: some layer attends through a sliding window or with sinks, which FlashInfer's wrappers here do not
    take (refused by name; auto skips it); `layer_heads`: each pool layer's query heads where the model's layers differ
    in head shape (() = num_heads for every layer). A pool of per-layer shapes (Gemma 4) runs on torch and Triton;
    FlashInfer's wrappers here plan for one shape (refused by name; auto skips it).

    "auto": Triton on CUDA (if it imports), else torch -- always torch on the CPU, where no GPU library is even
    imported. FlashInfer only by name: on an H100 (0.7.2) and an H200 (0.7.4) our Triton path was faster end to end,
    batch 1 and the preset (docs/gpu.md, "FlashInfer"). Under Triton's interpreter (TRITON_INTERPRET=1) "triton"
    runs on the CPU too (tests).
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "flashinfer" and variants:
        raise ValueError("this model has sliding-window or sink attention layers, which the flashinfer backend does "
                         "not run here: use --attention-backend triton (or auto)")
    mixed = bool(pool.shape.per_layer)
    if name == "flashinfer" and mixed:
        raise ValueError("this model's layers have heads of different shapes (Gemma 4), which the flashinfer backend "
                         "does not run here: use --attention-backend triton (or auto)")
    on_cuda = torch.device(device).type == "cuda"
    args = (pool, num_heads, num_kv_heads, head_dim, scale)
    if name == "torch" or (name == "auto" and not on_cuda):
        # --deterministic (the invariant GEMM policy): decode attention on one thread, alike in any batch.
        return TorchBackend(*args, serial_decode=kernels is not None and kernels.cpu_gemm == "invariant")
    if not on_cuda and not (name == "triton" and env.triton_interpret()):
        raise ValueError(f"attention backend {name!r} needs a CUDA device (got {device}); use 'torch' or 'auto'")
    if name == "triton":
        from minisgl_cli.attention.triton_backend import TritonBackend

        return TritonBackend(*args, kernels=kernels, layer_heads=layer_heads)
    if name == "flashinfer":
        from minisgl_cli.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(*args)
    try:
        from minisgl_cli.attention.triton_backend import TritonBackend

        return TritonBackend(*args, kernels=kernels, layer_heads=layer_heads)
    except Exception as exc:
        log.warning("triton unavailable (%s: %s); using the torch attention backend", type(exc).__name__, exc)
    return TorchBackend(*args)


__all__ = ["AttentionBackend", "BACKEND_NAMES", "TorchBackend", "create_backend"]
