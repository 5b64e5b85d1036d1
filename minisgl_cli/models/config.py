"""ModelConfig: the architecture facts the engine needs, read from an HF config.json dict."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from minisgl_cli.layers.routing import GroupedRouting

MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
VISION_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# Gated DeltaNet hybrids: linear-attention layers with a recurrent state, gated full attention every few layers
# (Qwen3.5's hub checkpoints are its vision-language models: their language model runs, the vision tower is not
# loaded)
QWEN3_5_DENSE = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
QWEN3_5_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", *QWEN3_5_DENSE, *QWEN3_5_MOE)
# Gemma 4's hub checkpoints wrap the text decoder with vision / audio towers: its text_config and language model run
# (text only: the towers' weights are left unread, a request with images refused as for any text model)
GEMMA4_ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Gemma3ForCausalLM", "GptOssForCausalLM",
                 *GEMMA4_ARCHITECTURES, *VISION_ARCHITECTURES, *MLA_ARCHITECTURES, *HYBRID_ARCHITECTURES)


@dataclass(frozen=True)
class VisionConfig:
    """A Qwen2-VL / Qwen2.5-VL vision tower and how its images meet the decoder (M-RoPE, placeholder ids)."""

    version: str  # "2" (Qwen2-VL: LayerNorm, QuickGELU MLP) or "2.5" (RMSNorm, gated SiLU MLP, windowed attention)
    depth: int
    hidden_size: int  # the tower's width
    num_heads: int
    intermediate_size: int  # its MLP's
    out_hidden_size: int  # the decoder's width: what the patch merger writes
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    image_token_id: int
    vision_start_token_id: int
    mrope_section: tuple[int, ...]  # the decoder's rotary frequencies given to the t, h and w positions
    window_size: int = 0  # 2.5: windowed attention over window_size x window_size pixels
    fullatt_block_indexes: tuple[int, ...] = ()  # 2.5: the blocks that attend over the whole image
    rope_theta: float = 10000.0

    @staticmethod
    def from_hf(cfg: dict[str, Any], arch: str, text: dict[str, Any]) -> VisionConfig:
        v = cfg["vision_config"]
        rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
        common = dict(depth=v["depth"], num_heads=v["num_heads"], patch_size=v.get("patch_size", 14),
                      temporal_patch_size=v.get("temporal_patch_size", 2),
                      spatial_merge_size=v.get("spatial_merge_size", 2),
                      in_channels=v.get("in_channels", v.get("in_chans", 3)),
                      image_token_id=cfg["image_token_id"], vision_start_token_id=cfg["vision_start_token_id"],
                      mrope_section=tuple(rope.get("mrope_section") or (16, 24, 24)),
                      rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        if arch == "Qwen2VLForConditionalGeneration":
            width = v.get("embed_dim", 1280)
            return VisionConfig("2", hidden_size=width, intermediate_size=int(width * v.get("mlp_ratio", 4)),
                                out_hidden_size=v.get("hidden_size", text["hidden_size"]), **common)
        return VisionConfig("2.5", hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                            out_hidden_size=v.get("out_hidden_size", text["hidden_size"]),
                            window_size=v.get("window_size", 112),
                            fullatt_block_indexes=tuple(v.get("fullatt_block_indexes") or ()), **common)


@dataclass(frozen=True)
class MlaConfig:
    """DeepSeek's Multi-head Latent Attention: queries through a low-rank q_lora_rank (0: a plain q_proj), keys and
    values from one kv_lora_rank latent per token plus a qk_rope_head_dim key shared by every head (what the KV
    pool keeps: kvcache/pool.py), each head's key qk_nope_head_dim latent-made + the rope part, its value
    v_head_dim. `scale`: softmax scale, qk_head_dim^-1/2 times YaRN's mscale(factor, mscale_all_dim)^2 where the
    rope scaling says so (transformers' yarn_apply_mscale)."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rope dims as (x0, x1), (x2, x3) pairs (V2 always; V3's rope_interleave)
    scale: float

    @property
    def latent_dim(self) -> int:
        """One token's row in the KV pool: the normalized latent, then the rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @staticmethod
    def from_hf(arch: str, cfg: dict[str, Any], scaling: dict | None) -> MlaConfig:
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        scale = qk**-0.5
        if scaling and scaling.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
            m = 0.1 * scaling["mscale_all_dim"] * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0
            scale *= m * m
        return MlaConfig(q_lora_rank=cfg.get("q_lora_rank") or 0, kv_lora_rank=cfg["kv_lora_rank"],
                         qk_nope_head_dim=cfg["qk_nope_head_dim"], qk_rope_head_dim=cfg["qk_rope_head_dim"],
                         v_head_dim=cfg["v_head_dim"],
                         rope_interleave=arch == "DeepseekV2ForCausalLM" or cfg.get("rope_interleave") is not False,
                         scale=scale)


@dataclass(frozen=True)
class LinearAttnConfig:
    """The Gated DeltaNet layers of a Qwen3-Next / Qwen3.5 hybrid: which layers, their heads, the conv kernel."""

    layers: tuple[int, ...]  # decoder layers that are linear attention (the rest: gated full attention)
    num_k_heads: int  # query / key heads; each serves num_v_heads // num_k_heads value heads
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int  # the causal depthwise conv's width over the mixed q, k, v

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @staticmethod
    def from_hf(cfg: dict[str, Any], num_layers: int) -> LinearAttnConfig:
        types = cfg.get("layer_types")
        if types is None:  # the hub's Qwen3-Next config: every full_attention_interval-th layer is full attention
            every = cfg.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
        if len(types) != num_layers or set(types) - {"linear_attention", "full_attention"}:
            raise ValueError(f"layer_types {types!r} are not {num_layers} of linear_attention / full_attention")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg['hidden_act']!r}: the Gated DeltaNet layers run silu only")
        lin = LinearAttnConfig(tuple(i for i, t in enumerate(types) if t == "linear_attention"),
                               cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                               cfg["linear_value_head_dim"], cfg.get("linear_conv_kernel_dim", 4))
        if lin.num_v_heads % lin.num_k_heads:
            raise ValueError(f"linear_num_value_heads {lin.num_v_heads} is not a multiple of linear_num_key_heads "
                             f"{lin.num_k_heads}")
        return lin


@dataclass(frozen=True)
class HeadSplit:
    """One TP rank's attention heads: query heads [q_start, q_start + n_q), KV heads [kv_start, kv_start + n_kv)."""

    q_start: int
    n_q: int
    kv_start: int
    n_kv: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Qwen2: bias on q/k/v
    o_bias: bool = False  # a bias on o_proj too (transformers' attention_bias outside Qwen2: gpt-oss)
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral; 0 experts: dense). A layer is sparse unless listed in
    # mlp_only_layers or off the decoder_sparse_step (Qwen3-MoE's switches; see is_moe_layer).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; intermediate_size is the dense layers'
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1 (Mixtral always does)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    vision: VisionConfig | None = None  # a vision-language model's tower (Qwen2-VL, Qwen2.5-VL)
    # Attention per layer: each layer's sliding window W (a query sees itself and the W - 1 keys before it, as
    # transformers' sliding_window_overlay), 0 for full attention; () = every layer full (Mistral's
    # sliding_window: every layer W; gpt-oss / Gemma 3: their layer_types). attn_sinks: a learned logit per head
    # that joins each softmax's denominator only (gpt-oss).
    layer_windows: tuple[int, ...] = ()
    attn_sinks: bool = False
    query_pre_attn_scalar: float = 0.0  # Gemma: attention scores scaled by its -1/2 power (0: head_dim's)
    # Gemma 3: the sliding layers' own RoPE (base and scaling; 0: every layer turns by rope_theta / rope_scaling)
    local_rope_theta: float = 0.0
    local_rope_scaling: dict | None = None
    final_logit_softcapping: float = 0.0  # Gemma: logits = c tanh(logits / c) where set
    # Gemma 4: layers of two head shapes (the global ones' wider heads, fewer KV heads: each layer's where they
    # differ from head_dim / num_kv_heads, () where none does); the global layers' V their K projection's output
    # (attention_k_eq_v); the last layers reading an earlier layer's KV (kv_sources: each layer's source, () = its
    # own); per-layer input embeddings of this width (0: none); the KV-sharing layers' MLPs twice as wide
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    attention_k_eq_v: bool = False
    kv_sources: tuple[int, ...] = ()
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    double_wide_mlp: bool = False
    # gpt-oss experts: gate/up/down biases and the clamped SwiGLU (gate * sigmoid(alpha gate) * (up + 1), gate
    # clamped above and up both ways at swiglu_limit); 0: the SiLU-gated experts of Qwen3-MoE / Mixtral
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # DeepSeek-V2 / V3 (models/deepseek.py): MLA attention; the MoE's router (grouped top-k, sigmoid or softmax
    # scores, the scaling factor) and its shared experts, a dense MLP of n_shared_experts * moe_intermediate_size
    # beside the routed ones; the first first_k_dense_replace layers dense (mlp_only_layers)
    mla: MlaConfig | None = None
    routing: GroupedRouting | None = None
    n_shared_experts: int = 0
    # Qwen3-Next / Qwen3.5 hybrids: the Gated DeltaNet layers (None: every layer attends), RoPE on the first
    # rotary_dim channels of each head only (0: all of them), a shared expert beside the routed ones (its width)
    linear_attn: LinearAttnConfig | None = None
    rotary_dim: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def attn_scale(self) -> float:
        if self.mla is not None:
            return self.mla.scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The decoder layers that hold KV in the pool, in pool order (a hybrid's full-attention layers only)."""
        linear = set(self.linear_attn.layers) if self.linear_attn is not None else set()
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def attention_variants(self) -> bool:
        """Some layer attends through a sliding window or with sinks (not every backend runs them)."""
        return bool(self.layer_windows) or self.attn_sinks

    def window_of(self, layer_id: int) -> int:
        """Layer `layer_id`'s sliding window, 0 for full attention."""
        return self.layer_windows[layer_id] if self.layer_windows else 0

    def head_dim_of(self, layer_id: int) -> int:
        return self.layer_head_dims[layer_id] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, layer_id: int) -> int:
        return self.layer_kv_heads[layer_id] if self.layer_kv_heads else self.num_kv_heads

    def kv_source_of(self, layer_id: int) -> int:
        """The layer whose KV layer `layer_id` attends over: its own, or (Gemma 4's shared KV) an earlier one's."""
        return self.kv_sources[layer_id] if self.kv_sources else layer_id

    @property
    def mixed_heads(self) -> bool:
        """Layers differ in KV head count or head size, or some store no KV (Gemma 4)."""
        return bool(self.layer_head_dims or self.layer_kv_heads or self.kv_sources)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer `layer_id` has a sparse MoE block (else the dense MLP), as transformers decides."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    def heads_of(self, rank: int, tp_size: int, layer_id: int | None = None) -> HeadSplit:
        """Rank `rank`'s attention heads under TP (of layer `layer_id` where layers differ): whole GQA groups, as even
        as the counts allow.

        With at least as many KV heads as ranks each rank takes a contiguous run of KV heads (some may
        take one more: SmolLM2's 3 KV heads go 2 + 1 at TP 2) with their query heads. With fewer KV
        heads than ranks each KV head is replicated on tp / kv ranks, which split its query heads."""
        kv = self.num_kv_heads if layer_id is None else self.kv_heads_of(layer_id)
        group = self.num_heads // kv
        if tp_size <= kv:
            base, extra = divmod(kv, tp_size)
            kv_start = rank * base + min(rank, extra)
            n_kv = base + (rank < extra)
            return HeadSplit(kv_start * group, n_kv * group, kv_start, n_kv)
        if tp_size % kv or self.num_heads % tp_size:
            raise ValueError(f"--tp {tp_size} needs a multiple of the {kv} KV heads that divides the "
                             f"{self.num_heads} attention heads")
        n_q = self.num_heads // tp_size
        return HeadSplit(rank * n_q, n_q, rank * n_q // group, 1)

    @staticmethod
    def from_hf(top: dict[str, Any]) -> ModelConfig:
        arch = (top.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; minisgl runs {', '.join(ARCHITECTURES)}")
        vlm = arch in VISION_ARCHITECTURES
        # A VLM's decoder fields: its text_config (transformers 5 writes one) over the top level (the hub's files).
        hybrid = arch in HYBRID_ARCHITECTURES
        cfg = {**top, **top.get("text_config", {})} if vlm or hybrid or arch in GEMMA4_ARCHITECTURES else top
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_params = cfg.get("rope_parameters") or {}
        local_params: dict[str, Any] = {}
        if "full_attention" in rope_params:  # per layer type (transformers 5's Gemma 3): the global layers' here
            local_params = rope_params.get("sliding_attention") or {}
            rope_params = rope_params["full_attention"] or {}
        scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        if vlm:  # M-RoPE: default frequencies, split across the t / h / w positions (VisionConfig.mrope_section)
            scaling = None
        mla = MlaConfig.from_hf(arch, cfg, scaling) if arch in MLA_ARCHITECTURES else None
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size") or cfg.get("moe_intermediate_size", 0),
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            # MLA: every head its own key and value, made from the latent (the pool holds one latent row a token);
            # head_dim is the rope dims, as transformers' DeepSeek configs set it (the heads' widths: MlaConfig)
            num_kv_heads=heads if mla else cfg.get("num_key_value_heads") or heads,
            head_dim=mla.qk_rope_head_dim if mla else cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope_params.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            attention_bias=arch == "Qwen2ForCausalLM" or vlm or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and not vlm and bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", *GEMMA4_ARCHITECTURES)
            or hybrid,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            vision=VisionConfig.from_hf(top, arch, cfg) if vlm else None,
            layer_windows=_layer_windows(arch, cfg, cfg["num_hidden_layers"]),
            attn_sinks=arch == "GptOssForCausalLM",
            **_gemma_fields(arch, cfg, local_params),
            **_gemma4_fields(arch, cfg),
            **_moe_fields(arch, cfg),
            mla=mla,
            **_hybrid_fields(arch, cfg, rope_params),
        )


def _layer_windows(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: full) from `sliding_window` and, where the config lists them, its
    `layer_types` (sliding_attention / full_attention); a window with no layer_types covers every layer
    (Mistral). () where every layer is full."""
    window = cfg.get("sliding_window") or 0
    if not window or (cfg.get("use_sliding_window") is False):  # Qwen2's configs carry a window they switch off
        return ()
    types = cfg.get("layer_types")
    pattern = cfg.get("sliding_window_pattern")
    if types is None and arch == "GptOssForCausalLM":  # its default: windowed and full layers alternate
        pattern = 2
    if types is None and pattern:  # Gemma 3's hub configs: every pattern-th layer global, the rest local
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is None:
        return (window,) * num_layers
    if len(types) != num_layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types!r} are not {num_layers} of sliding_attention / full_attention")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _gemma_fields(arch: str, cfg: dict[str, Any], local_params: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields: the score scale, the local layers' RoPE, the final soft cap (none for other families); Gemma
    4's the same but for its score scale, 1 (its q / k norms take the place of one)."""
    if arch != "Gemma3ForCausalLM" and arch not in GEMMA4_ARCHITECTURES:
        return {}
    if cfg.get("attn_logit_softcapping"):
        raise ValueError("attn_logit_softcapping (Gemma 2's capped scores) is not supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {cfg['hidden_activation']!r}: Gemma runs gelu_pytorch_tanh only")
    local_type = local_params.get("rope_type", "default")
    scalar = 1.0 if arch in GEMMA4_ARCHITECTURES else cfg.get("query_pre_attn_scalar") or cfg["head_dim"]
    return dict(query_pre_attn_scalar=float(scalar),
                local_rope_theta=float(local_params.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0),
                local_rope_scaling=local_params if local_type != "default" else None,
                final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0))


