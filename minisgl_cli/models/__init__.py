"""Models in plain torch: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral and gpt-oss decoders, Gemma 3 and 4 text,
DeepSeek-V2 / V3 (MLA and shared + routed experts), Qwen2-VL / Qwen2.5-VL (the Qwen2 decoder with a vision tower),
and the Gated DeltaNet hybrids Qwen3-Next and Qwen3.5 text, chosen by the config's architecture."""

from __future__ import annotations

from minisgl_cli.distributed import TPInfo
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.models.config import ModelConfig
from minisgl_cli.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from minisgl_cli.models.gemma3 import Gemma3ForCausalLM
from minisgl_cli.models.gemma4 import Gemma4ForCausalLM
from minisgl_cli.models.llama import (
    GptOssForCausalLM,
    LlamaForCausalLM,
    MixtralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)
from minisgl_cli.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from minisgl_cli.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForCausalLM,  # its text model (config.py)
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM,  # its language model (the vision tower is not loaded)
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
}


def create_model(cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None) -> LlamaForCausalLM:
    return _CLASSES[cfg.architecture](cfg, tp, kernels, method)


__all__ = ["ModelConfig", "create_model"]
