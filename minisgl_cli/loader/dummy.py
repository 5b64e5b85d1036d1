"""Random weights of real shapes (`--load-format dummy`), scaled so activations stay finite."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) for matrices, ones for norm weights, zeros for biases: a stable random model.

    CPU parameters get the same numbers whatever the machine; CUDA ones are drawn on the device."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:  # RMSNorm weights
            param.fill_(1.0)
        elif param.is_cuda:
            # On CUDA draw on the device (seeded, but not the CPU's numbers): an 8B model in seconds, not minutes.
            g = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
            param.normal_(0.0, std, generator=g)
        else:
            # Draw on the CPU in fp32 (reproducible), then copy in chunks to bound memory.
            rows = param.shape[0]
            step = max(1, (1 << 24) // max(1, param[0].numel()))
            for start in range(0, rows, step):
                chunk = torch.randn(param[start : start + step].shape, generator=gen) * std
                param[start : start + step].copy_(chunk)
