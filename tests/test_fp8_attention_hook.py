"""media/fp8_attention.py: `--attention-backend fp8` routes a diffusers DiT's attention through our kernel, and the
calls the kernel does not take (here, CPU tensors) run the exact attention: the same output as the model's own."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")


def test_enable_routes_every_attention_and_falls_back_exactly():
    from diffusers import WanTransformer3DModel
    from diffusers.models.attention_dispatch import attention_backend

    from minisgl_cli.media import fp8_attention

    torch.manual_seed(0)
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2).eval()
    x = torch.randn(1, 4, 3, 8, 8)
    ctx = torch.randn(1, 7, 32)
    t = torch.tensor([500])
    # diffusers' set_attention_backend also sets its process-wide default: a GPU pipeline loaded earlier in this
    # process (cuDNN on Hopper) would send these CPU tensors to cuDNN. The model's own attention here is SDPA's.
    with torch.inference_mode(), attention_backend("native"):
        before = model(x, t, ctx, return_dict=False)[0]
        routed = fp8_attention.enable(model)
        after = model(x, t, ctx, return_dict=False)[0]
    assert routed == 4  # self- and cross-attention in each of the 2 blocks
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    slot = AttentionBackendName.SAGE
    assert _AttentionBackendRegistry._backends[slot] is fp8_attention.attention
    assert {m.processor._attention_backend for m in model.modules() if hasattr(m, "processor")} == {slot}
    assert torch.equal(before, after)
