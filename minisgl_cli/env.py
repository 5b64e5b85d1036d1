"""Every environment variable minisgl reads, parsed in one place, with one boolean parser (and TMPDIR, set for a call).

Command-line options declare their own variables (`envvar=` on the option: MODEL_NAME, PORT, BACKEND_IMPL,
...; each command's --help lists them) and Typer reads those. This module reads the rest. Each is read
when asked, not at import: the CLI, the tests and Python API users set them at run time.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

N = TypeVar("N")
D = TypeVar("D")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def flag(name: str, default: bool = False) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off/"" (any case); `default` when unset."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean: use 1/true/yes/on or 0/false/no/off")


def _text(name: str) -> str | None:
    """A string variable; None when unset or empty."""
    return os.environ.get(name) or None


def _path(name: str) -> Path | None:
    raw = _text(name)
    return Path(raw).expanduser() if raw else None


def _number(name: str, kind: Callable[[str], N], default: D) -> N | D:
    """A number variable parsed by `kind` (int or float); `default` when unset or empty."""
    raw = _text(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None


# --- engine --------------------------------------------------------------------------------------
def disable_overlap_scheduling() -> bool:
    """MINISGL_DISABLE_OVERLAP_SCHEDULING: read each step's tokens before launching the next."""
    return flag("MINISGL_DISABLE_OVERLAP_SCHEDULING")


def disable_fused_ops() -> bool:
    """MINISGL_DISABLE_FUSED_OPS: CUDA runs the plain torch ops instead of the fused Triton kernels."""
    return flag("MINISGL_DISABLE_FUSED_OPS")


def fused_decode() -> bool:
    """MINISGL_FUSED_DECODE=1 (opt-in): CUDA decode steps of 1-4 rows run the fused GEMVs (the gate-up projection
    with the SiLU-and-mul in its epilogue, the qkv projection with RoPE and the KV store in its; 2-4 rows through the
    GEMV, not cuBLAS). Off by default: on an H200 they were no faster at one row and 0.3-0.9x cuBLAS at 2-4 on most
    layers (docs/benchmarks.md, issue 50). Only with the fused ops on (MINISGL_DISABLE_FUSED_OPS unset)."""
    return flag("MINISGL_FUSED_DECODE", False)


def disable_pdl() -> bool:
    """MINISGL_DISABLE_PDL: no programmatic dependent launch between our Triton kernels (CUDA)."""
    return flag("MINISGL_DISABLE_PDL")


def torch_profiler_dir() -> Path | None:
    """MINISGL_TORCH_PROFILER_DIR: profile a window of busy scheduler steps with torch.profiler and write one
    table per rank there (sglang's SGLANG_TORCH_PROFILER_DIR); unset: no profiling."""
    return _path("MINISGL_TORCH_PROFILER_DIR")


def step_trace_dir() -> Path | None:
    """MINISGL_STEP_TRACE_DIR: write every scheduler step's launch (wall time, mode, rows, tokens, running, waiting)
    to `<dir>/rank<r>-trace.tsv`, for a timeline of a run (stalls, batch sizes); unset: no trace."""
    return _path("MINISGL_STEP_TRACE_DIR")


def profile_steps() -> tuple[int, int]:
    """MINISGL_PROFILE_SKIP / MINISGL_PROFILE_STEPS: busy steps to let pass first (default 50), then to profile
    (default 20)."""
    return _number("MINISGL_PROFILE_SKIP", int, 50), _number("MINISGL_PROFILE_STEPS", int, 20)


def use_fla() -> bool:
    """MINISGL_FLA: run a linear-attention hybrid's gated delta rule on CUDA through fla-core's Triton ops (the `fla`
    extra) instead of the torch reference; off by default until it runs clean here (attention/gated_delta.py)."""
    return flag("MINISGL_FLA")


def cpu_gemm() -> str:
    """MINISGL_CPU_GEMM: the CPU GEMM policy (auto, invariant, mkl, fp16; see layers/cpu_gemm.py)."""
    return _text("MINISGL_CPU_GEMM") or "auto"


