"""Running this repo's Triton kernels on a CPU: TRITON_INTERPRET=1, and the fix its interpreter needs here."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
# Where this repo's Triton kernels run: a CUDA GPU, or the CPU under the interpreter with triton importable.
TRITON_RUNS = torch.cuda.is_available() or bool(INTERPRET and importlib.util.find_spec("triton"))
NEEDS_TRITON = pytest.mark.skipif(not TRITON_RUNS,
                                  reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton importable)")
NEEDS_FP8 = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                               reason="FP8 in Triton needs compute capability 8.9+ (Ada / Hopper)")


def patch_interpreter() -> None:
    """triton 3.6's interpreter calls int() on 1-element arrays (a kernel's int arguments used as a `range` bound), an
    error from numpy 2.3 on: read the element instead. And its float -> e4m3 conversion drops the carry of a rounding
    up into the exponent (31.01 becomes 16, not 32): convert as torch does (round to nearest even, as the GPU's
    cvt.rn). Idempotent; a no-op on a GPU."""
    if not INTERPRET:
        return
    import numpy as np
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "minisgl", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched.minisgl = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched

    import triton.language as tl

    convert = interpreter._convert_float
    wide = {tl.float32: np.float32, tl.float16: np.float16}

    def to_e4m3(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype in wide:
            x = torch.from_numpy(np.ascontiguousarray(input).view(wide[input_dtype]).astype(np.float32))
            return x.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return convert(input, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = to_e4m3
