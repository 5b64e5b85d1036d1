"""Engine backends: which implementation runs the model (`--engine`, the reference stack's BACKEND_IMPL), each
behind the same EngineClient.

torch is our engine (LocalClient, or the multi-process runtime); sgl is the same engine with sgl_kernel's fused
ops (the Engine itself falls back to torch ops, saying why); hf and mlx are serial engines (serial.py): HF
transformers streaming (hf.py) and mlx-lm (mlx.py), one request at a time, in this process.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import platform
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from minisgl_cli.client.protocol import EngineClient

log = logging.getLogger("minisgl.backends")

SERIAL = ("hf", "mlx")  # engines of their own: no paged KV pool, no scheduler, no multi-process runtime
# EngineConfig's options that configure our engine only (the serial engines would ignore them).
TORCH_ONLY = ("load_format", "quantization", "attention_backend", "page_size", "max_total_tokens", "kv_cache_gib",
              "mem_fraction", "max_running_requests", "disable_cuda_graph", "cuda_graph_max_bs")


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def mlx_available() -> bool:
    return importlib.util.find_spec("mlx_lm") is not None


def resolve(engine: str) -> str:
    """The engine `--engine` names; auto: mlx on Apple Silicon when mlx-lm is installed, torch otherwise."""
    return _auto() if engine == "auto" else engine


@functools.cache  # decided (and its fallback said) once per process
def _auto() -> str:
    if apple_silicon():
        if mlx_available():
            return "mlx"
        log.warning("--engine auto: the torch engine (mlx-lm is not installed: pip install 'minisgl[mlx]')")
    return "torch"


def serial_conflicts(engine: str, cfg: EngineConfig, sched: SchedulerConfig) -> list[str]:
    """The flags set away from their defaults that a serial engine has no use for (they configure ours)."""
    if engine not in SERIAL:
        return []
    out = []
    for obj, names in ((cfg, TORCH_ONLY), (sched, [f.name for f in fields(sched) if "flags" in f.metadata])):
        for f in fields(obj):
            if f.name in names and getattr(obj, f.name) != f.default:
                out.append(f.metadata["flags"][0])
    return out


def in_process_client(cfg: EngineConfig, sched: SchedulerConfig | None = None) -> EngineClient:
    """The EngineClient of `cfg.engine` in this process (our engine: LocalClient, its scheduler on a thread)."""
    engine = resolve(cfg.engine)
    if engine == "hf":
        from minisgl_cli.backends.hf import HFClient

        return HFClient.from_config(cfg)
    if engine == "mlx":
        from minisgl_cli.backends.mlx import MLXClient

        return MLXClient.from_config(cfg)
    from minisgl_cli.client.local import LocalClient

    return LocalClient(cfg, sched)