def cpu_int4() -> str:
    """MINISGL_CPU_INT4: the CPU int4 decode kernel: auto (minisgl's where it builds, else ATen's), minisgl (an error
    if it cannot build), aten (kernels/cpu/int4.py)."""
    value = (_text("MINISGL_CPU_INT4") or "auto").lower()
    if value not in ("auto", "minisgl", "aten"):
        raise ValueError(f"MINISGL_CPU_INT4={value!r}: use auto, minisgl or aten")
    return value


def cxx() -> str:
    """CXX: the C++ compiler that builds minisgl's CPU kernels (kernels/cpu/library.py); default c++."""
    return _text("CXX") or "c++"


def sampler() -> str:
    """MINISGL_SAMPLER: the sampler's cut-and-draw implementation (auto, torch, triton; see sampling/sampler.py)."""
    return _text("MINISGL_SAMPLER") or "auto"


def torch_compile() -> Any:
    """MINISGL_TORCH_COMPILE: the default of --torch-compile (auto, on, off; EngineConfig checks the value)."""
    return _text("MINISGL_TORCH_COMPILE") or "auto"


# --- models on disk ------------------------------------------------------------------------------
def cache_dir() -> Path:
    """MINISGL_CACHE_DIR: where converted GGUF models go; default ~/.cache/minisgl."""
    return _path("MINISGL_CACHE_DIR") or Path.home() / ".cache" / "minisgl"


def inductor_cache_dir() -> Path:
    """TORCHINDUCTOR_CACHE_DIR: torch.compile's kernel cache; default <MINISGL_CACHE_DIR>/inductor (it outlives
    /tmp, so a later start reuses the kernels)."""
    return _path("TORCHINDUCTOR_CACHE_DIR") or cache_dir() / "inductor"


def compiled_dir() -> Path:
    """MINISGL_COMPILED_DIR: where the compiled CPU decode steps are stored (cpu_step/compiled.py); default
    <MINISGL_CACHE_DIR>/compiled."""
    return _path("MINISGL_COMPILED_DIR") or cache_dir() / "compiled"


_TEMP_DIR_LOCK = threading.RLock()


@contextlib.contextmanager
def temp_dir(path: Path) -> Iterator[None]:
    """TMPDIR set to `path` for the block, for C++ code that reads it there (AOTInductor's package loader unpacks
    into it); then as it was. One block at a time in a process: two that overlapped in two threads restored each
    other's value, leaving TMPDIR naming a removed dir for every later temp file and child (playwright, mlx)."""
    with _TEMP_DIR_LOCK:
        old = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = str(path)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TMPDIR", None)
            else:
                os.environ["TMPDIR"] = old


def hub_offline() -> bool:
    """HF_HUB_OFFLINE: resolve hub ids from the local HF cache only."""
    return flag("HF_HUB_OFFLINE")


def triton_interpret() -> bool:
    """TRITON_INTERPRET (Triton's own): its interpreter runs the Triton kernels on CPU tensors, so the triton attention
    backend takes a CPU device too (slow: for tests on a machine without a GPU)."""
    return flag("TRITON_INTERPRET")


# --- chat ----------------------------------------------------------------------------------------
def state_dir() -> Path:
    """MINISGL_HOME: where the chat history lives; default ~/.local/state/minisgl."""
    return _path("MINISGL_HOME") or Path.home() / ".local" / "state" / "minisgl"


# --- media (the server's image / video routes) ---------------------------------------------------
IMAGE_MODEL_DIR = "Z_IMAGE_MODEL_DIR"  # named in error messages, so users know what to set
VIDEO_MODEL_DIR = "MINISGL_VIDEO_MODEL_DIR"


def image_model() -> str | None:
    return _text("MINISGL_IMAGE_MODEL")


def video_model() -> str | None:
    return _text("MINISGL_VIDEO_MODEL")


def image_model_dir() -> Path | None:
    return _path(IMAGE_MODEL_DIR)


def video_model_dir() -> Path | None:
    return _path(VIDEO_MODEL_DIR)


