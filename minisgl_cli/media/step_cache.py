"""Step caching through cache-dit (`--media-cache`): approximate, opt-in. A step whose first blocks' residual
changed little since the last computed step reuses the cached residual of the rest of the DiT.

  fbcache     First-Block-Cache: the first block decides (F1B0), residual threshold 0.12
  dbcache     DBCache: the first 8 blocks compute and decide (F8B0), threshold 0.12 (more accurate, less skipped)
  taylorseer  DBCache plus a first-order TaylorSeer calibrator: skipped steps extrapolate the residual

The first steps always compute (4 for an image pipeline, as cache-dit's own Z-Image-Turbo example warms up its 9
steps; 8 for video). cache-dit's `summary` reports which steps were cached (`cached_steps`).

`--media-cache MODE:KEY=VALUE,...` tunes it (sglang's SGLANG_CACHE_DIT_* knobs, cache-dit's names in brackets):
threshold (residual_diff_threshold), warmup (max_warmup_steps), front / back (Fn / Bn_compute_blocks: the blocks
that always compute), max-continuous (max_continuous_cached_steps: -1 no limit), max-cached (max_cached_steps),
order (the TaylorSeer's, 1 or 2). E.g. `fbcache:threshold=0.24,max-continuous=3` is sglang's default.

scm=slow|medium|fast|ultra adds cache-dit's step computation mask (SCM; SGLANG_CACHE_DIT_SCM_PRESET): a schedule,
drawn for each call's step count, of the steps that always compute (20 of 50 for `fast`); the others may reuse the
cache: `scm-policy=dynamic` (the default, as sglang's) when the residual test passes, `static` always. Step counts
the presets do not cover (below 8 but 4 and 6) compute every step.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from minisgl_cli.media.jobs import Kind, MediaError

MODES = ("dbcache", "fbcache", "taylorseer")
SCM_PRESETS = ("slow", "medium", "fast", "ultra")
SCM_POLICIES = ("dynamic", "static")
SCM_SHORT_STEPS = (4, 6)  # the step counts below 8 that cache-dit's presets have masks for
THRESHOLD = 0.12  # cache-dit's own default residual_diff_threshold
WARMUP = {"image": 4, "video": 8}


@dataclass(frozen=True)
class CacheSpec:
    """A --media-cache value, MODE[:KEY=VALUE,...], parsed; None: the mode's and the pipeline kind's default."""

    mode: str
    threshold: float = THRESHOLD
    warmup: int | None = None  # WARMUP[kind]
    front: int | None = None  # 1 for fbcache; 8 (fewer in a shorter stack) for dbcache and taylorseer
    back: int = 0
    max_continuous: int = -1  # -1: no limit
    max_cached: int = -1
    order: int = 1
    scm: str | None = None  # a SCM_PRESETS name: the steps that always compute
    scm_policy: str = "dynamic"


class _Option(NamedTuple):
    kind: type
    ok: Callable[[Any], bool]
    range: str


_OPTIONS = {
    "threshold": _Option(float, lambda v: v > 0, "a number > 0"),
    "warmup": _Option(int, lambda v: v >= 0, "an integer >= 0"),
    "front": _Option(int, lambda v: v >= 1, "an integer >= 1"),
    "back": _Option(int, lambda v: v >= 0, "an integer >= 0"),
    "max-continuous": _Option(int, lambda v: v == -1 or v >= 1, "-1 or an integer >= 1"),
    "max-cached": _Option(int, lambda v: v >= -1, "-1 or an integer >= 0"),
    "order": _Option(int, lambda v: v in (1, 2), "1 or 2"),
    "scm": _Option(str, lambda v: v in SCM_PRESETS, " or ".join(SCM_PRESETS)),
    "scm-policy": _Option(str, lambda v: v in SCM_POLICIES, " or ".join(SCM_POLICIES)),
}


def parse(value: str) -> CacheSpec:
    """--media-cache's value as a CacheSpec; a MediaError names what is wrong."""
    mode, _, rest = value.partition(":")
    if mode not in MODES:
        raise MediaError(f"unknown --media-cache {mode!r}: use one of {', '.join(MODES)} "
                         "(then :key=value,... to tune it)", "media_cache")
    spec, given = CacheSpec(mode), set()
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, raw = (part.strip() for part in item.partition("="))
        option = _OPTIONS.get(key)
        if option is None or not eq:
            raise MediaError(f"--media-cache {mode}: {item!r} is not an option: use key=value with a key of "
                             f"{', '.join(_OPTIONS)}", "media_cache")
        try:
            parsed = option.kind(raw)
        except ValueError:
            parsed = None
        if parsed is None or not option.ok(parsed):
            raise MediaError(f"--media-cache {mode}: {key}={raw!r} must be {option.range}", "media_cache")
        if key == "order" and mode != "taylorseer":
            raise MediaError(f"--media-cache {mode}: order is the TaylorSeer's (use taylorseer)", "media_cache")
        spec = replace(spec, **{key.replace("-", "_"): parsed})
        given.add(key)
    if spec.scm is None and "scm-policy" in given:
        raise MediaError(f"--media-cache {mode}: scm-policy needs a mask (add scm={'|'.join(SCM_PRESETS)})",
                         "media_cache")
    return spec


