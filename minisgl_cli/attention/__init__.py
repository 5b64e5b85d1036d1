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

    "auto": FlashInfer if it imports and passes a tiny decode check, else Triton on CUDA (if it
    imports), else torch -- always torch on the CPU, where neither GPU library is even imported. An FP8 pool
    skips FlashInfer (per-head scales: see flashinfer_backend.py). Under Triton's interpreter (TRITON_INTERPRET=1)
    "triton" runs on the CPU too (tests).
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
    # auto on CUDA: FlashInfer where it runs every layer of the model (no window, no sinks, one head shape)
    if not variants and not mixed:
        try:
            from minisgl_cli.attention.flashinfer_backend import FlashInferBackend

            backend = FlashInferBackend(*args)
            _smoke_check(backend, pool, num_heads, num_kv_heads, head_dim, scale)
            return backend
        except Exception as exc:  # not installed, no kernel for this shape/arch, or wrong answer
            log.info("flashinfer unavailable (%s: %s); trying triton", type(exc).__name__, exc)
    try:
        from minisgl_cli.attention.triton_backend import TritonBackend

        return TritonBackend(*args, kernels=kernels, layer_heads=layer_heads)
    except Exception as exc:
        log.warning("triton unavailable (%s: %s); using the torch attention backend", type(exc).__name__, exc)
    return TorchBackend(*args)


def _smoke_check(
    backend: AttentionBackend, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
) -> None:
    """Run one tiny decode through `backend` on a scratch pool of the same shape and compare with torch."""
    from minisgl_cli.engine.batch import ForwardBatch
    from minisgl_cli.engine.host import HostBuffers
    from minisgl_cli.kvcache.pool import KVShape

    shape = KVShape(1, num_kv_heads, head_dim, pool.shape.dtype)
    ps, seq = pool.page_size, 5
    tiny = KVPool(shape, num_pages=-(-seq // ps) + 1, page_size=ps, max_reqs=1, max_context_len=seq, device=pool.device)
    pages = tiny.alloc_pages(-(-seq // ps))
    assert pages is not None  # a fresh pool sized for them
    slots = tiny.slots_of_pages(pages)[:seq]
    tiny.page_table[0, :seq] = slots.to(tiny.device, torch.int32)
    g = torch.Generator(device=pool.device).manual_seed(0)
    for t in (tiny.k[0], tiny.v[0]):
        t.copy_(torch.randn(t.shape, generator=g, device=pool.device, dtype=torch.float32))
    q = torch.randn((1, num_heads, head_dim), generator=g, device=pool.device).to(shape.dtype)
    kv = tiny.k[0][slots[-1:]].clone(), tiny.v[0][slots[-1:]].clone()
    outs, host = [], HostBuffers()
    for cls in (type(backend), TorchBackend):
        be = cls(tiny, num_heads, num_kv_heads, head_dim, scale)
        batch = ForwardBatch.build("decode", [0], [0], [seq - 1], [1], slots[-1:], pool.device, host)
        be.prepare(batch)
        outs.append(be.forward(q, *kv, 0, batch).float())
    if not torch.allclose(outs[0], outs[1], atol=2e-2, rtol=2e-2):
        raise RuntimeError("flashinfer disagrees with the torch backend on a tiny decode")


__all__ = ["AttentionBackend", "BACKEND_NAMES", "TorchBackend", "create_backend"]
