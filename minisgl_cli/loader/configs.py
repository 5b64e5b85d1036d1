"""Built-in architecture configs by name, for `--load-format dummy` speed work without a checkpoint."""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
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
}


def builtin_config(name: str) -> dict[str, Any]:
    key = name.lower().split("/")[-1]
    if key not in BUILTIN_CONFIGS:
        raise KeyError(f"no built-in config named {name!r}; choose one of: {', '.join(BUILTIN_CONFIGS)}")
    return dict(BUILTIN_CONFIGS[key])
