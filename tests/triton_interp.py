"""Running this repo's Triton kernels on a CPU: TRITON_INTERPRET=1, and the fix its interpreter needs here."""

from __future__ import annotations

import os

import torch

INTERPRET = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"


def patch_interpreter() -> None:
    """triton 3.6's interpreter calls int() on 1-element arrays (a kernel's int arguments used as a `range` bound), an
    error from numpy 2.3 on: read the element instead. Idempotent; a no-op on a GPU."""
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
