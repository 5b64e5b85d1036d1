"""HF checkpoint directories: config.json and *.safetensors, streamed into the model tensor by tensor.

Tensors come lazily (`LazyTensor`): a layer reads only the rows or columns its TP rank holds, so no
rank reads a whole checkpoint into memory.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import safe_open

from minisgl_cli.loader.blocks import Int4Groups, Int8Groups
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

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._view[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._view[:]


# What a layer's load_shard receives: a tensor, read or not yet, or a GGUF's quantized groups (loader/blocks.py).
Weight = Union[torch.Tensor, LazyTensor, Int4Groups, Int8Groups]


def whole(w: Weight) -> torch.Tensor:
    """The entire tensor as a plain one (norm weights, biases: every rank holds all of it); groups dequantized."""
    if isinstance(w, torch.Tensor):
        return w
    return w.full() if isinstance(w, LazyTensor) else w.dequantize()


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
