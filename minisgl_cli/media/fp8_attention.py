"""FP8 attention in a diffusers DiT (opt-in, approximate): our Triton kernel as the model's 8-bit attention backend.

diffusers routes every attention call of a model through its backend registry by name; 8-bit attention is its
"sage" slot (SageAttention: INT8 / FP8 QK, FP8 PV), which wants a CUDA build of sageattention >= 2.1.1 that these
machines lack (1.x, pure Triton, ran slower than cuDNN's bf16 attention on an H200: examples/media_probe.py --sage).
`enable` binds that slot to kernels/triton/dit_attention.py and points the model's processors at it. Calls the
kernel does not cover (a mask, causal, short keys such as a text context, other head sizes) run the exact backend
the model would have had (cuDNN's on Hopper: Z-Image's caption mask would otherwise send SDPA to a slower kernel).
"""

from __future__ import annotations

from typing import Any

import torch

MIN_KEYS = 1024  # below this the attention is a small share of the step: the exact kernel, then
_fallback = "native"  # the diffusers backend of the calls the kernel does not take (set by `enable`)


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """diffusers' backend signature, (B, S, H, D) tensors in and out."""
    fits = (attn_mask is None and not is_causal and dropout_p == 0.0 and key.shape[1] >= MIN_KEYS
            and query.shape[-1] in (64, 128) and key.shape[2] == query.shape[2] and query.is_cuda)
    if fits:
        from minisgl_cli.kernels.triton.dit_attention import fp8_attention_op

        return fp8_attention_op(query, key, value, scale)
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    name = AttentionBackendName(_fallback)
    kwargs = {"query": query, "key": key, "value": value, "attn_mask": attn_mask, "dropout_p": dropout_p,
              "is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    accepted = _AttentionBackendRegistry._supported_arg_names[name]
    return _AttentionBackendRegistry._backends[name](**{k: v for k, v in kwargs.items() if k in accepted})


def enable(model: torch.nn.Module, fallback: str = "native") -> int:
    """Route `model`'s attention through `attention`, with `fallback` (a diffusers backend name) for the calls the
    kernel does not take; the number of attention modules routed (0: none found)."""
    global _fallback
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    _fallback = AttentionBackendName(fallback).value

    slot = AttentionBackendName.SAGE
    _AttentionBackendRegistry.register(slot)(attention)
    routed = 0
    for module in model.modules():
        processor: Any = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            processor._attention_backend = slot
            routed += 1
    return routed
