"""Built-in architecture configs by name, for `--load-format dummy` speed work without a checkpoint."""

from __future__ import annotations

import copy
from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# gpt-oss: 128-position windows on every other layer, a sink per head, experts of 2880 with biases (4 per token); 20b
# and 120b differ in depth and expert count. The hub's quantization_config: MXFP4 experts (loader/mxfp4.py), so
# dummy weights come as its checkpoints do, kept packed on CUDA (--quantization none: dequantized, ~42 / ~234 GB
# in bf16 against ~14 / ~66 GB packed).
_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_experts_per_tok": 4,
    "attention_bias": True, "sliding_window": 128, "swiglu_limit": 7.0, "rms_norm_eps": 1e-5, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 199998,
    "eos_token_id": [200002, 199999, 200012],
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}

# Gemma 3's text decoders (the checkpoints' text_config): five local layers (1024-position windows, RoPE base 10k) to
# one global (1M, linear scaling 8), QK-norm, 256k vocabulary, tied head; 12b and 27b differ in their shapes.
_GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262208,
    "sliding_window": 1024, "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": [1, 106],
}

# DeepSeek (models/deepseek.py): MLA (a 512 + 64 latent row a token), shared + routed experts, YaRN to 160k positions.
# V2-Lite as published (15.7B, ~31 GB in bf16: a plain q_proj, softmax routing over 64 experts, 6 a token); V3's
# widths (a 1536 q_lora_rank, 128 heads, 256 experts in 8 groups, sigmoid routing with a correction bias) cut to 5
# layers, one dense and four MoE, to fit one H200 in bf16 (~97 GB); "deepseek-tiny": V3's design at toy widths, for
# starting the CPU paths (`minisgl smoke --model deepseek-tiny --load-format dummy --device cpu`);
# "deepseek-v3-5layer-fp8": the same with V3's published quantization_config (block-wise FP8, 128 x 128), so its
# linears and experts run as the shipped checkpoint's do on an FP8 GPU (layers/quant.py's fp8-block: ~50 GB).
_DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "norm_topk_prob": True, "moe_layer_freq": 1, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,  # one MTP layer (--speculative-algorithm mtp)
}

# Gated DeltaNet hybrids (models/qwen3_next.py): three linear-attention layers to one gated full-attention layer.
# Qwen3.5's shapes are transformers 5.24's defaults of its text configs (the docstrings' Qwen3.5-9B and
# Qwen3.5-35B-A3B); RoPE on a quarter of each 256-wide head.
_QWEN3_5 = {
    "vocab_size": 248320, "num_attention_heads": 16, "head_dim": 256, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "full_attention_interval": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1,  # one MTP layer (--speculative-algorithm mtp)
}

# Gemma 4 31B's text decoder (google/gemma-4-31B's text_config as published): five local layers (1024-position
# windows, 16 KV heads of 256, RoPE base 10k) to one global (4 KV heads of 512, K = V, proportional RoPE turning a
# quarter of the pairs at base 1M), QK / V norms, final soft cap 30, tied head; no per-layer inputs, no shared KV.
_GEMMA4_31B = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
    "sliding_window": 1024, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
    "final_logit_softcapping": 30.0, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
    "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 262144,
    "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": [1, 106],
}

BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 40960, "tie_word_embeddings": True, "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": True, "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": True, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009], "rope_scaling": dict(_LLAMA3_ROPE),
    },
    # Mixture of experts. Qwen3-30B-A3B: 128 experts, 8 per token, ~61 GB of bf16 weights (one H100 with a small
    # KV cache, or --tp 2); Mixtral-8x7B: 8 experts, 2 per token, ~93 GB (--tp 2 on H100s).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    # Sliding-window attention
    "gpt-oss-20b": {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32,
                    "layer_types": ["sliding_attention", "full_attention"] * 12},
    "gpt-oss-120b": {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128,
                     "layer_types": ["sliding_attention", "full_attention"] * 18},
    "gemma-3-12b": {**_GEMMA3, "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
                    "query_pre_attn_scalar": 256},
    "gemma-3-27b": {**_GEMMA3, "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
                    "query_pre_attn_scalar": 168},
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_group": 1,
        "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": 163840, "tie_word_embeddings": False,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
        "bos_token_id": 100000, "eos_token_id": 100001,
    },
    "deepseek-v3-5layer": {**_DEEPSEEK_V3, "num_hidden_layers": 5, "first_k_dense_replace": 1},
    "deepseek-v3-5layer-fp8": {**_DEEPSEEK_V3, "num_hidden_layers": 5, "first_k_dense_replace": 1,
                               "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
                                                       "dynamic", "weight_block_size": [128, 128]}},
    "deepseek-tiny": {**_DEEPSEEK_V3, "vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512,
                      "moe_intermediate_size": 64, "num_hidden_layers": 3, "first_k_dense_replace": 1,
                      "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 16,
                      "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "kv_lora_rank": 64,
                      "q_lora_rank": 96, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 64},
    "qwen3.5-9b": {**_QWEN3_5, "architectures": ["Qwen3_5ForCausalLM"], "hidden_size": 4096,
                   "intermediate_size": 12288, "num_hidden_layers": 32, "num_key_value_heads": 4},
    "qwen3.5-35b-a3b": {**_QWEN3_5, "architectures": ["Qwen3_5MoeForCausalLM"], "hidden_size": 2048,
                        "num_hidden_layers": 40, "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
    # Qwen3-Next-80B-A3B's layers (512 experts, 10 per token, a shared one) but 24 of its 48: ~80 GB of bf16 weights,
    # so one H200 holds it with room for KV and states.
    "qwen3-next-80b-a3b": {**_QWEN3_5, "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 151936,
                           "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                           "num_key_value_heads": 2, "num_experts": 512, "num_experts_per_tok": 10,
                           "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                           "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 262144,
                           "bos_token_id": 151643, "eos_token_id": 151645},
    "gemma-4-31b": _GEMMA4_31B,
    # A vision-language model (models/qwen2_vl.py): the Qwen2 decoder with M-RoPE and a 32-block ViT. Serving images
    # needs a tokenizer and an image processor: examples/make_tiny_media_models.py's write_dummy_vlm_dir writes a
    # directory for this config (examples/bench_vlm.py gpu).
    "qwen2.5-vl-7b": {
        # model_type: transformers' AutoProcessor picks the processor class by it
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 128000,
        "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "vision_config": {
            "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
            "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2,
        },
    },
}


def builtin_config(name: str) -> dict[str, Any]:
    key = name.lower().split("/")[-1]
    if key not in BUILTIN_CONFIGS:
        raise KeyError(f"no built-in config named {name!r}; choose one of: {', '.join(BUILTIN_CONFIGS)}")
    return copy.deepcopy(BUILTIN_CONFIGS[key])  # nested dicts too: a caller may edit its copy
