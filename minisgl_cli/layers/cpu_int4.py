"""The int4 decode GEMM of the CPU default mode: `minisgl::int4_mm` (csrc/int4_mm.cpp), built once for this CPU and
torch into the cache, and its weight layout.

ATen's `_weight_int4pack_mm_for_cpu` unpacks and scales each weight again for every 4 rows and multiplies in fp32
FMAs; this kernel unpacks a weight vector once for up to 12 rows and multiplies the 4-bit codes by the bf16
activations with AVX512-BF16 pair dot products (exact products), applying Q4_1's scale and min once a group of 32.
With a step's weights streaming from memory it is 1.3x ATen's speed at one row and ~2x at 16
(`python examples/bench_cpu_linear.py --kernels int4 int4-minisgl`). Like ATen's, it gives a row the same bits
whatever the rows beside it.

It needs AVX512-BF16 and a C++ compiler (`c++` or $CXX; the compiled decode step needs one too); elsewhere, or with
MINISGL_CPU_INT4=aten, the int4 method packs for ATen's kernel instead. Which one a process uses is fixed at its
first int4 layer (`kernel()`), and the compiled decode step's key names it. The two round differently: each
process's greedy answers are consistent, not bit-equal across the two kernels.
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

_SOURCE = Path(__file__).with_name("csrc") / "int4_mm.cpp"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512dq",
          "-mavx512vl", "-mavx512bf16", "-mf16c")
GROUP = 32  # inputs per scale and min (GGUF's Q4_1 block)


@functools.cache
def kernel() -> str:
    """"minisgl" where this process runs minisgl::int4_mm, else "aten" (the CPU lacks AVX512-BF16, the build
    failed, or MINISGL_CPU_INT4=aten)."""
    choice = env.cpu_int4()
    if choice == "aten" or not torch.cpu._is_avx512_bf16_supported():
        return "aten"
    try:
        torch.ops.load_library(str(_build()))
    except (OSError, RuntimeError) as e:  # no compiler, a failed build (_build's message), an unloadable library
        if choice == "minisgl":
            raise RuntimeError(f"MINISGL_CPU_INT4=minisgl: the int4 kernel did not build: {e}") from e
        log.warning("the int4 kernel did not build (%s); using ATen's", str(e).splitlines()[0] if str(e) else e)
        return "aten"
    torch.library.register_fake("minisgl::int4_mm")(_shape)
    return "minisgl"


def _shape(x: torch.Tensor, q: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0] * 16)


def _build() -> Path:
    """The kernel's library for this source, torch and compiler flags: from the cache, or compiled there (~7 s)."""
    include = cpp_extension.include_paths()
    lib = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), torch.__version__, abi, *_FLAGS]).encode()).hexdigest()[:16]
    out = env.cache_dir() / "kernels" / f"int4_mm-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait, then take its library
        if out.exists():
            return out
        notice(f"building the CPU int4 kernel for this torch and CPU (once, ~10 s) into {out.parent}")
        partial = out.with_suffix(f".{os.getpid()}.partial")
        cmd = [env.cxx(), *_FLAGS, abi, *(f"-I{p}" for p in include),
               str(_SOURCE), "-o", str(partial),
               *(f"-L{p}" for p in lib), *(f"-Wl,-rpath,{p}" for p in lib), "-lc10", "-ltorch_cpu"]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            os.replace(partial, out)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(e.stderr.strip().splitlines()[-1] if e.stderr.strip() else str(e)) from None
        finally:
            partial.unlink(missing_ok=True)
    return out


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """minisgl::int4_mm's layout of Q4_1 groups (w = scale * q + low): q [N, K] codes 0..15 -> [N / 16, K / 2, 16]
    bytes, scale and low [N, K / 32] -> [N / 16, K / 32, 2, 16] fp16. N a multiple of 16."""
    n, k = q.shape
    pairs = (q[:, 0::2] | (q[:, 1::2] << 4)).view(n // 16, 16, k // 2).transpose(1, 2).contiguous()
    sm = torch.stack([scale, low], dim=-1).view(n // 16, 16, k // GROUP, 2).permute(0, 2, 3, 1)
    return pairs, sm.to(torch.float16).contiguous()


def mm(x: torch.Tensor, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 times the packed weight's transpose: [M, N] bf16."""
    return torch.ops.minisgl.int4_mm(x, qweight, qscale)
