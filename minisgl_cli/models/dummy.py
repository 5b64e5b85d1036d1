"""Random weights of real shapes (`--load-format dummy`), scaled so activations stay finite.

They come as a checkpoint — full, HF-named tensors — through the model's own loading path, so every
TP rank takes its shard of the same numbers and TP 2 computes what TP 1 does.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from minisgl_cli.models.config import ModelConfig, VisionConfig


def _shapes(mc: ModelConfig, mxfp4: bool = False) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every tensor of a checkpoint of `mc` by its HF name; `mxfp4`: gpt-oss's experts as MXFP4 bytes and exponents."""
    if mc.mla is not None:
        yield from _deepseek_shapes(mc)
        return
    h = mc.hidden_size
    gemma4 = mc.architecture.startswith("Gemma4")
    yield "model.embed_tokens.weight", (mc.vocab_size, h)
    linear = mc.linear_attn.layers if mc.linear_attn is not None else ()
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        if i in linear:
            yield from _linear_attn_shapes(mc, f"{p}linear_attn.")
            yield from _mlp_shapes(mc, i, p, mxfp4=mxfp4)
            continue
        d, inter = mc.head_dim_of(i), mc.intermediate_size
        q, kv = mc.num_heads * d, mc.kv_heads_of(i) * d
        # a hybrid's full attention projects a gate beside each query head (the family's: an MTP layer's one-layer
        # config has no linear layer)
        gated = mc.linear_attn is not None
        projs = [("q_proj", 2 * q if gated else q), ("k_proj", kv), ("v_proj", kv)]
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
        yield from _mlp_shapes(mc, i, p, inter, mxfp4)
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


