"""Step caching through cache-dit (`--media-cache`): approximate, opt-in. A step whose first blocks' residual
changed little since the last computed step reuses the cached residual of the rest of the DiT.

  fbcache     First-Block-Cache: the first block decides (F1B0), residual threshold 0.12
  dbcache     DBCache: the first 8 blocks compute and decide (F8B0), threshold 0.12 (more accurate, less skipped)
  taylorseer  DBCache plus a first-order TaylorSeer calibrator: skipped steps extrapolate the residual

The first steps always compute (4 for an image pipeline, as cache-dit's own Z-Image-Turbo example warms up its 9
steps; 8 for video). cache-dit's `summary` reports which steps were cached (`cached_steps`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from minisgl_cli.media.jobs import Kind, MediaError

MODES = ("dbcache", "fbcache", "taylorseer")
THRESHOLD = 0.12  # cache-dit's own default residual_diff_threshold
WARMUP = {"image": 4, "video": 8}


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise MediaError(f"unknown --media-cache {mode!r}: use one of {', '.join(MODES)}", "media_cache")
    return mode


def _quiet(log: logging.Logger) -> None:
    """cache-dit logs its info lines (and a benign pattern-check warning) to stdout, where `minisgl image` prints
    the file paths: errors only, on stderr."""
    for handler in log.handlers:
        handler.setLevel(logging.ERROR)
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def enable(pipe: Any, mode: str, kind: Kind, threshold: float = THRESHOLD) -> None:
    """Hook cache-dit's step cache into `pipe` (in place); `threshold`: the residual change below which a step
    reuses the cache (higher: more steps skipped, more drift)."""
    check_mode(mode)
    try:
        import cache_dit
    except ImportError:
        raise MediaError("--media-cache needs cache-dit (pip install 'cache-dit==1.5.3', or minisgl's media extra)",
                         "media_cache") from None
    _quiet(logging.getLogger("CACHE_DIT"))
    blocks = _num_blocks(pipe)
    front = 1 if mode == "fbcache" else min(8, max(1, blocks - 1))
    config = cache_dit.DBCacheConfig(Fn_compute_blocks=front, Bn_compute_blocks=0, residual_diff_threshold=threshold,
                                     max_warmup_steps=WARMUP[kind])
    calibrator = cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=1) if mode == "taylorseer" else None
    try:
        cache_dit.enable_cache(pipe, cache_config=config, calibrator_config=calibrator)
    except Exception as exc:  # a pipeline cache-dit has no adapter for
        raise MediaError(f"--media-cache {mode}: cache-dit cannot cache {type(pipe).__name__} ({exc})",
                         "media_cache") from None


def cached_steps(pipe: Any) -> list[int]:
    """The steps of the last call that reused the cache (cache-dit's summary), for tests and the benchmark."""
    import cache_dit

    steps: set[int] = set()
    for stats in cache_dit.summary(pipe, logging=False):
        steps.update(stats.cached_steps or ())
    return sorted(steps)


def _num_blocks(pipe: Any) -> int:
    """The DiT's main stack (its longest ModuleList: Z-Image's `layers`, not its refiners; Wan's `blocks`)."""
    from torch import nn

    denoiser = getattr(pipe, "transformer", None)
    stacks = [len(m) for m in denoiser.children() if isinstance(m, nn.ModuleList)] if denoiser is not None else []
    return max(stacks, default=0)
