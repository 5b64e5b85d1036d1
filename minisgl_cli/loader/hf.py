"""HF checkpoint directories: config.json and *.safetensors, streamed into the model tensor by tensor.

Tensors come lazily (`LazyTensor`): a layer reads only the rows or columns its TP rank holds, so no
rank reads a whole checkpoint into memory. A block-wise FP8 checkpoint (quantization_config: quant_method fp8,
weight_block_size: DeepSeek-V3's) carries each linear's `weight` in e4m3 beside its `weight_scale_inv`; the two
come paired as one `Fp8Blocks` (`with_fp8_blocks`), which a method made for them keeps (layers/quant.py's
fp8-block, CUDA) and any other dequantizes (`whole`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import safe_open

from minisgl_cli.loader.blocks import Fp8Blocks, Int4Groups, Int8Groups
from minisgl_cli.loader.errors import ModelLoadError


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError("model config not found", path, "an HF model directory with config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"model config unreadable ({exc})", path, "a JSON config.json") from None


class LazyTensor:
    """One checkpoint tensor, not read yet: `narrow` reads just the rows or columns asked for (safetensors maps
    the file, so only those bytes are copied), `full()` the whole of it. It has torch.Tensor's `shape` and
    `narrow`, so a layer loads from either."""

    def __init__(self, view: Any):
        self._view = view
        self.shape = torch.Size(view.get_shape())
        self.stored_dtype: str = view.get_dtype()  # safetensors' name: "BF16", "F8_E4M3", ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._view[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._view[:]


# What a layer's load_shard receives: a tensor, read or not yet, or a GGUF's quantized groups (loader/blocks.py).
Weight = Union[torch.Tensor, LazyTensor, Int4Groups, Int8Groups, Fp8Blocks]


def whole(w: Weight) -> torch.Tensor:
    """The entire tensor as a plain one (norm weights, biases: every rank holds all of it); groups dequantized."""
    if isinstance(w, torch.Tensor):
        return w
    return w.full() if isinstance(w, LazyTensor) else w.dequantize()


def fp8_block_size(cfg: dict) -> tuple[int, int] | None:
    """An HF config's FP8 weight blocks (rows, columns), None where the checkpoint is not FP8; the FP8 forms minisgl
    does not load (per-tensor or per-channel scales, static activation scales) refused by name."""
    q = cfg.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise ValueError("this FP8 checkpoint has no weight_block_size: only block-wise FP8 weights (DeepSeek-V3's "
                         "form) load; use a bf16 copy")
    if q.get("activation_scheme", "dynamic") != "dynamic" or q.get("fmt", "e4m3") != "e4m3":
        raise ValueError("FP8 checkpoints load with dynamic activation scales and e4m3 weights only, not "
                         f"activation_scheme {q.get('activation_scheme')!r} / fmt {q.get('fmt')!r}")
    return int(block[0]), int(block[1])


def with_fp8_blocks(weights: Iterable[tuple[str, Weight]], block: tuple[int, int]) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with each e4m3 `X.weight` and its `X.weight_scale_inv` as one `Fp8Blocks` named
    X.weight (whichever comes first waits for the other; the e4m3 codes are read whole: a byte a weight)."""
    codes: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, w in weights:
        if name.endswith(".weight_scale_inv"):
            base = name.removesuffix("_scale_inv")
            scales[base] = whole(w).float()
        elif getattr(w, "stored_dtype", None) == "F8_E4M3" or getattr(w, "dtype", None) == torch.float8_e4m3fn:
            base = name
            codes[base] = whole(w)
        else:
            yield name, w
            continue
        if base in codes and base in scales:
            yield base, Fp8Blocks(codes.pop(base), scales.pop(base), block)
    if codes or scales:
        raise ModelLoadError(f"FP8 weights without their scales, or scales without their weights: "
                             f"{sorted({*codes, *scales})[:3]}")


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, LazyTensor]]:
    """Yield (name, tensor) one at a time, lazily: peak memory is one shard, not the checkpoint."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError("no weights", model_dir, "*.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, LazyTensor(f.get_slice(name))
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"weights unreadable ({exc})", file, "a valid safetensors file") from None
