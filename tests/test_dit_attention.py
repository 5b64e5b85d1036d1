"""The FP8 DiT attention kernel (kernels/triton/dit_attention.py) against SDPA: both dots in e4m3, the output within
FP8's error of the exact attention, masked edges (lengths not a multiple of the tile), cross-attention lengths; its
quantization against the same numbers in torch; its custom op inside a fullgraph torch.compile.

Runs on CUDA (bf16); without a GPU under Triton's interpreter, as tests/test_gpu_moe.py does (`make test` does so)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import NEEDS_FP8, NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON, NEEDS_FP8]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
TILE = {} if DEV == "cuda" else {"block_m": 32, "block_n": 32}  # dit_attention.Tiles: the CPU takes small tiles


@pytest.mark.parametrize("b,s_q,s_k,h,d", [(1, 70, 70, 2, 64), (2, 100, 37, 3, 128), (1, 256, 256, 1, 128)])
def test_fp8_attention_matches_sdpa(b, s_q, s_k, h, d):
    patch_interpreter()
    from minisgl_cli.kernels.triton.dit_attention import Tiles, fp8_attention

    g = torch.Generator().manual_seed(s_q * 31 + s_k)
    q, v = (torch.randn(b, s, h, d, generator=g).to(DEV, DTYPE) for s in (s_q, s_k))
    k = (torch.randn(b, s_k, h, d, generator=g) + 2.0).to(DEV, DTYPE)  # an offset the mean smoothing takes out
    v = torch.randn(b, s_k, h, d, generator=g).to(DEV, DTYPE)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v))).transpose(1, 2)
    out = fp8_attention(q, k, v, tiles=Tiles(**TILE))
    assert out.shape == q.shape and out.dtype == q.dtype
    cos = F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.995, cos  # e4m3 keeps 3 mantissa bits; on random data (the hard case) this is ~0.997
    assert (out.float() - ref).abs().max().item() < 0.15


def test_fp8_attention_refuses_what_it_cannot_do():
    from minisgl_cli.kernels.triton.dit_attention import fp8_attention

    q = torch.zeros(1, 8, 2, 96, device=DEV, dtype=DTYPE)
    with pytest.raises(ValueError, match="head_dim"):
        fp8_attention(q, q, q)


def test_quantize_qkv_codes_and_padding():
    """q a scale a token, k less its mean a scale a tile, v a scale a channel and transposed; zeros past S."""
    patch_interpreter()
    from minisgl_cli.kernels.triton.dit_attention import FP8_MAX, LOG2E, quantize_qkv

    b, s, h, d, tile = 2, 45, 3, 64, 16
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(b, s, h, d, generator=g).to(DEV, DTYPE) * f for f in (1.0, 3.0, 0.5))
    x = quantize_qkv(q, k, v, 0.125, tile, tile)
    pad = 48
    assert x.q.shape == (b, h, pad, d) and x.k.shape == (b, h, pad, d) and x.vt.shape == (b, h, d, pad)
    assert x.k_scale.shape == (b, h, pad // tile)
    qh, kh, vh = (t.float().transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
    sq = qh.abs().amax(-1) / FP8_MAX
    torch.testing.assert_close(x.q_scale[:, :, :s], sq * 0.125 * LOG2E)
    kc = kh - kh.mean(dim=2, keepdim=True)
    sk = F.pad(kc, (0, 0, 0, pad - s)).reshape(b, h, pad // tile, tile * d).abs().amax(-1) / FP8_MAX
    torch.testing.assert_close(x.k_scale, sk)
    torch.testing.assert_close(x.v_scale, vh.abs().amax(2) / FP8_MAX)
    # each code is its value's e4m3 rounding: within half a step of 3 mantissa bits
    torch.testing.assert_close(x.q.float()[:, :, :s] * sq[..., None], qh, rtol=1 / 16, atol=1e-6)
    sk_tok = sk.repeat_interleave(tile, dim=2)[:, :, :s, None]
    torch.testing.assert_close(x.k.float()[:, :, :s] * sk_tok, kc, rtol=1 / 16, atol=sk_tok.max().item() / 8)
    vt = x.vt.float()[..., :s] * x.v_scale[..., None]
    torch.testing.assert_close(vt, vh.transpose(2, 3), rtol=1 / 16, atol=x.v_scale.max().item() / 8)
    for codes in (x.q[:, :, s:], x.k[:, :, s:], x.vt[..., s:]):
        assert not codes.float().any()


def test_op_inside_fullgraph_compile():
    """The custom op (what a compiled DiT block calls) gives the eager kernel's output inside torch.compile."""
    patch_interpreter()
    from minisgl_cli.kernels.triton.dit_attention import fp8_attention, fp8_attention_op

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=g).to(DEV, DTYPE) for _ in range(3))

    def block(q, k, v):
        return fp8_attention_op(q * 2, k, v, 0.1) + 1

    got = torch.compile(block, fullgraph=True, backend="aot_eager" if DEV == "cpu" else "inductor")(q, k, v)
    torch.testing.assert_close(got, fp8_attention(q * 2, k, v, 0.1) + 1)
    torch.testing.assert_close(fp8_attention_op(q, k, v, None), fp8_attention(q, k, v, 64 ** -0.5))  # diffusers' None


def test_fp8_attention_takes_head_major_views():
    """q, k, v as (B, S, H, D) views of head-major memory (an SDPA layout transposed): the same output as from
    contiguous copies, returned contiguous."""
    patch_interpreter()
    from minisgl_cli.kernels.triton.dit_attention import Tiles, fp8_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 40, 64, generator=g).to(DEV, DTYPE).transpose(1, 2) for _ in range(3))
    out = fp8_attention(q, k, v, tiles=Tiles(**TILE))
    assert out.is_contiguous() and out.shape == q.shape
    dense = fp8_attention(q.contiguous(), k.contiguous(), v.contiguous(), tiles=Tiles(**TILE))
    torch.testing.assert_close(out, dense)
