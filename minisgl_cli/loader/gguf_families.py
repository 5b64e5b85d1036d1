"""The newer families' GGUF layouts (Gemma 3 / 4, DeepSeek-V2 / V3, gpt-oss, Qwen3-Next / Qwen3.5) read back into
HF's: config fields from llama.cpp's metadata, tensors from llama.cpp's names and transforms.

What llama.cpp's converter (convert_hf_to_gguf.py: Gemma3Model, Gemma4Model, DeepseekV2Model, GptOssModel,
Qwen3NextModel and Qwen3.5's _LinearAttentionVReorderBase) does, undone here:
  * gemma3: every RMSNorm weight stored as 1 + w (Gemma's norm scales by 1 + w; ggml's by w), q / k rows as HF has
    them (NEOX RoPE: no interleave); the local layers' RoPE base (10000), their pattern (every 6th layer global) and
    the score scale are not in the file: llama.cpp fixes them, and so do we, as it does;
  * gemma4 (dense): plain norms (w, no shift); the layer kinds as sliding_window_pattern flags, the global layers'
    head_dim in key_length (the local ones' in key_length_swa), KV heads and MLP widths as per-layer arrays, K = V
    where a global layer has no attn_v, the shared-KV layers' count, the per-layer inputs' tensors; the global
    layers' proportional RoPE as rope_freqs (1 for each turning pair, 1e30 for the still ones); the MoE variant
    refused;
  * deepseek2: MLA written as MQA (head_count_kv 1, key_length kv_lora_rank + rope dims), the per-head widths in
    key_length_mla / value_length_mla (older files: key_length / value_length); kv_b_proj split into attn_k_b
    ([head, kv_lora_rank, nope], k transposed) and attn_v_b ([head, v_dim, kv_lora_rank]) by newer converters, whole
    (attn_kv_b) by older ones; the routed experts stacked into ffn_*_exps [E, out, in]; sigmoid gating (V3) with the
    correction bias exp_probs_b, or softmax (V2); YaRN's mscale_all_dim as 0.1 x yarn_log_multiplier; RoPE dims in
    (x0, x1) pairs as HF's DeepSeek stores them (rope_interleave), no row permutation;
  * gpt-oss: HF's gate_up_proj [E, H, 2I] (gate and up in alternate columns) split into ffn_gate_exps /
    ffn_up_exps [E, I, H] and down_proj [E, I, H] transposed to ffn_down_exps [E, H, I], each with its bias, the
    experts usually MXFP4 (dequantized here by the gguf package); the sinks as attn_sinks; the window pattern (even
    layers local) and the SwiGLU clamp (7) fixed by llama.cpp, not in the file;
  * qwen3next / qwen35 / qwen35moe: the (1 + w) norms stored as 1 + w (the gated ssm_norm as is), A_log as
    A = -exp(A_log) (ssm_a, bare-named), dt_bias as ssm_dt.bias, the conv squeezed to [channels, kernel], every
    full_attention_interval-th layer full; Qwen3-Next's in_proj_qkvz split into attn_qkv (q, k, v of all heads) and
    attn_gate (z), in_proj_ba as ssm_ba; Qwen3.5's in_proj_qkv / z / a / b, conv, A, dt and out_proj with their value
    heads reordered from HF's grouped order to ggml's tiled one (where key and value heads differ in number).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Out:
    """One HF tensor made from a GGUF tensor: its name, its value, and where its bytes as shipped still hold it (the
    whole GGUF tensor: `shipped`; expert e of a stacked one: `expert`), so its blocks may be kept."""

    name: str
    value: np.ndarray
    shipped: bool = False
    expert: int | None = None


class Meta:
    """A GGUF's metadata under its architecture's prefix, and the few tensors a config is read from (Gemma 4's
    rope_freqs): `tensor(name)` their values, `shape(name)` any tensor's HF-order shape (None where absent)."""

    def __init__(self, fields: Callable[[str, Any], Any], arch: str,
                 tensors: Callable[[str], np.ndarray | None] = lambda name: None,
                 shapes: Callable[[str], tuple[int, ...] | None] = lambda name: None):
        self._field, self.arch, self.tensor, self.shape = fields, arch, tensors, shapes

    def get(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.arch}.{key}", default)

    def field(self, key: str) -> Any:
        """A field outside the architecture's prefix (the tokenizer's)."""
        return self._field(key, None)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise KeyError(f"{self.arch}.{key}")
        return value


