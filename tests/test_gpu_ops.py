"""The Triton layer kernels (kernels/triton/ops.py, kernels/triton/gemv.py) against the torch reference path.

Random inputs drawn fresh per case, outputs poisoned before the run; skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.float() - b.float()).abs().max().item() <= 0.03 * b.float().abs().max().item()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# (each of pick_config's 16-bit shapes: Qwen3-0.6B's qkv and o, gpt-oss-20b's o, Llama-8B's qkv, odd sizes)
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (2880, 4096), (1024, 3072), (1000, 1000), (6144, 4096),
                                 (77, 4100)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemv_matches_fp64(n, k, bias, dtype):
    from minisgl_cli.kernels.triton.gemv import gemv

    g = torch.Generator(DEV).manual_seed(n * 7 + k)
    w = (torch.randn(n, k, device=DEV, generator=g) * 0.05).to(dtype)
    x = torch.randn(1, k, device=DEV, generator=g).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    out = gemv(x, w, b)
    assert out.shape == (1, n) and out.dtype == dtype
    # as close to fp64 as cuBLAS's own output (both accumulate in fp32 and round once)
    cublas = torch.nn.functional.linear(x, w, b)
    assert _rel(out, ref) <= 2 * _rel(cublas, ref) + 1e-3


@pytest.mark.parametrize("n,k", [(1024, 3072), (4096, 14336), (300, 1000)])
def test_gemv_with_fused_silu_mul(n, k):
    from minisgl_cli.kernels.triton import ops as T
    from minisgl_cli.kernels.triton.gemv import gemv

    g = torch.Generator(DEV).manual_seed(k)
    w = (torch.randn(n, k, device=DEV, generator=g) * 0.05).bfloat16()
    gate_up = torch.randn(1, 2 * k, device=DEV, generator=g).bfloat16()
    unfused = torch.nn.functional.linear(T.silu_and_mul(gate_up), w)
    act = T.silu_and_mul(gate_up).double()
    ref = act @ w.double().T
    out = gemv(gate_up, w, act_mul=True)
    assert _rel(out, ref) <= 2 * _rel(unfused, ref) + 1e-3


@pytest.mark.parametrize("heads", [(16, 8, 128, True), (32, 8, 128, False), (8, 2, 64, True)],
                         ids=["qwen3", "llama", "small"])
@pytest.mark.parametrize("tokens", [1, 37])
@pytest.mark.parametrize("config", [None, (1, 1), (16, 4), (64, 4)], ids=["picked", "head", "16heads", "64heads"])
def test_qk_norm_rope_with_kv_store(heads, tokens, config):
    """One launch = the torch chain (q/k norm, RoPE) and the pool store; other cache rows untouched. Each program
    one head, or a token's heads in blocks (16: blocks that split a token's heads and end past its last)."""
    from minisgl_cli.kernels.triton import ops as T
    from minisgl_cli.layers.kernel_choice import Kernels
    from minisgl_cli.layers.norm import RMSNorm
    from minisgl_cli.layers.rotary import RotaryEmbedding

    hq, hkv, d, has_norm = heads
    dt = torch.bfloat16
    g = torch.Generator(DEV).manual_seed(tokens + hq)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=DEV, generator=g).to(dt)
    pos = torch.randint(0, 4000, (tokens,), device=DEV, generator=g)
    rope = RotaryEmbedding(d, 4096, 1e6).to(DEV)
    plain = Kernels(fused=False)  # the torch reference path
    qn, kn = RMSNorm(d, 1e-6, plain).to(DEV, dt), RMSNorm(d, 1e-6, plain).to(DEV, dt)
    qn.weight.data.uniform_(0.5, 1.5, generator=g)
    kn.weight.data.uniform_(0.5, 1.5, generator=g)
    slots = 64
    poison = torch.full((slots, hkv, d), 7.0, device=DEV, dtype=dt)
    k_cache, v_cache = poison.clone(), poison.clone()
    loc = torch.randperm(slots, device=DEV, generator=g)[:tokens]

    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.reshape(-1, hq, d), k.reshape(-1, hkv, d), v.reshape(-1, hkv, d)
    if has_norm:
        q, k = qn(q), kn(k)
    q_ref, k_ref = rope(pos, q, k)
    out = qkv.clone()
    T.qk_norm_rope_(out, pos, rope.cos, rope.sin, hq, hkv, d, qn.weight if has_norm else None,
                    kn.weight if has_norm else None, 1e-6, (k_cache, v_cache, loc, None), config=config)
    alone = qkv.clone()  # no pool: the same q/k rows, v left as it was
    T.qk_norm_rope_(alone, pos, rope.cos, rope.sin, hq, hkv, d, qn.weight if has_norm else None,
                    kn.weight if has_norm else None, 1e-6, config=config)
    assert torch.equal(alone, out)
    # bf16 rounding apart (a few ulps where the fp32 rstd rounds the other way); a wrong head or position is O(1)
    assert _close(out[:, : hq * d], q_ref.reshape(tokens, -1))
    assert torch.equal(k_cache[loc], out[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d))
    assert _close(k_cache[loc], k_ref)
    assert torch.equal(v_cache[loc], v)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEV)
    untouched[loc] = False
    assert torch.equal(k_cache[untouched], poison[untouched]) and torch.equal(v_cache[untouched], poison[untouched])


@pytest.mark.parametrize("tokens", [1, 300])
def test_rmsnorm_and_silu_match_torch(tokens):
    from minisgl_cli.kernels.triton import ops as T
    from minisgl_cli.layers.activation import silu_and_mul
    from minisgl_cli.layers.kernel_choice import Kernels
    from minisgl_cli.layers.norm import RMSNorm

    dt = torch.bfloat16
    g = torch.Generator(DEV).manual_seed(tokens)
    x = torch.randn(tokens, 1024, device=DEV, generator=g).to(dt)
    r = torch.randn(tokens, 1024, device=DEV, generator=g).to(dt)
    gu = torch.randn(tokens, 2 * 3072, device=DEV, generator=g).to(dt)
    plain = Kernels(fused=False)  # the torch reference path
    norm = RMSNorm(1024, 1e-6, plain).to(DEV, dt)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)
    h_ref, r_ref = norm.forward_residual(x, r)
    a_ref = silu_and_mul(gu, plain)
    r2 = r.clone()
    h = T.rmsnorm(x, norm.weight, 1e-6, residual=r2)
    assert torch.equal(r2, r_ref)  # the in-place residual add rounds as torch's add
    assert torch.allclose(h.float(), h_ref.float(), rtol=8e-3, atol=1e-5)  # within one bf16 ulp
    assert torch.equal(T.silu_and_mul(gu), a_ref)
