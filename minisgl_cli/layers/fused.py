"""Which implementation the layers use: fused Triton kernels on CUDA, the plain torch reference elsewhere.

The Triton module is imported only on the first CUDA call, so the CPU path never touches Triton.
`MINISGL_DISABLE_FUSED_OPS=1` (or EngineConfig.disable_fused_ops) keeps the torch ops on CUDA too.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

_enabled = os.environ.get("MINISGL_DISABLE_FUSED_OPS", "0") not in ("1", "true", "yes")
_ops: ModuleType | None = None


def set_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def enabled() -> bool:
    return _enabled


def ops_for(x: torch.Tensor) -> ModuleType | None:
    """The Triton ops module when `x` is on CUDA and fusion is on, else None (use torch)."""
    global _ops
    if not (_enabled and x.is_cuda):
        return None
    if _ops is None:
        from minisgl_cli.layers import triton_ops

        _ops = triton_ops
    return _ops
