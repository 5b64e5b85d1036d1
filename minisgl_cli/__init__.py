"""minisgl: a compact LLM serving engine; the package root re-exports the Python API lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from minisgl_cli.llm import LLM
    from minisgl_cli.types import SamplingParams


def __getattr__(name: str) -> Any:
    # Lazy so `minisgl --help` and the media pipelines do not pay for importing torch models.
    if name == "LLM":
        from minisgl_cli.llm import LLM

        return LLM
    if name == "SamplingParams":
        from minisgl_cli.types import SamplingParams

        return SamplingParams
    raise AttributeError(name)
