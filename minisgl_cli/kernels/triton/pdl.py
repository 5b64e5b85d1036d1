"""Programmatic dependent launch (PDL, Hopper and newer): the launch options our Triton kernels take.

Our Triton kernels let the next kernel launch while they run, and wait (griddepcontrol.wait) before
touching anything an earlier kernel wrote, so a decode step's ~250-300 back-to-back kernels overlap
their launch and ramp-up. Whether to use it is the engine's choice (`Kernels.pdl`, passed to each
kernel); this module only adds what the device supports.
"""

from __future__ import annotations

import torch

_supported: dict[int, bool] = {}  # device index -> compute capability >= 9: a fact of the hardware, cached


def pdl_kwargs(x: torch.Tensor, on: bool) -> dict:
    """Launch options of a PDL-aware Triton kernel on x's device: USE_PDL (constexpr) and launch_pdl."""
    if not on or x.device.type != "cuda":  # off, or Triton's interpreter on CPU tensors (tests)
        return {"USE_PDL": False}
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if idx not in _supported:
        _supported[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    on = on and _supported[idx]
    return {"USE_PDL": on, "launch_pdl": on}
