"""minisgl's own CPU kernels (kernels/cpu/csrc/) as one library of torch ops: built once for this torch and CPU into the
cache, loaded into the process.

The ops: `minisgl::int4_mm`, the int4 decode GEMM (kernels/cpu/int4.py), and `minisgl::decode_attn`, the decode
attention over the paged KV cache (attention/torch_backend.py). Where the CPU has AVX-512 with BF16 both are built
(csrc/*.cpp); where it has AVX2 and FMA only, decode_attn is (csrc/avx2/: the same algorithm in 8-lane vectors), and
int4 GEMMs run PyTorch's kernel. Either needs a C++ compiler (`c++` or $CXX); elsewhere, or where the build fails,
their callers run PyTorch's kernels instead (`missing` says why).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from minisgl_cli import env
from minisgl_cli.notice import notice

log = logging.getLogger("minisgl.kernels")

_CSRC = Path(__file__).with_name("csrc")
_COMMON = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp")


@dataclass(frozen=True)
class _Build:
    """One ISA's library: its sources (compiled together; every header of csrc/ is in its key), flags and ops."""

    name: str
    sources: tuple[str, ...]
    flags: tuple[str, ...]
    ops: tuple[str, ...]


_AVX512 = _Build("avx512bf16", ("decode_attn.cpp", "int4_mm.cpp", "ops.cpp"),
                 ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16", "-mf16c"),
                 ("int4_mm", "decode_attn"))
_AVX2 = _Build("avx2", ("avx2/decode_attn.cpp", "ops.cpp"), ("-mavx2", "-mfma", "-mf16c"), ("decode_attn",))


def _for_this_cpu() -> _Build | None:
    if torch.cpu._is_avx512_bf16_supported():
        return _AVX512
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):  # AVX-512 without BF16 runs the AVX2 build
        return _AVX2
    return None


def missing(op: str) -> str | None:
    """None where this process runs minisgl::`op`, else why not."""
    why = load()
    if why is not None:
        return why
    build = _for_this_cpu()
    if build is None or op not in build.ops:
        return f"minisgl::{op} is not built for this CPU (no AVX512-BF16)"
    return None


@functools.cache
def load() -> str | None:
    """Load this CPU's library (building it first where the cache has none): None when it is loaded, else why not (a
    CPU without AVX2, no compiler, a failed build; the last two logged once, here)."""
    build = _for_this_cpu()
    if build is None:
        return "this CPU lacks AVX2 and FMA"
    try:
        torch.ops.load_library(str(_build(build)))
    except (OSError, RuntimeError) as e:  # no compiler, a failed build (_build's message), an unloadable library
        why = str(e).splitlines()[0] if str(e) else repr(e)
        log.warning("minisgl's CPU kernels are not available (%s); PyTorch's int4 GEMM and SDPA run instead", why)
        return why
    # Shapes for torch.export and AOTInductor (the compiled decode step calls the ops).
    if "int4_mm" in build.ops:
        torch.library.register_fake("minisgl::int4_mm")(lambda x, q, sm: x.new_empty(x.shape[0], q.shape[0] * 16))
    torch.library.register_fake("minisgl::decode_attn")(lambda q, *_: torch.empty_like(q))
    return None


def _build(build: _Build) -> Path:
    """The library for these sources, torch and compiler flags: from the cache, or compiled there (~15 s)."""
    include = cpp_extension.include_paths()
    lib = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    sources = [_CSRC / name for name in build.sources]
    flags = (*_COMMON, *build.flags)
    texts = [f"{p.relative_to(_CSRC)}\0{p.read_text()}" for p in (*sources, *sorted(_CSRC.rglob("*.h")))]
    key = hashlib.sha256("\0".join([*texts, torch.__version__, abi, *flags]).encode()).hexdigest()[:16]
    out = env.cache_dir() / "kernels" / f"minisgl_cpu-{build.name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then take its library
        if out.exists():
            return out
        notice(f"building minisgl's CPU kernels for this torch and CPU (once, ~20 s) into {out.parent}")
        partial = out.with_suffix(f".{os.getpid()}.partial")
        cmd = [env.cxx(), *flags, abi, *(f"-I{p}" for p in include), *map(str, sources), "-o", str(partial),
               *(f"-L{p}" for p in lib), *(f"-Wl,-rpath,{p}" for p in lib), "-lc10", "-ltorch_cpu"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(partial, out)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(e.stderr.strip().splitlines()[-1] if e.stderr.strip() else str(e)) from None
        finally:
            partial.unlink(missing_ok=True)
    return out
