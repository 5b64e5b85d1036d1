"""Which implementation the layers use: fused Triton kernels on CUDA, the plain torch reference elsewhere.

The Triton module is imported only on the first CUDA call, so the CPU path never touches Triton.
`MINISGL_DISABLE_FUSED_OPS=1` (or EngineConfig.disable_fused_ops) keeps the torch ops on CUDA too.

Programmatic dependent launch (PDL, Hopper and newer): our Triton kernels let the next kernel launch
while they run, and wait (griddepcontrol.wait) before touching anything an earlier kernel wrote, so
a decode step's ~250-300 back-to-back kernels overlap their launch and ramp-up. `MINISGL_DISABLE_PDL=1`
turns it off.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

_enabled = os.environ.get("MINISGL_DISABLE_FUSED_OPS", "0") not in ("1", "true", "yes")
_pdl = os.environ.get("MINISGL_DISABLE_PDL", "0") not in ("1", "true", "yes")
_ops: ModuleType | None = None
_pdl_devices: dict[int, bool] = {}


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


def set_pdl(enabled: bool) -> None:
    global _pdl
    _pdl = enabled


def pdl_enabled() -> bool:
    return _pdl


def pdl_kwargs(x: torch.Tensor) -> dict:
    """Launch options of a PDL-aware Triton kernel on x's device: USE_PDL (constexpr) and launch_pdl."""
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if idx not in _pdl_devices:
        _pdl_devices[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    on = _pdl and _pdl_devices[idx]
    return {"USE_PDL": on, "launch_pdl": on}
