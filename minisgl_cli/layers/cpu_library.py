"""minisgl's own CPU kernels (layers/csrc/*.cpp) as one library of torch ops: built once for this torch and CPU into
the cache, loaded into the process.

The ops: `minisgl::int4_mm`, the int4 decode GEMM (layers/cpu_int4.py), and `minisgl::decode_attn`, the decode
attention over the paged KV cache (attention/torch_backend.py). Both need AVX-512 with BF16 and a C++ compiler (`c++`
or $CXX); elsewhere, or where the build fails, their callers run PyTorch's kernels instead.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import subprocess
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp_extension

from minisgl_cli import env
from minisgl_cli.notice import notice

log = logging.getLogger("minisgl.kernels")

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = tuple(sorted(_CSRC.glob("*.cpp")))  # compiled together; their headers (*.h) are in the library's key
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq",
          "-mavx512vl", "-mavx512bf16", "-mf16c")


@functools.cache
def load() -> str | None:
    """Load the library (building it first where the cache has none): None when it is loaded, else why not (no
    AVX512-BF16, no compiler, a failed build; the last two logged once, here)."""
    if not torch.cpu._is_avx512_bf16_supported():
        return "this CPU lacks AVX512-BF16"
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError) as e:  # no compiler, a failed build (_build's message), an unloadable library
        why = str(e).splitlines()[0] if str(e) else repr(e)
        log.warning("minisgl's CPU kernels are not available (%s); PyTorch's int4 GEMM and SDPA run instead", why)
        return why
    # Shapes for torch.export and AOTInductor (the compiled decode step calls both ops).
    torch.library.register_fake("minisgl::int4_mm")(lambda x, q, sm: x.new_empty(x.shape[0], q.shape[0] * 16))
    torch.library.register_fake("minisgl::decode_attn")(lambda q, *_: torch.empty_like(q))
    return None


def _build() -> Path:
    """The library for these sources, torch and compiler flags: from the cache, or compiled there (~15 s)."""
    include = cpp_extension.include_paths()
    lib = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    texts = [f"{p.name}\0{p.read_text()}" for p in (*_SOURCES, *sorted(_CSRC.glob("*.h")))]
    key = hashlib.sha256("\0".join([*texts, torch.__version__, abi, *_FLAGS]).encode()).hexdigest()[:16]
    out = env.cache_dir() / "kernels" / f"minisgl_cpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then take its library
        if out.exists():
            return out
        notice(f"building minisgl's CPU kernels for this torch and CPU (once, ~20 s) into {out.parent}")
        partial = out.with_suffix(f".{os.getpid()}.partial")
        cmd = [env.cxx(), *_FLAGS, abi, *(f"-I{p}" for p in include), *map(str, _SOURCES), "-o", str(partial),
               *(f"-L{p}" for p in lib), *(f"-Wl,-rpath,{p}" for p in lib), "-lc10", "-ltorch_cpu"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(partial, out)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(e.stderr.strip().splitlines()[-1] if e.stderr.strip() else str(e)) from None
        finally:
            partial.unlink(missing_ok=True)
    return out
