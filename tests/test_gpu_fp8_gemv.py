"""The W8A8 GEMV (kernels/triton/gemv.py's tensor-core kernel with X_FP8: one row of e4m3 codes against e4m3 weights,
as FP8 linears take a batch-1 row) against its definition: the dequantized row times the dequantized weight rows, plus
the bias. kernels/fp8.py quantizes both sides, as the norm before (or `quant_rows`) and the loader do.

On CUDA, or without a GPU under Triton's interpreter on CPU tensors where triton is importable and TRITON_INTERPRET=1
was set before it was imported (the Makefile's test target)."""

from __future__ import annotations

import pytest
import torch

from minisgl_cli.kernels import fp8
from tests.triton_interp import NEEDS_FP8, NEEDS_TRITON, patch_interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, NEEDS_TRITON, NEEDS_FP8]
SHAPES = [(40, 1024), (64, 2048)] + ([(6144, 4096), (4096, 14336), (1000, 3072)] if DEV == "cuda" else [])


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("config", [None, (4, 64, 4, 3, 0), (16, 64, 4, 2, 0), (8, 64, 4, 1, 1)],
                         ids=["picked", "mma4", "mma16", "mma-prefetch"])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_w8a8_gemv_is_the_product_of_the_dequantized_codes(n, k, config, bias):
    """N not a multiple of the rows a program takes (40 with 16; 1000), K of one and of many steps."""
    patch_interpreter()
    from minisgl_cli.kernels.triton.gemv import gemv, takes_w8a8

    g = torch.Generator().manual_seed(n + k)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    codes, scale = fp8.quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    assert takes_w8a8(codes)
    x = (torch.randn(1, k, generator=g) * torch.linspace(0.1, 4, k)).to(dtype)
    xq, xs = fp8.quantize_rows(x)
    b = torch.randn(n, generator=g).to(DEV, dtype) if bias else None
    y = gemv(xq.to(DEV), codes.to(DEV), b, scale=scale[:, 0].contiguous().to(DEV), x_scale=xs.to(DEV),
             out_dtype=dtype, config=config)
    ref = fp8.dequantize(xq, xs).double() @ fp8.dequantize(codes, scale).double().T
    if b is not None:
        ref = ref + b.cpu().double()
    assert y.dtype == dtype and y.shape == (1, n)
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.cpu().double(), ref, **tol)


def test_only_e4m3_weights_of_whole_steps_take_it():
    """A K that is not whole steps of 16 x 64 (576), or 16-bit weights: the scaled GEMM's (or the 16-bit GEMV's)."""
    from minisgl_cli.kernels.triton.gemv import takes_w8a8

    assert not takes_w8a8(torch.zeros(64, 576, dtype=fp8.FP8))
    assert not takes_w8a8(torch.zeros(64, 1024, dtype=torch.bfloat16))
