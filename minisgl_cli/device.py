"""Device and dtype choice for media pipelines: mps → cuda → cpu, and the dtype each runs best in."""

from __future__ import annotations

DEVICES = ("mps", "cuda", "cpu")


class DeviceError(ValueError):
    """A requested device that this machine does not have."""


def pick_device(requested: str | None = None) -> str:
    """`requested` if available ("auto"/None picks the first of mps, cuda, cpu that exists)."""
    import torch

    available = {
        "mps": bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available(),
        "cuda": torch.cuda.is_available(),
        "cpu": True,
    }
    if requested in (None, "", "auto"):
        return next(d for d in DEVICES if available[d])
    base = requested.split(":", 1)[0]
    if base not in available:
        raise DeviceError(f"unknown device {requested!r}: use one of auto, {', '.join(DEVICES)}")
    if not available[base]:
        raise DeviceError(f"device {requested!r} is not available on this machine (try --device cpu)")
    return requested


def pick_dtype(device: str):
    """bf16 on accelerators (the diffusion transformers are trained in it); fp32 on CPU, where
    bf16 matmuls are slow and half precision loses too much in the VAE."""
    import torch

    return torch.float32 if device.startswith("cpu") else torch.bfloat16
