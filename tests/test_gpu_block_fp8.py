"""The block-wise FP8 GEMM (kernels/triton/fp8_block.py) against its definition: the activations' per-token-group
codes and scales equal kernels/fp8.py's quantize_groups, and y equals the dequantized activations times the
dequantized weight blocks (loader/blocks.py's Fp8Blocks), partial blocks at the edges included.

On CUDA, or without a GPU under Triton's interpreter on CPU tensors where triton is importable and TRITON_INTERPRET=1
was set before it was imported (the Makefile's test target):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_block_fp8.py
"""

from __future__ import annotations

import pytest
import torch

from minisgl_cli.kernels import fp8
from minisgl_cli.loader.blocks import quantize_fp8_blocks
from tests.triton_interp import NEEDS_FP8, NEEDS_TRITON, patch_interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu, NEEDS_TRITON, NEEDS_FP8]


@pytest.mark.parametrize("m,n,k,block", [(1, 48, 64, (16, 32)), (5, 40, 72, (16, 32)), (70, 200, 256, (128, 128))])
def test_block_fp8_linear_is_its_dequantized_definition(m, n, k, block):
    patch_interpreter()
    from minisgl_cli.kernels.triton.fp8_block import block_fp8_linear, quant_groups

    g = torch.Generator().manual_seed(m)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    x = (torch.randn(m, k, generator=g) * torch.linspace(0.1, 4, k)).to(DEV, dtype)  # groups of unlike ranges
    w = quantize_fp8_blocks(torch.randn(n, k, generator=g) * 0.05, block)
    assert w.scale_inv.shape == (-(-n // block[0]), -(-k // block[1]))
    codes, scales = quant_groups(x, block[1])
    ref_codes, ref_scales = fp8.quantize_groups(x, block[1])
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(scales, ref_scales)
    y = block_fp8_linear(x, w.q.to(DEV), w.scale_inv.to(DEV), block)
    ref = fp8.dequantize_groups(ref_codes, ref_scales, block[1]) @ w.dequantize().to(DEV).T
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.float(), ref, **tol)
    assert (y.float() - x.float() @ w.dequantize().to(DEV).T).norm() / ref.norm() < 0.05  # what FP8 costs