def _common(meta: Meta, vocab: int) -> dict[str, Any]:
    """The fields every family shares, named as transformers' configs take them; the vocab the embedding's rows (not
    {arch}.vocab_size: llama.cpp's Gemma 3 converter drops the rows past the tokenizer's)."""
    return dict(vocab_size=int(vocab), hidden_size=int(meta.need("embedding_length")),
                num_hidden_layers=int(meta.need("block_count")),
                num_attention_heads=int(meta.need("attention.head_count")),
                rms_norm_eps=float(meta.need("attention.layer_norm_rms_epsilon")),
                max_position_embeddings=int(meta.need("context_length")), dtype="float32")


def _layer(name: str) -> tuple[int, str, str] | None:
    """(layer, kind, suffix) of a blk.{i}.{kind}.{suffix} name (suffix "" for llama.cpp's bare ones: ssm_a), else
    None."""
    parts = name.split(".")
    if len(parts) in (3, 4) and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), parts[2], parts[3] if len(parts) == 4 else ""
    return None


_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


# --- Gemma 3 ------------------------------------------------------------------------------------------------------

_GEMMA3_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GEMMA3_SWA_PATTERN = 6  # llama.cpp's for gemma3 where the file lists no pattern: every 6th layer global
GEMMA3_SWA_ROPE_BASE = 10000.0  # llama.cpp's local layers' base where the file names none


