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
from typing import TYPE_CHECKING

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from minisgl_cli.client.protocol import EngineClient

log = logging.getLogger("minisgl.backends")

SERIAL = ("hf", "mlx")  # engines of their own: no paged KV pool, no scheduler, no multi-process runtime
# The engine options a serial engine honours; every other one configures ours (commands/common.py refuses it there).
SERIAL_OPTIONS = ("model", "engine", "device", "dtype")


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