def check(value: str) -> str:
    """value, once parse takes it."""
    parse(value)
    return value


def _quiet(log: logging.Logger) -> None:
    """cache-dit logs its info lines (and a benign pattern-check warning) to stdout, where `minisgl image` prints
    the file paths: errors only, on stderr."""
    for handler in log.handlers:
        handler.setLevel(logging.ERROR)
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def enable(pipe: Any, value: str, kind: Kind) -> None:
    """Hook cache-dit's step cache of a --media-cache value into `pipe` (in place)."""
    spec = parse(value)
    try:
        import cache_dit
    except ImportError:
        raise MediaError("--media-cache needs cache-dit (pip install 'cache-dit==1.5.3', or minisgl's media extra)",
                         "media_cache") from None
    _quiet(logging.getLogger("CACHE_DIT"))
    blocks = _num_blocks(pipe)
    front = spec.front or (1 if spec.mode == "fbcache" else min(8, max(1, blocks - 1)))
    if blocks and front + spec.back > blocks:
        raise MediaError(f"--media-cache {value}: front + back = {front + spec.back} blocks always computed, but "
                         f"{type(pipe.transformer).__name__} has {blocks}", "media_cache")
    config = cache_dit.DBCacheConfig(
        Fn_compute_blocks=front, Bn_compute_blocks=spec.back, residual_diff_threshold=spec.threshold,
        max_warmup_steps=WARMUP[kind] if spec.warmup is None else spec.warmup, max_cached_steps=spec.max_cached,
        max_continuous_cached_steps=spec.max_continuous, steps_computation_policy=spec.scm_policy)
    calibrator = (cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=spec.order) if spec.mode == "taylorseer"
                  else None)
    try:
        cache_dit.enable_cache(pipe, cache_config=config, calibrator_config=calibrator)
    except Exception as exc:  # a pipeline cache-dit has no adapter for
        raise MediaError(f"--media-cache {spec.mode}: cache-dit cannot cache {type(pipe).__name__} ({exc})",
                         "media_cache") from None


def prepare(pipe: Any, value: str, steps: int) -> None:
    """Before a call of `steps` steps: draw a scm= mask for that many. The wrapped pipeline builds each call's cache
    context from the config `enable` gave cache-dit (kept on the DiT as `_context_kwargs`, one per block stack)."""
    spec = parse(value)
    if spec.scm is None:
        return
    import cache_dit

    # The presets cover 8 steps and more, and 4 or 6 (distilled models); other counts compute every step. (Decided
    # here: cache-dit refuses them by an assert, and under `python -O` its loop then never ends.)
    covered = steps >= 8 or steps in SCM_SHORT_STEPS
    mask = cache_dit.steps_mask(total_steps=steps, mask_policy=spec.scm) if covered else None
    for config in _cache_configs(pipe):
        config.num_inference_steps = steps
        config.steps_computation_mask = mask


def _cache_configs(pipe: Any) -> list[Any]:
    """The cache configs cache-dit keeps for `pipe`'s DiT(s) and their block stacks, each once."""
    from torch import nn

    found: dict[int, Any] = {}
    for name in ("transformer", "transformer_2"):
        denoiser = getattr(pipe, name, None)
        if denoiser is None:
            continue
        holders = [denoiser, *(m for m in denoiser.children() if isinstance(m, nn.ModuleList))]
        for holder in holders:
            kwargs = getattr(holder, "_context_kwargs", None)
            if kwargs and kwargs.get("cache_config") is not None:
                found.setdefault(id(kwargs["cache_config"]), kwargs["cache_config"])
    return list(found.values())


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