def _deepseek_shapes(mc: ModelConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """DeepSeek-V2 / V3 as their checkpoints name them: MLA's projections and norms, shared + routed experts."""
    m, h = mc.mla, mc.hidden_size
    assert m is not None
    qk, heads = m.qk_nope_head_dim + m.qk_rope_head_dim, mc.num_heads
    yield "model.embed_tokens.weight", (mc.vocab_size, h)
    for i in range(mc.num_layers):
        p = f"model.layers.{i}."
        if m.q_lora_rank:
            yield f"{p}self_attn.q_a_proj.weight", (m.q_lora_rank, h)
            yield f"{p}self_attn.q_a_layernorm.weight", (m.q_lora_rank,)
            yield f"{p}self_attn.q_b_proj.weight", (heads * qk, m.q_lora_rank)
        else:
            yield f"{p}self_attn.q_proj.weight", (heads * qk, h)
        yield f"{p}self_attn.kv_a_proj_with_mqa.weight", (m.latent_dim, h)
        yield f"{p}self_attn.kv_a_layernorm.weight", (m.kv_lora_rank,)
        yield f"{p}self_attn.kv_b_proj.weight", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        yield f"{p}self_attn.o_proj.weight", (h, heads * m.v_head_dim)
        mlps = [("mlp", mc.intermediate_size)]
        if mc.is_moe_layer(i):
            yield f"{p}mlp.gate.weight", (mc.num_experts, h)
            if mc.routing is not None and mc.routing.correction_bias:
                yield f"{p}mlp.gate.e_score_correction_bias", (mc.num_experts,)
            mlps = [(f"mlp.experts.{e}", mc.moe_intermediate_size) for e in range(mc.num_experts)]
            if mc.n_shared_experts:
                mlps.append(("mlp.shared_experts", mc.moe_intermediate_size * mc.n_shared_experts))
        for name, inter in mlps:
            yield f"{p}{name}.gate_proj.weight", (inter, h)
            yield f"{p}{name}.up_proj.weight", (inter, h)
            yield f"{p}{name}.down_proj.weight", (h, inter)
        yield f"{p}input_layernorm.weight", (h,)
        yield f"{p}post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if not mc.tie_word_embeddings:
        yield "lm_head.weight", (mc.vocab_size, h)


def _linear_attn_shapes(mc: ModelConfig, p: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    """A Gated DeltaNet layer as Qwen3.5's checkpoints name it (split input projections)."""
    la = mc.linear_attn
    assert la is not None
    h = mc.hidden_size
    yield f"{p}in_proj_qkv.weight", (la.conv_dim, h)
    yield f"{p}in_proj_z.weight", (la.value_dim, h)
    yield f"{p}in_proj_b.weight", (la.num_v_heads, h)
    yield f"{p}in_proj_a.weight", (la.num_v_heads, h)
    yield f"{p}conv1d.weight", (la.conv_dim, 1, la.conv_kernel)
    yield f"{p}A_log", (la.num_v_heads,)
    yield f"{p}dt_bias", (la.num_v_heads,)
    yield f"{p}norm.weight", (la.head_v_dim,)
    yield f"{p}out_proj.weight", (h, la.value_dim)


def _mlp_shapes(mc: ModelConfig, i: int, p: str, inter: int = 0,
                mxfp4: bool = False) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Layer i's MLP (dense of `inter`, default the config's width; or the experts with their router and any shared
    expert) and its two norms."""
    h, inter = mc.hidden_size, inter or mc.intermediate_size
    if mc.is_moe_layer(i) and mc.swiglu_limit:  # gpt-oss's names: a router with a bias, stacked experts
        e, i2 = mc.num_experts, mc.moe_intermediate_size
        yield f"{p}mlp.router.weight", (e, h)
        yield f"{p}mlp.router.bias", (e,)
        if mxfp4:  # loader/mxfp4.py's layout: [E, rows, cols / 32, 16] bytes, [E, rows, cols / 32] exponents
            for proj, rows, cols in (("gate_up_proj", 2 * i2, h), ("down_proj", h, i2)):
                yield f"{p}mlp.experts.{proj}_blocks", (e, rows, cols // 32, 16)
                yield f"{p}mlp.experts.{proj}_scales", (e, rows, cols // 32)
        else:
            yield f"{p}mlp.experts.gate_up_proj", (e, h, 2 * i2)
            yield f"{p}mlp.experts.down_proj", (e, i2, h)
        yield f"{p}mlp.experts.gate_up_proj_bias", (e, 2 * i2)
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
    if mc.is_moe_layer(i) and mc.shared_expert_intermediate_size:
        s = mc.shared_expert_intermediate_size
        yield f"{p}mlp.shared_expert.gate_proj.weight", (s, h)
        yield f"{p}mlp.shared_expert.up_proj.weight", (s, h)
        yield f"{p}mlp.shared_expert.down_proj.weight", (h, s)
        yield f"{p}mlp.shared_expert_gate.weight", (1, h)
    yield f"{p}input_layernorm.weight", (h,)
    yield f"{p}post_attention_layernorm.weight", (h,)


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
                     std: float = 0.02, mxfp4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Normal(0, std) matrices, ones for norm weights, zeros for biases and sinks, one tensor at a time; `mxfp4`:
    gpt-oss's experts as an MXFP4 checkpoint's (uniform random bytes: codes of RMS ~2.9, under exponents of
    2^-8 .. 2^-6, RMS ~std).

    CPU tensors get the same numbers whatever the machine; CUDA ones are drawn on the device (an 8B
    model in seconds), the same on every GPU of one kind."""
    for i, (name, shape) in enumerate(_shapes(mc, mxfp4)):
        if name.endswith(("_blocks", "_scales")):
            gen = torch.Generator(device=device).manual_seed(seed * 100003 + i) if device.type != "meta" else None
            low, high = (0, 256) if name.endswith("_blocks") else (119, 122)
            yield name, torch.randint(low, high, shape, generator=gen, device=device, dtype=torch.uint8)
        elif name.endswith(("bias", "sinks")):
            yield name, torch.zeros(shape, device=device, dtype=dtype)
        elif len(shape) == 1:
            yield name, torch.ones(shape, device=device, dtype=dtype)
        else:
            yield name, random_matrix(shape, device, dtype, seed * 100003 + i, std)


def random_matrix(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype, seed: int,
                  std: float = 0.02) -> torch.Tensor:
    """A dummy checkpoint's Normal(0, std) matrix from generator seed `seed`: on the CPU the same numbers whatever
    the machine, on CUDA drawn on the device; on the meta device shapes only (an engine's memory accounting at full
    size, no weights)."""
    if device.type == "meta":
        return torch.empty(shape, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    if device.type == "cuda":
        return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)
    return (torch.randn(shape, generator=gen) * std).to(dtype)