def _layer_types(meta: Meta, n: int, every: int) -> list[str]:
    """Each layer's attention: the file's flag a layer (newer files), else every `every`-th layer full (the file's
    period where it gives one, else llama.cpp's for the architecture)."""
    pattern = meta.get("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    every = int(pattern or every)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]


def gemma3_config(meta: Meta, vocab: int) -> dict[str, Any]:
    c = _common(meta, vocab)
    n, heads, hidden = c["num_hidden_layers"], c["num_attention_heads"], c["hidden_size"]
    head_dim = int(meta.need("attention.key_length"))
    window = meta.get("attention.sliding_window")
    # the window is written only where some layer is local
    types = ["full_attention"] * n if window is None else _layer_types(meta, n, GEMMA3_SWA_PATTERN)
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 1_000_000.0))}
    if meta.get("rope.scaling.type") == "linear":
        full.update(rope_type="linear", factor=float(meta.need("rope.scaling.factor")))
    # llama.cpp's score scale: 27B's (62 layers) by hidden / heads, every other size's by head_dim
    scalar = hidden // heads if n == 62 else head_dim
    return dict(c, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                intermediate_size=int(meta.need("feed_forward_length")),
                num_key_value_heads=int(meta.get("attention.head_count_kv", heads)), head_dim=head_dim,
                sliding_window=int(window) if window is not None else 4096, layer_types=types,
                query_pre_attn_scalar=scalar, final_logit_softcapping=meta.get("final_logit_softcapping"),
                hidden_activation="gelu_pytorch_tanh",
                rope_parameters={"full_attention": full, "sliding_attention": {
                    "rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE))}})


def _global(name: str, table: dict[str, str] | None = None) -> str:
    """The HF name of a tensor outside the layers (token_embd.weight -> model.embed_tokens.weight)."""
    base, suffix = name.rsplit(".", 1)
    return f"{(_GLOBALS if table is None else table)[base]}.{suffix}"


def gemma3_tensor(name: str, w: np.ndarray, cfg: dict[str, Any]) -> list[Out]:
    layer = _layer(name)
    if layer is None:
        hf = _global(name)
    else:
        hf = f"model.layers.{layer[0]}.{_GEMMA3_LAYER[layer[1]]}.{layer[2]}"
    if hf.endswith("norm.weight"):  # llama.cpp stores Gemma's 1 + w; HF (and our loader) hold w
        return [Out(hf, w - 1.0)]
    return [Out(hf, w, shipped=True)]


def gemma3_expected(cfg: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        names |= {f"model.layers.{i}.{hf}.weight" for hf in _GEMMA3_LAYER.values()}
    return names


# --- Gemma 4 (dense) -----------------------------------------------------------------------------------------------

_GEMMA4_LAYER = {
    **_GEMMA3_LAYER, "layer_output_scale": "layer_scalar", "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection", "post_norm": "post_per_layer_input_norm",
}
_GEMMA4_GLOBALS = {**_GLOBALS, "per_layer_token_embd": "model.embed_tokens_per_layer",
                   "per_layer_model_proj": "model.per_layer_model_projection",
                   "per_layer_proj_norm": "model.per_layer_projection_norm"}
_GEMMA4_STOPS = ("<turn|>", "<|tool_response>")  # ends of a turn beside eos, as transformers' GGUF reader adds them


def gemma4_config(meta: Meta, vocab: int) -> dict[str, Any]:
    if meta.shape("blk.0.ffn_gate_inp.weight") is not None:
        raise ValueError("Gemma 4's MoE block (ffn_gate_inp, 26B-A4B) is not supported yet")
    c = _common(meta, vocab)
    n, heads = c["num_hidden_layers"], c["num_attention_heads"]
    swa = meta.need("attention.sliding_window_pattern")
    types = ["sliding_attention" if w else "full_attention" for w in swa]
    global_dim, local_dim = int(meta.need("attention.key_length")), int(meta.need("attention.key_length_swa"))
    kv = meta.get("attention.head_count_kv", heads)
    kv = [int(k) for k in kv] if isinstance(kv, list) else [int(kv)] * n
    ff = meta.need("feed_forward_length")
    ff = [int(f) for f in ff] if isinstance(ff, list) else [int(ff)] * n
    local_kv = next((k for k, t in zip(kv, types) if t == "sliding_attention"), kv[0])
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    shared = int(meta.get("attention.shared_kv_layers", 0))
    own_kv = [i for i in full if i < n - shared]  # the shared layers read an earlier layer's KV: no k / v of their own
    # proportional RoPE on the global layers: rope_freqs holds 1 for each turning pair, 1e30 for the still ones
    freqs = meta.tensor("rope_freqs.weight")
    turning = int((np.asarray(freqs) < 1e29).sum()) if freqs is not None else global_dim // 2
    per_layer = int(meta.get("embedding_length_per_layer_input", 0))
    per_layer_vocab = meta.shape("per_layer_token_embd.weight")
    softcap = meta.get("final_logit_softcapping")
    tokens = meta.field("tokenizer.ggml.tokens") or []
    stops = [tokens.index(t) for t in _GEMMA4_STOPS if t in tokens]
    eos = meta.field("tokenizer.ggml.eos_token_id")
    if stops and eos is not None:
        eot = meta.field("tokenizer.ggml.eot_token_id")
        c["eos_token_id"] = list(dict.fromkeys(int(e) for e in (eos, eot, *stops) if e is not None))
    return dict(c, model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], head_dim=local_dim,
                num_key_value_heads=local_kv, intermediate_size=ff[0], use_double_wide_mlp=len(set(ff)) > 1,
                layer_types=types, sliding_window=int(meta.need("attention.sliding_window")),
                per_layer_config={str(i): {"head_dim": global_dim, "num_key_value_heads": kv[i]} for i in full},
                attention_k_eq_v=bool(own_kv) and all(meta.shape(f"blk.{i}.attn_v.weight") is None for i in own_kv),
                num_kv_shared_layers=shared,
                hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=(
                    per_layer_vocab[0] if per_layer_vocab else c["vocab_size"]),
                final_logit_softcapping=float(softcap) if softcap else None, hidden_activation="gelu_pytorch_tanh",
                rope_parameters={"full_attention": {"rope_type": "proportional",
                                                    "rope_theta": float(meta.get("rope.freq_base", 1_000_000.0)),
                                                    "partial_rotary_factor": 2 * turning / global_dim},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": float(
                                     meta.get("rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE))}})


def gemma4_tensor(name: str, w: np.ndarray, cfg: dict[str, Any]) -> list[Out]:
    layer = _layer(name)  # Gemma 4's norms are plain (w): stored as they are, unlike Gemma 3's
    if layer is None:
        return [Out(_global(name, _GEMMA4_GLOBALS), w, shipped=True)]
    i, kind, suffix = layer
    if kind == "layer_output_scale":  # HF's bare `layer_scalar` [1]
        return [Out(f"model.layers.{i}.layer_scalar", w.reshape(1))]
    return [Out(f"model.layers.{i}.{_GEMMA4_LAYER[kind]}.{suffix}", w, shipped=True)]


def gemma4_expected(cfg: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if cfg["hidden_size_per_layer_input"]:
        names |= {f"{n}.weight" for n in ("model.embed_tokens_per_layer", "model.per_layer_model_projection",
                                          "model.per_layer_projection_norm")}
    plain = ("self_attn.q_proj", "self_attn.o_proj", "self_attn.q_norm", "input_layernorm", "post_attention_layernorm",
             "pre_feedforward_layernorm", "post_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    first_shared = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        names |= {f"{p}{m}.weight" for m in plain} | {f"{p}layer_scalar"}
        if i < first_shared:  # shared layers read an earlier layer's KV: no k / v of their own
            names |= {f"{p}self_attn.k_proj.weight", f"{p}self_attn.k_norm.weight"}
            if not (cfg["attention_k_eq_v"] and kind == "full_attention"):
                names.add(f"{p}self_attn.v_proj.weight")
        if cfg["hidden_size_per_layer_input"]:
            names |= {f"{p}{m}.weight" for m in ("per_layer_input_gate", "per_layer_projection",
                                                 "post_per_layer_input_norm")}
    return names


# --- DeepSeek-V2 / V3 ---------------------------------------------------------------------------------------------

_DEEPSEEK_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj", "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_DEEPSEEK_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)


def deepseek2_config(meta: Meta, vocab: int) -> dict[str, Any]:
    c = _common(meta, vocab)
    rope_dims = int(meta.need("rope.dimension_count"))
    kv_lora = int(meta.need("attention.kv_lora_rank"))
    if meta.get("attention.key_length_mla") is not None:  # MLA as MQA: the heads' own widths here
        qk_dim, v_dim = int(meta.need("attention.key_length_mla")), int(meta.need("attention.value_length_mla"))
    else:  # older files: the heads' widths in key_length / value_length
        qk_dim, v_dim = int(meta.need("attention.key_length")), int(meta.need("attention.value_length"))
    q_lora = meta.get("attention.q_lora_rank")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    if meta.get("rope.scaling.type") == "yarn":
        mscale = 10.0 * float(meta.get("rope.scaling.yarn_log_multiplier", 0.0))  # llama.cpp's 0.1 x mscale_all_dim
        rope.update(rope_type="yarn", factor=float(meta.need("rope.scaling.factor")),
                    original_max_position_embeddings=int(meta.need("rope.scaling.original_context_length")),
                    beta_fast=32.0, beta_slow=1.0, mscale=mscale, mscale_all_dim=mscale)
    v3 = int(meta.get("expert_gating_func", 1)) == _SIGMOID_GATING
    experts = int(meta.get("expert_count", 0))
    groups = int(meta.get("expert_group_count", 1))
    fields = dict(c, q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dims,
                  qk_nope_head_dim=qk_dim - rope_dims, v_head_dim=v_dim, head_dim=rope_dims,
                  num_key_value_heads=c["num_attention_heads"], intermediate_size=int(meta.need("feed_forward_length")),
                  rope_parameters=rope, first_k_dense_replace=int(meta.get("leading_dense_block_count", 0)),
                  n_routed_experts=experts or None, num_experts_per_tok=int(meta.get("expert_used_count", 0)) or None,
                  moe_intermediate_size=int(meta.get("expert_feed_forward_length", 0)) or None,
                  n_shared_experts=int(meta.get("expert_shared_count", 0)) or None,
                  routed_scaling_factor=float(meta.get("expert_weights_scale", 1.0)),
                  norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
                  n_group=groups, topk_group=int(meta.get("expert_group_used_count", 1)))
    if v3:  # sigmoid scores, the correction bias, grouped top-k
        return dict(fields, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], rope_interleave=True)
    return dict(fields, model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"],
                topk_method="group_limited_greedy" if groups > 1 else "greedy")


def deepseek2_tensor(name: str, w: np.ndarray, cfg: dict[str, Any]) -> list[Out]:
    layer = _layer(name)
    if layer is None:
        return [Out(_global(name), w, shipped=True)]
    i, kind, suffix = layer
    p = f"model.layers.{i}."
    if kind in _DEEPSEEK_EXPERTS:  # [E, out, in]: one HF matrix an expert
        return [Out(f"{p}mlp.experts.{e}.{_DEEPSEEK_EXPERTS[kind]}.{suffix}", np.ascontiguousarray(w[e]), expert=e)
                for e in range(w.shape[0])]
    if kind == "attn_k_b":  # [head, kv_lora, nope] -> kv_b_proj's k rows [head, nope, kv_lora]; joined with attn_v_b
        return [Out(f"{p}self_attn.k_b", np.ascontiguousarray(w.transpose(0, 2, 1)))]
    if kind == "attn_v_b":
        return [Out(f"{p}self_attn.v_b", np.ascontiguousarray(w))]
    if kind == "exp_probs_b":
        return [Out(f"{p}mlp.gate.e_score_correction_bias", w)]
    return [Out(f"{p}{_DEEPSEEK_LAYER[kind]}.{suffix}", w, shipped=True)]


def deepseek2_join(tensors: dict[str, np.ndarray], cfg: dict[str, Any]) -> None:
    """Each layer's kv_b_proj from a split file's k and v halves: per head its nope k rows, then its v rows."""
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if p + "k_b" in tensors:
            k, v = tensors.pop(p + "k_b"), tensors.pop(p + "v_b")
            tensors[p + "kv_b_proj.weight"] = np.concatenate([k, v], axis=1).reshape(-1, k.shape[-1])


def deepseek2_expected(cfg: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    attn += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if cfg["q_lora_rank"] else ["q_proj"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {f"{p}self_attn.{a}.weight" for a in attn} | {f"{p}input_layernorm.weight",
                                                                f"{p}post_attention_layernorm.weight"}
        if not cfg["n_routed_experts"] or i < cfg["first_k_dense_replace"]:
            names |= {f"{p}mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
            continue
        names |= {f"{p}mlp.gate.weight"} | {f"{p}mlp.experts.{e}.{m}.weight" for e in range(cfg["n_routed_experts"])
                                            for m in _DEEPSEEK_EXPERTS.values()}
        if cfg["n_shared_experts"]:
            names |= {f"{p}mlp.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
        if cfg["architectures"] == ["DeepseekV3ForCausalLM"]:
            names.add(f"{p}mlp.gate.e_score_correction_bias")
    return names


# --- gpt-oss ------------------------------------------------------------------------------------------------------

_GPT_OSS_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router",
}
GPT_OSS_SWA_PATTERN = 2  # llama.cpp's: even layers windowed, odd ones full
GPT_OSS_SWIGLU_LIMIT = 7.0  # llama.cpp's clamp for gpt-oss (not in the file)


def gpt_oss_config(meta: Meta, vocab: int) -> dict[str, Any]:
    c = _common(meta, vocab)
    n = c["num_hidden_layers"]
    types = _layer_types(meta, n, GPT_OSS_SWA_PATTERN)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 150000.0))}
    if meta.get("rope.scaling.type") == "yarn":
        rope.update(rope_type="yarn", factor=float(meta.need("rope.scaling.factor")), beta_fast=32.0, beta_slow=1.0,
                    original_max_position_embeddings=int(meta.need("rope.scaling.original_context_length")),
                    truncate=False)
    return dict(c, model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                intermediate_size=int(meta.need("expert_feed_forward_length")),
                num_local_experts=int(meta.need("expert_count")),
                num_experts_per_tok=int(meta.need("expert_used_count")),
                num_key_value_heads=int(meta.need("attention.head_count_kv")),
                head_dim=int(meta.need("attention.key_length")),
                sliding_window=int(meta.need("attention.sliding_window")),
                layer_types=types, rope_parameters=rope, attention_bias=True, swiglu_limit=GPT_OSS_SWIGLU_LIMIT)


def gpt_oss_tensor(name: str, w: np.ndarray, cfg: dict[str, Any]) -> list[Out]:
    layer = _layer(name)
    if layer is None:
        return [Out(_global(name), w, shipped=True)]
    i, kind, suffix = layer
    p = f"model.layers.{i}."
    if kind == "attn_sinks":
        return [Out(f"{p}self_attn.sinks", w)]
    if kind in ("ffn_gate_exps", "ffn_up_exps"):  # [E, I, H] (bias [E, I]): joined into gate_up_proj's columns
        return [Out(f"{p}mlp.experts.{kind}.{suffix}", w)]
    if kind == "ffn_down_exps":  # [E, H, I] -> HF's [E, I, H]; its bias [E, H] as is
        return [Out(f"{p}mlp.experts.down_proj" + ("" if suffix == "weight" else "_bias"),
                    np.ascontiguousarray(w.transpose(0, 2, 1)) if suffix == "weight" else w)]
    return [Out(f"{p}{_GPT_OSS_LAYER[kind]}.{suffix}", w, shipped=True)]


def gpt_oss_join(tensors: dict[str, np.ndarray], cfg: dict[str, Any]) -> None:
    """Each layer's gate_up_proj [E, H, 2I] (and its bias [E, 2I]) from ffn_gate_exps / ffn_up_exps: HF interleaves
    them, gate in the even columns, up in the odd ones."""
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        for suffix, hf in (("weight", "gate_up_proj"), ("bias", "gate_up_proj_bias")):
            if p + f"ffn_gate_exps.{suffix}" not in tensors:
                continue
            gate, up = tensors.pop(p + f"ffn_gate_exps.{suffix}"), tensors.pop(p + f"ffn_up_exps.{suffix}")
            if suffix == "weight":  # [E, I, H] -> [E, H, I]
                gate, up = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
            tensors[p + hf] = np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def gpt_oss_expected(cfg: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {f"{p}{hf}.{s}" for hf in _GPT_OSS_LAYER.values() for s in ("weight", "bias") if "norm" not in hf}
        names |= {f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight", f"{p}self_attn.sinks"}
        names |= {f"{p}mlp.experts.{n}" for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    return names


# --- Qwen3-Next / Qwen3.5 (dense and MoE) -------------------------------------------------------------------------

_HYBRID_LAYER = {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z", "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b", "ssm_a": "linear_attn.A_log",
    "ssm_dt": "linear_attn.dt_bias", "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_HYBRID_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_HYBRID_CLASSES = {"qwen3next": ("qwen3_next", "Qwen3NextForCausalLM"),
                   "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
                   "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}


def hybrid_config(meta: Meta, vocab: int) -> dict[str, Any]:
    c = _common(meta, vocab)
    head_dim = int(meta.need("attention.key_length"))
    interval = int(meta.get("full_attention_interval", 4))
    nv = int(meta.need("ssm.time_step_rank"))
    experts = int(meta.get("expert_count", 0))
    model_type, arch = _HYBRID_CLASSES[meta.arch]
    fields = dict(c, model_type=model_type, architectures=[arch], head_dim=head_dim,
                  num_key_value_heads=int(meta.need("attention.head_count_kv")),
                  layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(c["num_hidden_layers"])],
                  linear_conv_kernel_dim=int(meta.need("ssm.conv_kernel")),
                  linear_key_head_dim=int(meta.need("ssm.state_size")),
                  linear_num_key_heads=int(meta.need("ssm.group_count")), linear_num_value_heads=nv,
                  linear_value_head_dim=int(meta.need("ssm.inner_size")) // nv,
                  rope_parameters={"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
                                   "partial_rotary_factor": int(meta.need("rope.dimension_count")) / head_dim})
    if not experts:
        return dict(fields, intermediate_size=int(meta.need("feed_forward_length")))
    width = int(meta.need("expert_feed_forward_length"))
    moe: dict[str, Any] = dict(
        num_experts=experts, num_experts_per_tok=int(meta.need("expert_used_count")), moe_intermediate_size=width,
        intermediate_size=int(meta.get("feed_forward_length", width)),
        shared_expert_intermediate_size=int(meta.get("expert_shared_feed_forward_length", 0)))
    if meta.arch == "qwen3next":  # llama.cpp renormalizes Qwen3-Next's top k unless the file says otherwise
        moe.update(norm_topk_prob=bool(meta.get("expert_weights_norm", True)), decoder_sparse_step=1,
                   mlp_only_layers=[])
    return dict(fields, **moe)


def _grouped(w: np.ndarray, axis: int, cfg: dict[str, Any], head: int) -> np.ndarray:
    """Qwen3.5's value heads back from llama.cpp's tiled order (each key head's r-th value head together: [r, k]) to
    HF's grouped one ([k, r]) along `axis`, heads `head` wide; as they are where every key head has one value head."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if nk == nv or cfg["model_type"] == "qwen3_next":
        return w
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(nv // nk, nk, head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def hybrid_tensor(name: str, w: np.ndarray, cfg: dict[str, Any]) -> list[Out]:
    layer = _layer(name)
    if layer is None:
        hf = _global(name)
        return [Out(hf, w - 1.0) if hf.endswith("norm.weight") else Out(hf, w, shipped=True)]
    i, kind, suffix = layer
    p = f"model.layers.{i}."
    if kind in _HYBRID_EXPERTS:  # [E, out, in]: one HF matrix an expert
        return [Out(f"{p}mlp.experts.{e}.{_HYBRID_EXPERTS[kind]}.{suffix}", np.ascontiguousarray(w[e]), expert=e)
                for e in range(w.shape[0])]
    if kind == "ffn_gate_up_exps":  # fused [E, 2I, H]: gate's rows, then up's
        half = w.shape[1] // 2
        return [Out(f"{p}mlp.experts.{e}.{m}.{suffix}", np.ascontiguousarray(w[e, rows])) for e in range(w.shape[0])
                for m, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, None)))]
    hf = f"{p}{_HYBRID_LAYER[kind]}"
    vd, kd, nk = cfg["linear_value_head_dim"], cfg["linear_key_head_dim"], cfg["linear_num_key_heads"]
    if kind == "ssm_a":  # llama.cpp stores A = -exp(A_log)
        return [Out(hf, _grouped(np.log(-w), 0, cfg, 1))]
    if kind == "ssm_dt":  # dt_bias, stored as dt_proj's bias
        return [Out(hf, _grouped(w, 0, cfg, 1))]
    if kind == "ssm_conv1d":  # squeezed [channels, kernel]; HF's [channels, 1, kernel], the value channels grouped
        qk = 2 * kd * nk
        return [Out(f"{hf}.{suffix}", np.concatenate([w[:qk], _grouped(w[qk:], 0, cfg, vd)])[:, None, :])]
    if kind == "attn_qkv":
        qk = 2 * kd * nk
        fixed = np.concatenate([w[:qk], _grouped(w[qk:], 0, cfg, vd)])
        if cfg["model_type"] == "qwen3_next":  # joined with attn_gate back into in_proj_qkvz
            return [Out(f"{p}linear_attn.qkv", fixed)]
        return [Out(f"{hf}.{suffix}", fixed, shipped=nk == cfg["linear_num_value_heads"])]
    if kind == "attn_gate":
        if cfg["model_type"] == "qwen3_next":
            return [Out(f"{p}linear_attn.z", w)]
        return [Out(f"{hf}.{suffix}", _grouped(w, 0, cfg, vd))]
    if kind in ("ssm_alpha", "ssm_beta"):
        return [Out(f"{hf}.{suffix}", _grouped(w, 0, cfg, 1))]
    if kind == "ssm_out":
        return [Out(f"{hf}.{suffix}", _grouped(w, 1, cfg, vd))]
    if kind == "ffn_gate_inp_shexp":  # HF's [1, hidden]
        return [Out(f"{hf}.{suffix}", w.reshape(1, -1), shipped=True)]
    if hf.endswith("norm") and kind != "ssm_norm":  # llama.cpp stores the (1 + w) norms' 1 + w; the gated one as is
        return [Out(f"{hf}.{suffix}", w - 1.0)]
    return [Out(f"{hf}.{suffix}", w, shipped=True)]


def hybrid_join(tensors: dict[str, np.ndarray], cfg: dict[str, Any]) -> None:
    """Qwen3-Next's in_proj_qkvz from attn_qkv (q, k, v of every head) and attn_gate (z): per key head its q, k, then
    its value heads' v and z rows."""
    nk = cfg["linear_num_key_heads"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.linear_attn."
        if p + "qkv" not in tensors:
            continue
        qkv, z = tensors.pop(p + "qkv"), tensors.pop(p + "z")
        qk = cfg["linear_key_head_dim"] * nk
        q, k, v = qkv[:qk], qkv[qk:2 * qk], qkv[2 * qk:]
        parts = [t.reshape(nk, -1, t.shape[-1]) for t in (q, k, v, z)]
        tensors[p + "in_proj_qkvz.weight"] = np.concatenate(parts, axis=1).reshape(-1, qkv.shape[-1])


def hybrid_expected(cfg: dict[str, Any]) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    next_ = cfg["model_type"] == "qwen3_next"
    linear = ["in_proj_qkvz", "in_proj_ba"] if next_ else ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        names |= {f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"}
        if kind == "full_attention":
            names |= {f"{p}self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        else:
            names |= {f"{p}linear_attn.{m}.weight" for m in (*linear, "conv1d", "norm", "out_proj")}
            names |= {f"{p}linear_attn.A_log", f"{p}linear_attn.dt_bias"}
        if cfg.get("num_experts"):
            names |= {f"{p}mlp.gate.weight"} | {f"{p}mlp.experts.{e}.{m}.weight" for e in range(cfg["num_experts"])
                                                for m in _HYBRID_EXPERTS.values()}
            if cfg.get("shared_expert_intermediate_size"):
                names |= {f"{p}mlp.shared_expert.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
                names.add(f"{p}mlp.shared_expert_gate.weight")
        else:
            names |= {f"{p}mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
    return names


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture reads back: its HF config fields, each tensor's HF tensors, the HF tensors made of
    several GGUF ones (joined once all are read), and the names a complete file gives."""

    config: Callable[[Meta, int], dict[str, Any]]
    tensor: Callable[[str, np.ndarray, dict[str, Any]], list[Out]]
    expected: Callable[[dict[str, Any]], set[str]]
    join: Callable[[dict[str, np.ndarray], dict[str, Any]], None] = lambda tensors, cfg: None


FAMILIES = {
    "gemma3": Family(gemma3_config, gemma3_tensor, gemma3_expected),
    "gemma4": Family(gemma4_config, gemma4_tensor, gemma4_expected),
    "deepseek2": Family(deepseek2_config, deepseek2_tensor, deepseek2_expected, deepseek2_join),
    "gpt-oss": Family(gpt_oss_config, gpt_oss_tensor, gpt_oss_expected, gpt_oss_join),
    **{arch: Family(hybrid_config, hybrid_tensor, hybrid_expected, hybrid_join) for arch in _HYBRID_CLASSES},
}