def _hybrid_fields(arch: str, cfg: dict[str, Any], rope_params: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-Next / Qwen3.5 hybrid's fields: its Gated DeltaNet layers, partial RoPE, shared expert."""
    if arch not in HYBRID_ARCHITECTURES:
        return {}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    # (Qwen3.5's rope_parameters may carry an M-RoPE section: a text token's three positions are equal, so it
    # turns as plain RoPE does.)
    factor = rope_params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0
    shared = (cfg.get("shared_expert_intermediate_size") or 0) if arch not in QWEN3_5_DENSE else 0
    return dict(linear_attn=LinearAttnConfig.from_hf(cfg, cfg["num_hidden_layers"]),
                rotary_dim=int(head_dim * factor), shared_expert_intermediate_size=shared)


def _gemma4_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 4's per-layer heads, shared KV, per-layer inputs and wide MLPs, from its config as transformers writes it
    (per_layer_config: each global layer's head_dim / num_key_value_heads) or as the hub's files carry it
    (global_head_dim, num_global_key_value_heads). What it does not run yet is refused by name."""
    if arch not in GEMMA4_ARCHITECTURES:
        return {}
    if cfg.get("enable_moe_block"):
        raise ValueError("Gemma 4's MoE block (enable_moe_block: 26B-A4B) is not supported yet")
    if cfg.get("use_bidirectional_attention") == "all":
        raise ValueError("use_bidirectional_attention 'all' (Gemma 4 as a bidirectional encoder) is not supported")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias on Gemma 4's projections is not supported")
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    base_dim, base_kv = cfg["head_dim"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dims, kv = [base_dim] * n, [base_kv] * n
    k_eq_v = bool(cfg.get("attention_k_eq_v", False))
    overrides = cfg.get("per_layer_config")
    if overrides is None:
        wide = {"head_dim": cfg.get("global_head_dim") or 512}
        if k_eq_v and cfg.get("num_global_key_value_heads"):
            wide["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: wide for i, t in enumerate(types) if t == "full_attention"}
    for i, o in overrides.items():
        dims[int(i)], kv[int(i)] = o.get("head_dim", dims[int(i)]), o.get("num_key_value_heads", kv[int(i)])
    shared = cfg.get("num_kv_shared_layers") or 0
    sources = list(range(n))
    if shared:  # each shared layer reads the last unshared layer of its type (transformers' kv_sharing_modes)
        first = n - shared
        last = {t: i for i, t in enumerate(types[:first])}
        if set(types[first:]) - set(last):
            raise ValueError("num_kv_shared_layers: a shared layer type has no earlier layer to read KV from")
        sources[first:] = [last[t] for t in types[first:]]
    return dict(layer_head_dims=tuple(dims) if set(dims) != {base_dim} else (),
                layer_kv_heads=tuple(kv) if set(kv) != {base_kv} else (),
                attention_k_eq_v=k_eq_v, kv_sources=tuple(sources) if shared else (),
                per_layer_input_size=cfg.get("hidden_size_per_layer_input") or 0,
                per_layer_vocab_size=cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"],
                double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)))


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of an HF config (none for dense architectures). Qwen3-MoE's checkpoints say num_experts,
    transformers 5 writes num_local_experts (Mixtral's name) for both; Mixtral's experts use intermediate_size."""
    if arch == "GptOssForCausalLM":
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True,
                    swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                    swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)))
    if arch in MLA_ARCHITECTURES:
        return _deepseek_moe_fields(arch, cfg)
    if arch in QWEN3_5_MOE:  # every layer sparse, the top-k weights always renormalized
        return dict(num_experts=cfg["num_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=True)
    if arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen3NextForCausalLM"):
        return {}
    mixtral = arch == "MixtralForCausalLM"
    return dict(
        num_experts=cfg.get("num_experts") or cfg["num_local_experts"],
        num_experts_per_tok=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"],
        norm_topk_prob=mixtral or bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=1 if mixtral else cfg.get("decoder_sparse_step") or 1,
        mlp_only_layers=() if mixtral else tuple(cfg.get("mlp_only_layers") or ()),
    )


def _deepseek_moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's MoE as transformers' DeepseekV2 / V3 route it (layers/moe.py's GroupedRouting); what they would run
    otherwise than DeepSeek's own code (or not at all) is refused by name."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r}: DeepSeek runs silu only")
    if (cfg.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (transformers ignores it): only 1")
    experts = cfg.get("n_routed_experts") or 0
    if not experts:
        return {}
    v3 = arch == "DeepseekV3ForCausalLM"
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if (v3 and (scoring, method) != ("sigmoid", "noaux_tc")) or (
            not v3 and (scoring != "softmax" or method not in ("greedy", "group_limited_greedy"))):
        raise ValueError(f"scoring_func {scoring!r} with topk_method {method!r} is not supported for {arch}")
    if not v3 and cfg.get("norm_topk_prob"):  # DeepSeek's code renormalizes, transformers' V2 does not: refused
        raise ValueError("norm_topk_prob true on DeepSeek-V2 is not supported (transformers ignores it)")
    groups = cfg.get("n_group") or 1
    grouped = v3 or method == "group_limited_greedy"
    if grouped and experts % groups:
        raise ValueError(f"n_routed_experts {experts} is not a multiple of n_group {groups}")
    routing = GroupedRouting(
        scoring="sigmoid" if scoring == "sigmoid" else "softmax",
        n_group=groups if grouped else 1, topk_group=(cfg.get("topk_group") or 1) if grouped else 1,
        group_score="top2_sum" if v3 else "max", correction_bias=v3,
        renormalize=v3 and bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=routing.renormalize,
                mlp_only_layers=tuple(range(cfg.get("first_k_dense_replace") or 0)),
                n_shared_experts=cfg.get("n_shared_experts") or 0, routing=routing)
