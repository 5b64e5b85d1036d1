"""Rotary position embedding with the configs' rope scaling (default, linear, llama3, yarn, proportional), cached per
position; and M-RoPE (Qwen2-VL): three position axes (time, height, width), each turning its own share of the
frequencies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin multiplier, as HF's rope init functions compute them."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return inv, 1.0
    if kind == "linear":
        return inv / scaling["factor"], 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":  # gpt-oss: transformers' _compute_yarn_parameters
        return _yarn(inv, head_dim, base, scaling)
    if kind == "proportional":  # Gemma 4's global layers: a leading partial_rotary_factor of the pairs turns
        turning = int(scaling.get("partial_rotary_factor", 1.0) * head_dim // 2)
        return torch.cat((inv[:turning], torch.zeros(head_dim // 2 - turning))) / scaling.get("factor", 1.0), 1.0
    raise ValueError(f"unsupported rope scaling type: {kind!r}")


def _yarn(inv: torch.Tensor, dim: int, base: float, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN: each frequency between its extrapolated and interpolated value by a linear ramp over the correction
    range; cos / sin scaled by the attention factor."""
    factor, old_ctx = p["factor"], p["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        both = p.get("mscale") and p.get("mscale_all_dim")
        attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"]) if both else mscale(factor)

    def correction(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(p.get("beta_fast") or 32), correction(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # inv is 1 / pos
    interpolated = 1.0 / (factor * pos)  # rounded as transformers rounds it (not inv / factor)
    return interpolated * (1 - extrapolated) + inv * extrapolated, float(attention)


@dataclass(frozen=True)
class RopeTable:
    """One step's rotation, for every layer: token t turns by row `rows[t]` of `cos` / `sin` ([N, head_dim] fp32,
    each half holding the frequencies). Plain RoPE: the positions into the embedding's own tables; M-RoPE: a row
    per token, made for the step (every kernel that takes positions and tables takes these as they are)."""

    rows: torch.Tensor  # [T] int64
    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    cos: torch.Tensor  # [max_positions, head_dim] fp32 buffers (registered below)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv, mult = _inv_freq(head_dim, base, scaling)
        freqs = torch.outer(torch.arange(max_positions).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Buffers follow .to(device); kept fp32 and cast per call like HF does.
        self.register_buffer("cos", emb.cos() * mult, persistent=False)
        self.register_buffer("sin", emb.sin() * mult, persistent=False)
        self._cos_sin: torch.Tensor | None = None  # sgl_kernel's layout, built on its first use

    def table(self, positions: torch.Tensor) -> RopeTable:
        return RopeTable(positions, self.cos, self.sin)

    def at(self, positions: torch.Tensor | RopeTable, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin (see rotate) at `positions` (or a step's table), [T, 1, D] in `dtype`: once per
        step, for every layer."""
        t = positions if isinstance(positions, RopeTable) else self.table(positions)
        sin = t.sin[t.rows].to(dtype)
        half = sin.shape[-1] // 2
        return t.cos[t.rows].to(dtype)[:, None, :], torch.cat((-sin[:, :half], sin[:, half:]), -1)[:, None, :]

    def rotate(self, x: torch.Tensor, at: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, H, D] rotated: x cos + rotate_half(x) sin, where rotate_half(x) = (-x2, x1) is roll(x, D/2) with
        the first half's sign folded into the sin (the same numbers as HF's, with fewer ops)."""
        cos, sin_signed = at
        return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                at: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]; `at`: this step's `self.at(positions, q.dtype)` if already computed."""
        at = at if at is not None else self.at(positions, q.dtype)
        return self.rotate(q, at), self.rotate(k, at)

    def apply_sgl_(self, sgl: ModuleType, positions: torch.Tensor | RopeTable, q: torch.Tensor,
                   k: torch.Tensor) -> None:
        """RoPE in place on q [T, H, D] and k [T, Hkv, D] through sgl_kernel (neox layout, as `forward`)."""
        t = positions if isinstance(positions, RopeTable) else self.table(positions)
        half = t.cos.shape[-1] // 2
        if t.cos is not self.cos:  # a step's own table (M-RoPE)
            cos_sin = torch.cat((t.cos[:, :half], t.sin[:, :half]), dim=-1).contiguous()
        elif self._cos_sin is None:  # [positions, D]: the cos half, then the sin half (fp32)
            cos_sin = self._cos_sin = torch.cat((self.cos[:, :half], self.sin[:, :half]), dim=-1).contiguous()
        else:
            cos_sin = self._cos_sin
        # .view, not .reshape: a copy would take the rotation away from q and k.
        sgl.apply_rope_with_cos_sin_cache_inplace(t.rows, q.view(q.shape[0], -1), k.view(k.shape[0], -1),
                                                  q.shape[-1], cos_sin, is_neox=True)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's M-RoPE: a token has a time, a height and a width position; frequency j of each half turns by
    the position of the axis `mrope_section` gives it (the first section's by time, and so on). A text token's
    three positions are equal: its rotation is plain RoPE's, so decode steps use the inherited tables as they are."""

    axis: torch.Tensor  # [D]: the position axis (0, 1, 2) of each column (a buffer, registered below)

    def __init__(self, head_dim: int, max_positions: int, base: float, mrope_section: tuple[int, ...]):
        super().__init__(head_dim, max_positions, base)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(mrope_section)} must add up to head_dim / 2 = {head_dim // 2}")
        axis = torch.cat([torch.full((n,), i) for i, n in enumerate(mrope_section)])
        self.register_buffer("axis", torch.cat((axis, axis)), persistent=False)  # [D]: the axis of each column

    def table_3d(self, positions: torch.Tensor) -> RopeTable:
        """A table with a row per token of `positions` [3, T] (time, height, width)."""
        T, D = positions.shape[1], self.cos.shape[-1]
        pick = self.axis.view(1, 1, D).expand(1, T, D)
        cos = self.cos[positions].gather(0, pick)[0]  # [3, T, D] -> [T, D]: each column from its axis' row
        sin = self.sin[positions].gather(0, pick)[0]
        return RopeTable(torch.arange(T, device=positions.device), cos, sin)
