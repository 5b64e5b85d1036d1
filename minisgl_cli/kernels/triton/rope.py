"""The rotary embedding's arithmetic in Triton: one rounding sequence, layers/rotary.py's, for every kernel that
rotates (ops.py's q/k-norm + RoPE and MLA's q_pe / k_pe pair, gemv.py's qkv epilogue)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rotate_halves(x1, x2, c, s, dt: tl.constexpr):
    """A row's halves x1, x2 rotated: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1). All in fp32 of `dt`
    values (c, s: the cos and sin of the first half's frequencies); each product rounded to `dt`, then their sum, as
    torch computes it in `dt` (the interpreter's numbers; compiled for an H200 a quarter of the values land one step
    off: tests/test_gpu_mla_attention.py's rope test). Returns the two halves in `dt`."""
    o1 = ((x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    return o1, o2
