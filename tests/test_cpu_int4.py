"""minisgl::int4_mm (kernels/cpu/int4.py): the Q4_1 product it stands for, each row's bits whatever the rows beside
it, and the choice of kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minisgl_cli import env
from minisgl_cli.kernels.cpu import int4 as cpu_int4

pytestmark = pytest.mark.skipif(cpu_int4.kernel() != "minisgl", reason="this CPU or build runs ATen's int4 kernel")


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // 32) * 0.02 + 1e-3
    low = -8 * scale + torch.randn(n, k // 32) * 1e-3
    return q, scale, low


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (208, 64)])
def test_it_computes_the_q4_1_product_to_bf16_rounding(n, k):
    torch.manual_seed(0)
    q, scale, low = _weights(n, k)
    packed, sm = cpu_int4.pack(q, scale, low)
    # the packed scale and min are fp16 (GGUF's own precision): the reference takes them as stored
    s16, l16 = (t.to(torch.float16).double() for t in (scale, low))
    w = (q.double().view(n, k // 32, 32) * s16[..., None] + l16[..., None]).view(n, k)
    x = torch.randn(5, k).to(torch.bfloat16)
    ref = x.double() @ w.T
    got = cpu_int4.mm(x, packed, sm)
    assert got.dtype == torch.bfloat16 and got.shape == (5, n)
    assert ((got.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-3 * ref.abs().max()).all()


def test_a_row_has_the_same_bits_alone_and_among_any_number_of_rows():
    """Row runs of 12, 8, 4, 2 and 1 each take their own path through the kernel: all give a row the same result."""
    torch.manual_seed(1)
    packed, sm = cpu_int4.pack(*_weights(576, 576))
    x = torch.randn(29, 576).to(torch.bfloat16)
    whole = cpu_int4.mm(x, packed, sm)
    for m in range(1, 29):
        assert torch.equal(cpu_int4.mm(x[:m].contiguous(), packed, sm), whole[:m]), m
        assert torch.equal(cpu_int4.mm(x[m : m + 1].contiguous(), packed, sm), whole[m : m + 1]), m


def test_bad_layouts_are_refused():
    packed, sm = cpu_int4.pack(*_weights(64, 64))
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bf16"):
        cpu_int4.mm(torch.randn(1, 64), packed, sm)
    with pytest.raises(RuntimeError, match="q \\[N / 16, K / 2, 16\\]"):
        cpu_int4.mm(torch.randn(1, 96).to(torch.bfloat16), packed, sm)


def test_the_kernel_choice_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("MINISGL_CPU_INT4", "ATen")
    assert env.cpu_int4() == "aten"
    monkeypatch.setenv("MINISGL_CPU_INT4", "fast")
    with pytest.raises(ValueError, match="use auto, minisgl or aten"):
        env.cpu_int4()


def test_aten_s_kernel_runs_the_int4_layers_where_asked():
    """MINISGL_CPU_INT4=aten (a fresh process: the choice is fixed at its first int4 layer): ATen's layout and kernel,
    and the layer's decode product near the dense one as with minisgl's."""
    code = """
import torch
from minisgl_cli.kernels.cpu import int4 as cpu_int4
from minisgl_cli.layers import quant
from minisgl_cli.layers.linear import RowParallelLinear
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
layer = RowParallelLinear(576, 192, method=quant.Int4Method())
torch.set_default_dtype(torch.float32)
layer.load_shard("weight", torch.randn(192, 576) * 0.05)
layer.finish_loading()
x = torch.randn(3, 576).to(torch.bfloat16)
dense, low = layer(x).float(), layer(x, decode=True).float()
print(cpu_int4.kernel(), layer.qweight.dim(), float((dense - low).abs().max() / dense.abs().max()))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MINISGL_CPU_INT4": "aten"},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["aten", "2"] and float(out[2]) < 0.1, out