# The media getters give None when unset: MediaSettings' fields hold the defaults.
def media_max_queue() -> int | None:
    """MINISGL_MEDIA_MAX_QUEUE (also --media-max-queue's): media jobs that may wait for the worker."""
    return _number("MINISGL_MEDIA_MAX_QUEUE", int, None)


def media_max_batch() -> int | None:
    """MINISGL_MEDIA_MAX_BATCH (also --media-max-batch's): images in one pipeline call."""
    return _number("MINISGL_MEDIA_MAX_BATCH", int, None)


def media_max_work() -> float | None:
    """MINISGL_MEDIA_MAX_WORK (also --media-max-work's): megapixel-steps admitted and not finished."""
    return _number("MINISGL_MEDIA_MAX_WORK", float, None)


def media_device() -> str | None:
    """MINISGL_DEVICE (also --device's variable): the device of the diffusion pipelines."""
    return _text("MINISGL_DEVICE")


def media_compile() -> bool | None:
    """MINISGL_MEDIA_COMPILE (--compile / --no-compile; serve's --media-compile): regional torch.compile of the DiT;
    unset or auto: None (on for CUDA)."""
    raw = (_text("MINISGL_MEDIA_COMPILE") or "auto").strip().lower()
    return None if raw == "auto" else flag("MINISGL_MEDIA_COMPILE")


def media_attention_backend() -> str | None:
    """MINISGL_MEDIA_ATTENTION (--attention-backend): the DiT's attention kernels."""
    return _text("MINISGL_MEDIA_ATTENTION")


def media_quantization() -> str | None:
    """MINISGL_MEDIA_QUANTIZATION (--quantization on image / video, --media-quantization on serve): fp8 DiT weights."""
    return _text("MINISGL_MEDIA_QUANTIZATION")


def media_cache() -> str | None:
    """MINISGL_MEDIA_CACHE (--media-cache): cache-dit's step cache (dbcache, fbcache, taylorseer[:key=value,...]);
    approximate."""
    return _text("MINISGL_MEDIA_CACHE")


def media_load_format() -> str | None:
    """MINISGL_MEDIA_LOAD_FORMAT (--load-format on image / video, --media-load-format on serve): auto or dummy."""
    return _text("MINISGL_MEDIA_LOAD_FORMAT")


def media_cuda_graphs() -> bool | None:
    """MINISGL_MEDIA_NO_GRAPHS (--disable-cuda-graph on image / video, --media-disable-cuda-graph on serve): set
    true, False (the media passes run eagerly); set false, True; unset, None (the default: graphs on CUDA)."""
    return None if _text("MINISGL_MEDIA_NO_GRAPHS") is None else not flag("MINISGL_MEDIA_NO_GRAPHS")


def media_parallel() -> str | None:
    """MINISGL_MEDIA_PARALLEL (--media-parallel): one job over several GPUs, cfg, ulysses or auto; unset: one GPU."""
    return _text("MINISGL_MEDIA_PARALLEL")


def media_parallel_size() -> int | None:
    """MINISGL_MEDIA_PARALLEL_SIZE (--media-parallel-size): the ranks (GPUs) of --media-parallel."""
    return _number("MINISGL_MEDIA_PARALLEL_SIZE", int, None)


# --- bench defaults (the reference stack's variables) --------------------------------------------
def bench_repeat() -> int:
    return _number("BENCH_REPEAT", int, 3)


def bench_warmup() -> int:
    return _number("BENCH_WARMUP", int, 1)


def bench_mixed_prompts() -> bool:
    return flag("BENCH_MIXED_PROMPTS", default=True)


def bench_concurrency() -> list[int]:
    """BENCH_CONCURRENCY: levels separated by spaces or commas ('1 4 16'); default [4]."""
    raw = os.environ.get("BENCH_CONCURRENCY", "4")
    try:
        return [int(x) for x in raw.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"BENCH_CONCURRENCY={raw!r} is not a list of integers (e.g. '1 4 16')") from None
