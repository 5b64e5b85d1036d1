"""Weights: where models come from and how they reach the engine (HF dir, GGUF, dummy)."""

from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.loader.resolve import ResolvedModel, resolve_model

__all__ = ["ModelLoadError", "ResolvedModel", "resolve_model"]
