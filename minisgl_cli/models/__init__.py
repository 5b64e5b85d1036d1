"""Models in plain torch: Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral decoders, chosen by the config's architecture."""

from __future__ import annotations

from minisgl_cli.distributed import TPInfo
from minisgl_cli.layers.fused import Kernels
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.models.config import ModelConfig
from minisgl_cli.models.llama import (
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def create_model(cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None) -> LlamaForCausalLM:
    return _CLASSES[cfg.architecture](cfg, tp, kernels, method)


__all__ = ["ModelConfig", "create_model"]
