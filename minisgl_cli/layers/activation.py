"""Activations: SiLU-and-mul over a fused gate-up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl_cli.layers import fused


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ops = fused.ops_for(gate_up)
    if ops is not None and gate_up.dim() == 2:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
