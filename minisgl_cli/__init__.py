"""minisgl: a compact LLM serving engine; the package root re-exports the Python API lazily."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# OpenMP threads that wait at a barrier sleep instead of spinning (unless the user says otherwise). Read once, when
# torch loads libgomp: set here, before any import of torch by minisgl, and inherited by every engine process. On
# shared cores (the engine's own API, detokenizer and background build, other programs) a spinning thread holds the
# core its peer needs to reach the barrier: a decode step of the default model took 321 ms under load ~8 on 2 cores
# against 22 ms passive (docs/benchmarks.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
