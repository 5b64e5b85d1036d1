"""The FP8 DiT attention kernel (kernels/triton/dit_attention.py) against SDPA: both dots in e4m3, the output within
FP8's error of the exact attention, masked edges (lengths not a multiple of the tile), cross-attention lengths.

Runs on CUDA (bf16); without a GPU under Triton's interpreter, as tests/test_gpu_moe.py does (`make test` does so)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import NEEDS_FP8, NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON, NEEDS_FP8]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
TILE = {} if DEV == "cuda" else {"block_m": 32, "block_n": 32, "num_warps": 4}


@pytest.mark.parametrize("b,s_q,s_k,h,d", [(1, 70, 70, 2, 64), (2, 100, 37, 3, 128), (1, 256, 256, 1, 128)])
def test_fp8_attention_matches_sdpa(b, s_q, s_k, h, d):
    patch_interpreter()
    from minisgl_cli.kernels.triton.dit_attention import fp8_attention

    g = torch.Generator().manual_seed(s_q * 31 + s_k)
    q, v = (torch.randn(b, s, h, d, generator=g).to(DEV, DTYPE) for s in (s_q, s_k))
    k = (torch.randn(b, s_k, h, d, generator=g) + 2.0).to(DEV, DTYPE)  # an offset the mean smoothing takes out
    v = torch.randn(b, s_k, h, d, generator=g).to(DEV, DTYPE)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v))).transpose(1, 2)
    out = fp8_attention(q, k, v, **TILE)
    assert out.shape == q.shape and out.dtype == q.dtype
    cos = F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
    assert cos > 0.995, cos  # e4m3 keeps 3 mantissa bits; on random data (the hard case) this is ~0.997
    assert (out.float() - ref).abs().max().item() < 0.15


def test_fp8_attention_refuses_what_it_cannot_do():
    from minisgl_cli.kernels.triton.dit_attention import fp8_attention

    q = torch.zeros(1, 8, 2, 96, device=DEV, dtype=DTYPE)
    with pytest.raises(ValueError, match="head_dim"):
        fp8_attention(q, q, q)
