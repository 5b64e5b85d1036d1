"""Quantized weights as checkpoints carry them: 4-bit and 8-bit integer groups, and FP8 blocks, with their scales.

A GGUF's Q4_0 / Q4_1 / Q8_0 tensors arrive as these (loader/gguf.py keeps them as shipped), and a
dense tensor quantizes into them at load (`--quantization int4|int8` on a safetensors model). The
quantized linear methods (layers/quant.py) take them shard by shard: `narrow` cuts a TP shard or a
merged-projection slice without touching the integers.

  Int4Groups  w[n, k] = scale[n, g] * q[n, k] + min[n, g],  q in 0..15,   g = k // group
              (GGUF Q4_1 as is; Q4_0 is min = -8 * scale)
  Int8Groups  w[n, k] = scale[n, g] * q[n, k],              q in -127..127
              (GGUF Q8_0: group 32; per output channel: group = in_features)
  Fp8Blocks   w[n, k] = scale_inv[n // bn, k // bk] * q[n, k],         q e4m3
              (DeepSeek-V3's and Qwen3-FP8's `weight` + `weight_scale_inv`, blocks of bn x bk = 128 x 128; the
              last block of a row or column may be partial: the scale grid is rounded up)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class Int4Groups:
    q: torch.Tensor  # uint8 [N, K], one 4-bit value per byte
    scale: torch.Tensor  # [N, K // group]
    min: torch.Tensor  # [N, K // group]
    group: int = 32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def narrow(self, dim: int, start: int, size: int) -> Int4Groups:
        if dim == 0:
            return replace(self, q=self.q.narrow(0, start, size), scale=self.scale.narrow(0, start, size),
                           min=self.min.narrow(0, start, size))
        g0, gn = _group_range(start, size, self.group)
        return replace(self, q=self.q.narrow(1, start, size), scale=self.scale.narrow(1, g0, gn),
                       min=self.min.narrow(1, g0, gn))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # scale * q, then + min, each rounded in fp32: the same numbers as gguf-py's Q4_1 dequantize.
        n, k = self.q.shape
        q = self.q.view(n, k // self.group, self.group).float()
        w = q * self.scale.float()[..., None] + self.min.float()[..., None]
        return w.view(n, k).to(dtype)


@dataclass(frozen=True)
class Int8Groups:
    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # [N, K // group]
    group: int = 32

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def narrow(self, dim: int, start: int, size: int) -> Int8Groups:
        if dim == 0:
            return replace(self, q=self.q.narrow(0, start, size), scale=self.scale.narrow(0, start, size))
        if self.group == self.q.shape[1]:  # per channel: every column of a row shares its scale
            return replace(self, q=self.q.narrow(1, start, size), group=size)
        g0, gn = _group_range(start, size, self.group)
        return replace(self, q=self.q.narrow(1, start, size), scale=self.scale.narrow(1, g0, gn))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        w = self.scale.float()[..., None] * self.q.view(n, k // self.group, self.group).float()
        return w.view(n, k).to(dtype)


@dataclass(frozen=True)
class Fp8Blocks:
    q: torch.Tensor  # e4m3 [N, K]
    scale_inv: torch.Tensor  # fp32 [ceil(N / bn), ceil(K / bk)]: each block's dequantization scale (DeepSeek's name)
    block: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def narrow(self, dim: int, start: int, size: int) -> Fp8Blocks | torch.Tensor:
        """The rows or columns start..start + size: as blocks where start falls on a block (a TP shard, a merged
        projection's part, the last one maybe partial), else dequantized (only a dense method can take those)."""
        b = self.block[dim]
        if start % b or (size % b and start + size != self.q.shape[dim]):
            return self.dequantize().narrow(dim, start, size)
        return replace(self, q=self.q.narrow(dim, start, size),
                       scale_inv=self.scale_inv.narrow(dim, start // b, -(-size // b)))

    def take_rows(self, order: torch.Tensor) -> Fp8Blocks | torch.Tensor:
        """Rows reordered (q[order]): as blocks where every row stays in its block of rows, else dequantized."""
        rows = torch.arange(len(order))
        if torch.equal(order // self.block[0], rows // self.block[0]):
            return replace(self, q=self.q[order])
        return self.dequantize()[order]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        n, k = self.q.shape
        bn, bk = self.block
        scale = self.scale_inv.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:n, :k]
        return (self.q.float() * scale).to(dtype)


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> Fp8Blocks:
    """w [N, K] as e4m3 blocks the way DeepSeek's checkpoints are made: scale_inv = max |block| / 448 per block (448:
    e4m3's largest value), q = w / scale_inv rounded to e4m3."""
    n, k = w.shape
    bn, bk = block
    wf = torch.nn.functional.pad(w.float(), (0, -k % bk, 0, -n % bn))
    tiles = wf.view(wf.shape[0] // bn, bn, wf.shape[1] // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp_(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    q = q.view(wf.shape)[:n, :k].contiguous()
    return Fp8Blocks(q, scale, block)


Blocks = Int4Groups | Int8Groups  # a GGUF's weight (loader/hf.py's Weight: what a layer loads, these included)


def quantize_int4(w: torch.Tensor, group: int = 32) -> Int4Groups:
    """Asymmetric 4-bit groups, as llama.cpp's Q4_1 makes them: min and (max - min) / 15 per group."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 needs in_features divisible by {group}, got {k}")
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = (hi - lo) / 15
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = ((wg - lo[..., None]) * inv[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    return Int4Groups(q.view(n, k), scale, lo, group)


def int8_scales(w: torch.Tensor) -> torch.Tensor:
    """quantize_int8's scales of w [N, K]: max |w| / 127 per row, [N, 1]."""
    return w.float().abs().amax(-1, keepdim=True) / 127


def quantize_int8(w: torch.Tensor, scale: torch.Tensor | None = None) -> Int8Groups:
    """Symmetric 8-bit per output channel: scale = max |w| / 127 per row (`scale`: given, e.g. the whole rows' of which
    w is some columns)."""
    wf = w.float()
    scale = int8_scales(wf) if scale is None else scale
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = (wf * inv).round_().clamp_(-127, 127).to(torch.int8)
    return Int8Groups(q, scale, group=w.shape[1])


def _group_range(start: int, size: int, group: int) -> tuple[int, int]:
    if start % group or size % group:
        raise ValueError(f"a shard of columns {start}..{start + size} does not fall on {group}-wide groups")
    return start // group, size // group


# --- on disk: one safetensors file, the 4-bit values packed two to a byte -------------------------
# A quantized weight `name` is stored as `name.q4` (uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in
# the high one), `name.q4_scale`, `name.q4_min`; or `name.q8` (int8 [N, K]), `name.q8_scale`. Any other
# tensor is stored under its own name.
_SIDE_PARTS = (".q4_scale", ".q4_min", ".q8_scale")  # read with their weight's `.q4` / `.q8`
BLOCKS_FILE = "gguf-blocks/model.safetensors"  # in a GGUF's converted HF dir; a subdir, so *.safetensors globs skip it


def blocks_file(model_dir: Path) -> Path | None:
    """The quantized checkpoint beside an HF dir's dense one (a converted GGUF has one), or None."""
    path = Path(model_dir) / BLOCKS_FILE
    return path if path.is_file() else None


def native_quantization(path: Path) -> str | None:
    """"int4" / "int8" when the decoder layers' weights in a `save_blocks` file are 4-bit / 8-bit groups, else None."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        kinds = {k.rpartition(".")[2] for k in f.keys() if k.startswith("model.layers.")}
    return "int4" if "q4" in kinds else "int8" if "q8" in kinds else None


def save_blocks(weights: dict[str, torch.Tensor | Blocks], path: Path) -> None:
    from safetensors.torch import save_file

    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if isinstance(w, Int4Groups):
            q = w.q.contiguous()
            out[f"{name}.q4"] = q[:, 0::2] | (q[:, 1::2] << 4)
            out[f"{name}.q4_scale"], out[f"{name}.q4_min"] = w.scale.contiguous(), w.min.contiguous()
        elif isinstance(w, Int8Groups):
            out[f"{name}.q8"], out[f"{name}.q8_scale"] = w.q.contiguous(), w.scale.contiguous()
        else:
            out[name] = w.contiguous()
    save_file(out, str(path), metadata={"format": "minisgl-blocks"})


def iter_blocks(path: Path) -> Iterator[tuple[str, torch.Tensor | Blocks]]:
    """(name, tensor or quantized groups) for each weight of a file `save_blocks` wrote, one at a time."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            if key.endswith(_SIDE_PARTS):
                continue
            base, _, kind = key.rpartition(".")
            if kind == "q4":
                packed = f.get_tensor(key)
                q = torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)
                scale = f.get_tensor(f"{base}.q4_scale")
                yield base, Int4Groups(q, scale, f.get_tensor(f"{base}.q4_min"), q.shape[1] // scale.shape[1])
            elif kind == "q8":
                q8, scale = f.get_tensor(key), f.get_tensor(f"{base}.q8_scale")
                yield base, Int8Groups(q8, scale, q8.shape[1] // scale.shape[1])
            else:
                yield key, f.get_tensor(key)
