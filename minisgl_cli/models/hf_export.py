"""Our decoder's weights under HF transformers' names, and an HF model that shares them (for parity checks
and baselines on the same weights, without a second copy in memory)."""

from __future__ import annotations

import torch

from minisgl_cli.models.llama import LlamaForCausalLM

_HF_CONFIG_CLASS = {"LlamaForCausalLM": "LlamaConfig", "MistralForCausalLM": "MistralConfig",
                    "Qwen2ForCausalLM": "Qwen2Config", "Qwen3ForCausalLM": "Qwen3Config",
                    "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "MixtralForCausalLM": "MixtralConfig"}


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """HF-named views of our parameters (merged q/k/v and gate/up split back; stacked experts as transformers 5
    holds them: mlp.experts.gate_up_proj / down_proj); tensor parallel size 1 only."""
    if model.tp.size != 1:
        raise ValueError("hf_state_dict needs the whole model (tp_size 1)")
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        name = name if name.startswith("lm_head") else f"model.{name}"
        for merged, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
            if f".{merged}." in name:
                module = model.get_submodule(name.removeprefix("model.").rsplit(".", 1)[0])
                for part, chunk in zip(parts, p.split(module.local_sizes, dim=0)):
                    out[name.replace(merged, part)] = chunk
                break
        else:
            out[name] = p
    if model.cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.embed_tokens.weight
    return out


def hf_twin(model: LlamaForCausalLM, hf_config: dict, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """An HF transformers model of the same architecture whose parameters are our tensors (no copy)."""
    import transformers

    cfg_dict = {k: v for k, v in hf_config.items() if k != "architectures"}
    config = getattr(transformers, _HF_CONFIG_CLASS[model.cfg.architecture])(**cfg_dict)
    config._attn_implementation = attn_implementation
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    with torch.device("meta"):
        hf = getattr(transformers, model.cfg.architecture)(config)
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False, assign=True)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"HF twin mismatch: missing {missing}, unexpected {unexpected}")
    # Buffers (rotary inverse frequencies) are not in the state dict: rebuild them on the device.
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(config=config).to(device)  # fp32 buffers, as HF keeps them
    if model.cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    assert all(p.dtype == dtype for p in hf.parameters())
    return hf.eval()
