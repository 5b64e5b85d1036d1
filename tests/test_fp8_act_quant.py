"""The FP8 MLP's fused pass (kernels/triton/fp8.py's quant_rows with an activation): the codes and scales of
kernels/fp8.py's torch numbers, quantize_rows(activate(x + bias)); its custom op inside a fullgraph torch.compile;
media/fp8.py's Fp8MLP on the GPU against its own emulation.

Runs on CUDA (bf16); without a GPU under Triton's interpreter (fp32), as tests/test_gpu_moe.py does (`make test`)."""

from __future__ import annotations

import pytest
import torch

from minisgl_cli.kernels import fp8
from tests.triton_interp import NEEDS_FP8, NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON, NEEDS_FP8]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32


def _codes_match(q: torch.Tensor, s: torch.Tensor, q_ref: torch.Tensor, s_ref: torch.Tensor) -> None:
    """The same scales; the same codes but where the activation's last bit fell the other side of a rounding (the
    kernel's exp form of tanh against torch's, a reciprocal's rounding): there one e4m3 step apart, and rare."""
    torch.testing.assert_close(s, s_ref, rtol=1e-5, atol=0)
    a, b = q.float(), q_ref.float()  # the codes' values (x / scale)
    differ = (q.view(torch.uint8) != q_ref.view(torch.uint8))
    assert differ.float().mean().item() < 0.03, differ.float().mean().item()
    assert ((a - b).abs() <= b.abs() / 8 + 2.0**-9)[differ].all()  # one step of 3 mantissa bits (or subnormal)


@pytest.mark.parametrize("act,bias", [("gelu_tanh", True), ("gelu_tanh", False), ("silu_mul", False),
                                      ("none", True)])
@pytest.mark.parametrize("m,k", [(5, 96), (33, 1000)])
@pytest.mark.parametrize("exact", [True, False])
def test_quant_rows_quantizes_the_activation_of_the_biased_rows(act, bias, m, k, exact):
    patch_interpreter()
    from minisgl_cli.kernels.triton.fp8 import quant_rows

    g = torch.Generator().manual_seed(m * k)
    x = (torch.randn(m, 2 * k if act == "silu_mul" else k, generator=g) * 3).to(DEV, DTYPE)
    x[0, :5] = 0  # zeros and an outlier a row; a row of zeros gets the floor scale
    x[-1, 3] = -40.0
    x[min(1, m - 1)] = 0
    b = (torch.randn(k, generator=g)).to(DEV, DTYPE) if bias else None
    q, s = quant_rows(x, act, b, exact, pdl=False)
    q_ref, s_ref = fp8.quantize_rows(fp8.activate(x if b is None else x + b, act))
    assert q.shape == (m, k) and q.dtype == fp8.FP8 and s.shape == (m, 1)
    _codes_match(q, s, q_ref, s_ref)


def test_op_inside_fullgraph_compile():
    """The custom op (what a compiled Fp8MLP calls) gives the eager kernel's codes inside torch.compile."""
    patch_interpreter()
    from minisgl_cli.kernels.triton.fp8 import quant_rows, quant_rows_op

    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, 256, generator=g).to(DEV, DTYPE)
    b = torch.randn(256, generator=g).to(DEV, DTYPE)

    def block(x, b):
        q, s = quant_rows_op(x * 2, "gelu_tanh", b, False)
        return q.float() * s

    got = torch.compile(block, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")(x, b)
    q, s = quant_rows(x * 2, "gelu_tanh", b, False, pdl=False)
    torch.testing.assert_close(got, q.float() * s)


@pytest.mark.skipif(DEV != "cuda", reason="Fp8MLP's kernels run on CUDA (the CPU emulates them: test_media_speed.py)")
@pytest.mark.parametrize("act", ["gelu_tanh", "silu_mul"])
def test_fp8_mlp_on_cuda_matches_its_emulation(act):
    from torch import nn

    from minisgl_cli.media.fp8 import Fp8Linear, Fp8MLP

    torch.manual_seed(0)
    dense = dict(device="cuda", dtype=torch.bfloat16)  # built in bf16: a Module.to(dtype) would cast the e4m3 codes
    up = [nn.Linear(256, 512, bias=act == "gelu_tanh", **dense) for _ in range(2 if act == "silu_mul" else 1)]
    mlp = Fp8MLP(Fp8Linear.of(*up), Fp8Linear.of(nn.Linear(512, 256, **dense)), act)
    x = torch.randn(2, 77, 256, device="cuda", dtype=torch.bfloat16)
    eager = mlp(x)
    compiled = torch.compile(mlp, fullgraph=True)(x)
    emulated = mlp.to("cpu")(x.cpu()).cuda()  # quantize / dequantize in fp32
    for y in (eager, compiled):
        rel = ((y.double() - emulated.double()).norm() / emulated.double().norm()).item()
        assert y.shape == x.shape and rel < 2e-2, rel
