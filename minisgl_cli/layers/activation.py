"""Activations: SiLU-and-mul over a fused gate-up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl_cli.layers.kernel_choice import Kernels


def silu_and_mul(gate_up: torch.Tensor, kernels: Kernels) -> torch.Tensor:
    sgl = kernels.sgl_ops(gate_up)
    if sgl is not None and gate_up.shape[-1] * gate_up.element_size() % 16 == 0:  # its rows: 16-byte aligned
        return sgl.silu_and_mul(gate_up)
    ops = kernels.triton(gate_up)
    if ops is not None and gate_up.dim() == 2:
        return ops.silu_and_mul(gate_up, pdl=kernels.pdl)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
