"""HF checkpoint directories: config.json and *.safetensors, streamed into the model tensor by tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from minisgl_cli.loader.errors import ModelLoadError


def read_hf_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError("model config not found", path, "an HF model directory with config.json") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"model config unreadable ({exc})", path, "a JSON config.json") from None


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one at a time, so peak memory is one tensor, not the checkpoint."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError("no weights", model_dir, "*.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"weights unreadable ({exc})", file, "a valid safetensors file") from None
