"""MXFP4 expert weights as gpt-oss checkpoints ship them: kept packed, or dequantized as they load.

A checkpoint whose config says `quantization_config.quant_method: mxfp4` carries each layer's stacked experts as
two tensors per projection instead of one:

  `<proj>_blocks`  uint8 [E, rows, cols / 32, 16]  two FP4 (e2m1) codes per byte, the low nibble first
  `<proj>_scales`  uint8 [E, rows, cols / 32]      one e8m0 exponent per 32 values: 2 ** (s - 127)

where (rows, cols) is (2I, H) for `gate_up_proj` (gate and up rows interleaved) and (H, I) for `down_proj`.
`expert_weights` pairs them up (they may come in either order, from different shards) and checks their shapes; on a
CUDA GPU (layers/quant.py's mxfp4, where `packs`) it yields both parts as they are, for the experts to hold packed
(layers/moe.py's Experts; kernels/triton/moe.py widens them in registers), else the projection under its bf16 name in
the bf16 checkpoints' layout, [E, cols, rows], so the experts load it as they load those. The numbers are
transformers' `convert_moe_packed_tensors`: a code's value times its block's power of two, exact in bf16 and fp32.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.loader.hf import Weight, whole

# e2m1: the value of each 4-bit code (the sign is the top bit)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
_PARTS = ("_blocks", "_scales")


def is_mxfp4(hf_cfg: dict[str, Any]) -> bool:
    """Whether a checkpoint's config says its experts are MXFP4."""
    return (hf_cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def packs(hf_cfg: dict[str, Any], tp_size: int) -> bool:
    """Whether an MXFP4 checkpoint's experts can stay packed at TP `tp_size`: each rank's share of an expert's width
    (the down projection's columns) whole 32-value blocks (gpt-oss's 2880: TP 1 and 2, not 4)."""
    width = hf_cfg.get("intermediate_size", 0)
    return is_mxfp4(hf_cfg) and width % tp_size == 0 and width // tp_size % BLOCK == 0


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, G, 16] codes and [..., rows, G] exponents -> [..., rows, G * 32] values in `dtype`."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).int()  # [..., G, 32], low nibble first
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def expert_weights(weights: Iterable[tuple[str, Weight]], dtype: torch.dtype, device: torch.device,
                   shapes: dict[str, tuple[int, int, int]], source: Path | str,
                   packed: bool = False) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with each MXFP4 pair checked and kept as it is (`packed`: `<proj>_blocks` and
    `<proj>_scales`, unread yet) or replaced by the projection it stands for, [E, cols, rows] in `dtype` (computed on
    `device`); `shapes`: each projection's (E, rows, cols) as the model expects it, so a malformed pair is refused by
    name before anything is copied."""
    held: dict[str, dict[str, Weight]] = {}
    for name, tensor in weights:
        part = next((p for p in _PARTS if name.endswith(p)), None)
        if part is None:
            yield name, tensor
            continue
        stem = name.removesuffix(part)
        pair = held.setdefault(stem, {})
        pair[part] = tensor
        if len(pair) < 2:
            continue
        del held[stem]
        proj = stem.rpartition(".")[2]
        _check(stem, proj, pair["_blocks"], pair["_scales"], shapes, source)
        if packed:
            yield from ((stem + p, pair[p]) for p in _PARTS)
            continue
        blocks, scales = whole(pair["_blocks"]), whole(pair["_scales"])
        blocks, scales = blocks.to(device), scales.to(device)
        out = torch.empty(blocks.shape[0], blocks.shape[2] * BLOCK, blocks.shape[1], dtype=dtype, device=device)
        for e in range(out.shape[0]):  # an expert at a time: the codes' temporaries stay one expert's size
            out[e] = dequantize(blocks[e], scales[e], dtype).t()
        yield stem, out
    if held:
        stem, pair = next(iter(held.items()))
        missing = next(p for p in _PARTS if p not in pair)
        raise ModelLoadError(f"MXFP4 tensor {stem}{missing} missing (its pair {next(iter(pair))} is there)", source,
                             "each MXFP4 projection as _blocks and _scales")


def _check(stem: str, proj: str, blocks: Weight, scales: Weight, shapes: dict[str, tuple[int, int, int]],
           source: Path | str) -> None:
    expected = shapes.get(proj)
    if expected is None:
        raise ModelLoadError(f"MXFP4 tensor {stem}_blocks is not an expert projection", source,
                             f"MXFP4 only for {' and '.join(shapes)}")
    e, rows, cols = expected
    want_blocks, want_scales = (e, rows, cols // BLOCK, BLOCK // 2), (e, rows, cols // BLOCK)
    kinds = [_dtype(t) for t in (blocks, scales)]
    if (kinds != ["uint8", "uint8"] or tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_scales
            or cols % BLOCK):
        raise ModelLoadError(
            f"MXFP4 tensor {stem}: blocks {kinds[0]} {list(blocks.shape)}, scales {kinds[1]} "
            f"{list(scales.shape)}", source,
            f"blocks uint8 {list(want_blocks)} and scales uint8 {list(want_scales)} for this config")


def _dtype(w: Weight) -> str:
    """A tensor's element type by name, read or not (a LazyTensor's safetensors name: U8)."""
    stored = getattr(w, "stored_dtype", None)
    if stored is not None:
        return "uint8" if stored == "U8" else stored
    return str(getattr(w, "dtype", type(w).__name__)).removeprefix("torch.")
