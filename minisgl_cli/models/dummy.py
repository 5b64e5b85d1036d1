"""Random weights of real shapes (`--load-format dummy`), scaled so activations stay finite.

They come as a checkpoint — full, HF-named tensors — through the model's own loading path, so every
TP rank takes its shard of the same numbers and TP 2 computes what TP 1 does.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from minisgl_cli.models.config import ModelConfig, VisionConfig


def _shapes(mc: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    h = mc.hidden_size
    gemma4 = mc.architecture.startswith("Gemma4")
    yield "model.embed_tokens.weight", (mc.vocab_size, h)
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        d, inter = mc.head_dim_of(i), mc.intermediate_size
        q, kv = mc.num_heads * d, mc.kv_heads_of(i) * d
        projs = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
        if mc.kv_source_of(i) != i:  # Gemma 4's shared-KV layers: a query projection only, and a wider MLP
            projs, inter = projs[:1], inter * (2 if mc.double_wide_mlp else 1)
        elif mc.attention_k_eq_v and not mc.window_of(i):  # Gemma 4's global layers: V is K's projection
            projs = projs[:2]
        for name, rows in projs:
            yield f"{p}self_attn.{name}.weight", (rows, h)
            if mc.attention_bias:
                yield f"{p}self_attn.{name}.bias", (rows,)
        yield f"{p}self_attn.o_proj.weight", (h, q)
        if mc.o_bias:
            yield f"{p}self_attn.o_proj.bias", (h,)
        if mc.attn_sinks:
            yield f"{p}self_attn.sinks", (mc.num_heads,)
        if mc.qk_norm:
            yield f"{p}self_attn.q_norm.weight", (d,)
            if len(projs) > 1:
                yield f"{p}self_attn.k_norm.weight", (d,)
        if mc.is_moe_layer(i) and mc.swiglu_limit:  # gpt-oss's names: a router with a bias, stacked experts
            e, i2 = mc.num_experts, mc.moe_intermediate_size
            yield f"{p}mlp.router.weight", (e, h)
            yield f"{p}mlp.router.bias", (e,)
            yield f"{p}mlp.experts.gate_up_proj", (e, h, 2 * i2)
            yield f"{p}mlp.experts.gate_up_proj_bias", (e, 2 * i2)
            yield f"{p}mlp.experts.down_proj", (e, i2, h)
            yield f"{p}mlp.experts.down_proj_bias", (e, h)
        elif mc.is_moe_layer(i):  # Qwen3-MoE's names (the loader takes Mixtral's too)
            yield f"{p}mlp.gate.weight", (mc.num_experts, h)
            for e in range(mc.num_experts):
                yield f"{p}mlp.experts.{e}.gate_proj.weight", (mc.moe_intermediate_size, h)
                yield f"{p}mlp.experts.{e}.up_proj.weight", (mc.moe_intermediate_size, h)
                yield f"{p}mlp.experts.{e}.down_proj.weight", (h, mc.moe_intermediate_size)
        else:
            yield f"{p}mlp.gate_proj.weight", (inter, h)
            yield f"{p}mlp.up_proj.weight", (inter, h)
            yield f"{p}mlp.down_proj.weight", (h, inter)
        yield f"{p}input_layernorm.weight", (h,)
        yield f"{p}post_attention_layernorm.weight", (h,)
        if mc.architecture == "Gemma3ForCausalLM" or gemma4:
            yield f"{p}pre_feedforward_layernorm.weight", (h,)
            yield f"{p}post_feedforward_layernorm.weight", (h,)
        if gemma4:
            yield f"{p}layer_scalar", (1,)
        if mc.per_layer_input_size:
            yield f"{p}per_layer_input_gate.weight", (mc.per_layer_input_size, h)
            yield f"{p}per_layer_projection.weight", (h, mc.per_layer_input_size)
            yield f"{p}post_per_layer_input_norm.weight", (h,)
    yield "model.norm.weight", (h,)
    if mc.per_layer_input_size:
        width = mc.num_layers * mc.per_layer_input_size
        yield "model.embed_tokens_per_layer.weight", (mc.per_layer_vocab_size, width)
        yield "model.per_layer_model_projection.weight", (width, h)
        yield "model.per_layer_projection_norm.weight", (mc.per_layer_input_size,)
    if not mc.tie_word_embeddings:
        yield "lm_head.weight", (mc.vocab_size, h)
    if mc.vision is not None:
        yield from _vision_shapes(mc.vision)


def _vision_shapes(vc: VisionConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A Qwen2-VL / Qwen2.5-VL vision tower, as the hub's checkpoints name it."""
    d, inner, merged = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.spatial_merge_size**2
    yield "visual.patch_embed.proj.weight", (d, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
    norms = ("weight", "bias") if vc.version == "2" else ("weight",)  # LayerNorm / RMSNorm
    mlp = ({"fc1": (inner, d), "fc2": (d, inner)} if vc.version == "2" else
           {"gate_proj": (inner, d), "up_proj": (inner, d), "down_proj": (d, inner)})
    for i in range(vc.depth):
        p = f"visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            yield from ((f"{p}{norm}.{leaf}", (d,)) for leaf in norms)
        yield f"{p}attn.qkv.weight", (3 * d, d)
        yield f"{p}attn.qkv.bias", (3 * d,)
        yield f"{p}attn.proj.weight", (d, d)
        yield f"{p}attn.proj.bias", (d,)
        for name, shape in mlp.items():
            yield f"{p}mlp.{name}.weight", shape
            yield f"{p}mlp.{name}.bias", shape[:1]
    yield from ((f"visual.merger.ln_q.{leaf}", (d,)) for leaf in norms)
    yield "visual.merger.mlp.0.weight", (merged, merged)
    yield "visual.merger.mlp.0.bias", (merged,)
    yield "visual.merger.mlp.2.weight", (vc.out_hidden_size, merged)
    yield "visual.merger.mlp.2.bias", (vc.out_hidden_size,)


@torch.no_grad()
def dummy_checkpoint(mc: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                     std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """Normal(0, std) matrices, ones for norm weights, zeros for biases and sinks, one tensor at a time.

    CPU tensors get the same numbers whatever the machine; CUDA ones are drawn on the device (an 8B
    model in seconds), the same on every GPU of one kind."""
    for i, (name, shape) in enumerate(_shapes(mc)):
        if name.endswith(("bias", "sinks")):
            yield name, torch.zeros(shape, device=device, dtype=dtype)
        elif len(shape) == 1:
            yield name, torch.ones(shape, device=device, dtype=dtype)
        else:
            gen = torch.Generator(device=device).manual_seed(seed * 100003 + i)
            if device.type == "cuda":
                yield name, torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)
            else:
                yield name, (torch.randn(shape, generator=gen) * std).to(dtype)
