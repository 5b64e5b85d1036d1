"""GGUFs of the newer families as llama.cpp's converter writes them (Gemma 3; DeepSeek-V3 and V2 with MLA, kv_b split
into k_b / v_b or whole): converted back to the HF checkpoint they came from, tensor for tensor, and run greedy equal
to transformers fp32 token for token; a Q8_0 file to its own blocks; the Gemma norms' +1 left in makes the answers
differ (the test can tell); an architecture still unconverted is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_tiny_checkpoint
from test_hf_parity import hf_greedy, ours_greedy
from test_loader_gguf import TINY_VOCAB, finish_gguf, gguf_writer

from minisgl_cli.loader import ModelLoadError
from minisgl_cli.loader.gguf import convert_gguf

gguf = pytest.importorskip("gguf")
N_NEW = 12


def _prompts() -> list[list[int]]:
    """A short prompt and two past the Gemma window (8) and DeepSeek's YaRN original context (16)."""
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 14, 27)]


ARCHS = {"gemma3": gguf.MODEL_ARCH.GEMMA3, "gemma4": gguf.MODEL_ARCH.GEMMA4, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
         "gpt-oss": gguf.MODEL_ARCH.GPT_OSS,
         "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen35": gguf.MODEL_ARCH.QWEN35,
         "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE}


def _tiled(w: np.ndarray, axis: int, cfg: dict, head: int) -> np.ndarray:
    """_LinearAttentionVReorderBase's reorder: Qwen3.5's value heads from HF's grouped order ([key head, r]) to
    ggml's tiled one ([r, key head]) along `axis`, heads `head` wide."""
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    w = np.moveaxis(w, axis, 0)
    rest = w.shape[1:]
    w = w.reshape(nk, nv // nk, head, *rest).swapaxes(0, 1).reshape(-1, *rest)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def write_llamacpp_gguf(hf_dir: Path, path: Path, arch: str, quant: str = "F32",
                        split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """The tiny HF checkpoint at `hf_dir` as llama.cpp's convert_hf_to_gguf.py lays it out for `arch` ("gemma3",
    "deepseek2"): its metadata keys, the gguf package's tensor names (TensorNameMap, as the converter maps them), and
    the converter's transforms: Gemma's norms stored as 1 + w; DeepSeek's routed experts stacked [E, out, in], kv_b
    split into k_b (transposed) and v_b where `split_kv_b`. Matrices whose rows are whole 32-blocks as `quant` (F32 or
    Q8_0), the rest F32, as the converter falls back. Returns each HF tensor as the file gives it back."""
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    n = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(ARCHS[arch], n)
    w = gguf_writer(path, arch, None, cfg)  # the tiny byte-level tokenizer: the models' vocab is its
    w.add_vocab_size(cfg["vocab_size"])
    rope = cfg["rope_parameters"]
    given: dict[str, np.ndarray] = {}
    qtype = getattr(gguf.GGMLQuantizationType, quant)

    def add(gguf_name: str, value: np.ndarray, hf: list[str], quantized: bool = True) -> np.ndarray:
        """Write `value` (as `quant` where its rows allow) and record what it gives back under the HF names `hf`."""
        if quantized and qtype != gguf.GGMLQuantizationType.F32 and value.ndim >= 2 and value.shape[-1] % 32 == 0:
            blocks = quantize(value, qtype)
            w.add_tensor(gguf_name, blocks, raw_dtype=qtype)
            value = dequantize(blocks, qtype).reshape(value.shape)
        else:
            w.add_tensor(gguf_name, value)
        for i, name in enumerate(hf):
            given[name] = value[i] if len(hf) > 1 else value
        return value

    if arch == "gemma3":
        w.add_eot_token_id(0)  # Gemma's <end_of_turn>: an end of generation beside eos
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        for name, value in sd.items():
            base = name.removesuffix(".weight")
            if name.endswith("norm.weight"):  # Gemma3Model.modify_tensors: the norm's 1 + w
                w.add_tensor(names.get_name(base) + ".weight", value + 1)
                given[name] = value
            else:
                add(names.get_name(base) + ".weight", value, [name])
        finish_gguf(w)
        return given

    if arch == "gemma4":  # Gemma4Model: Gemma3Model's keys, per-layer ones, plain norms, rope_freqs for the global RoPE
        types = cfg["layer_types"]
        full = cfg["rope_parameters"]["full_attention"]
        wide = {int(i): o for i, o in (cfg.get("per_layer_config") or {}).items()}
        global_dim = next(iter(wide.values()))["head_dim"]
        kv = [wide.get(i, {}).get("num_key_value_heads", cfg["num_key_value_heads"]) for i in range(n)]
        first_shared = n - cfg["num_kv_shared_layers"]
        w.add_head_count_kv(kv)
        w.add_key_length(global_dim)
        w.add_value_length(global_dim)
        w.add_key_length_swa(cfg["head_dim"])
        w.add_value_length_swa(cfg["head_dim"])
        w.add_rope_freq_base(full["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_dimension_count(global_dim)
        w.add_rope_dimension_count_swa(cfg["head_dim"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in types])
        w.add_shared_kv_layers(cfg["num_kv_shared_layers"])
        w.add_embedding_length_per_layer_input(cfg["hidden_size_per_layer_input"])
        if cfg.get("use_double_wide_mlp"):  # the shared layers' MLPs twice as wide
            w.add_feed_forward_length([cfg["intermediate_size"] * (2 if i >= first_shared else 1) for i in range(n)])
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        turning = int(global_dim * full["partial_rotary_factor"] / 2)
        w.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (global_dim // 2 - turning),
                                                   dtype=np.float32))
        for name, value in sd.items():
            base, suffix = (name, "weight") if name.endswith("layer_scalar") else name.rsplit(".", 1)
            add(names.get_name(base) + "." + suffix, value, [name], quantized=value.ndim == 2)
        finish_gguf(w)
        return given

    if arch == "gpt-oss":  # GptOssModel: the experts (alone) as `quant`, MXFP4 in llama.cpp's files
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_expert_feed_forward_length(cfg["intermediate_size"])
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        for name, value in sd.items():
            base = name.rpartition(".mlp.experts.")[0] + ".mlp.experts."
            if name.endswith("experts.gate_up_proj"):  # [E, H, 2I], gate and up alternating -> two [E, I, H]
                t = value.transpose(0, 2, 1)
                gate = add(names.get_name(base + "gate_proj") + ".weight", np.ascontiguousarray(t[:, ::2]), [])
                up = add(names.get_name(base + "up_proj") + ".weight", np.ascontiguousarray(t[:, 1::2]), [])
                given[name] = np.stack([gate, up], axis=2).reshape(t.shape).transpose(0, 2, 1)
            elif name.endswith("experts.gate_up_proj_bias"):
                add(names.get_name(base + "gate_proj") + ".bias", np.ascontiguousarray(value[..., ::2]), [], False)
                add(names.get_name(base + "up_proj") + ".bias", np.ascontiguousarray(value[..., 1::2]), [], False)
                given[name] = value
            elif name.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
                down = np.ascontiguousarray(value.transpose(0, 2, 1))
                given[name] = add(names.get_name(base + "down_proj") + ".weight", down, []).transpose(0, 2, 1)
            elif name.endswith("experts.down_proj_bias"):
                add(names.get_name(base + "down_proj") + ".bias", value, [name], False)
            else:
                base, _, suffix = name.rpartition(".")
                if suffix == "sinks":
                    base, suffix = name, "weight"
                add(names.get_name(base) + "." + suffix, value, [name], quantized=False)
        finish_gguf(w)
        return given

    if arch in ("qwen3next", "qwen35", "qwen35moe"):  # Qwen3NextModel, and Qwen3.5's value-head reorder after it
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_dimension_count(int(cfg["head_dim"] * rope["partial_rotary_factor"]))
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_full_attention_interval(cfg["layer_types"].index("full_attention") + 1)
        n_exp = cfg.get("num_experts") or 0
        if n_exp:
            w.add_expert_count(n_exp)
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        nk, kd, vd = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        reorder = arch != "qwen3next"

        def tiled(value: np.ndarray, axis: int, head: int) -> np.ndarray:
            return _tiled(value, axis, cfg, head) if reorder else value

        for name, value in sd.items():
            base, _, suffix = name.rpartition(".")
            stored, gguf_name = value, None
            if ".experts." in name and ".shared_expert." not in name:
                if ".experts.0." not in name:
                    continue  # stacked with expert 0
                stacked = [name.replace(".experts.0.", f".experts.{e}.") for e in range(n_exp)]
                merged = name.replace(".experts.0.", ".experts.").removesuffix(".weight")
                add(names.get_name(merged) + ".weight", np.stack([sd[n] for n in stacked]), stacked)
                continue
            if name.endswith("A_log"):  # stored as A = -exp(A_log), bare-named
                stored, gguf_name = -np.exp(tiled(value, 0, 1)), names.get_name(name)
            elif name.endswith("dt_bias"):
                stored, gguf_name = tiled(value, 0, 1), names.get_name(base + ".dt_proj") + ".bias"
            elif "conv1d" in name:  # squeezed; its value channels reordered
                sq = value[:, 0, :]
                stored = np.concatenate([sq[:2 * kd * nk], tiled(sq[2 * kd * nk:], 0, vd)])
            elif "in_proj_qkvz" in name:  # [q, k, v, z] per key head -> attn_qkv (q, k, v of all heads), attn_gate
                g = value.reshape(nk, -1, value.shape[-1])
                r_vd = (g.shape[1] - 2 * kd) // 2
                q, k, v, z = np.split(g, [kd, 2 * kd, 2 * kd + r_vd], axis=1)
                qkv = np.concatenate([t.reshape(-1, value.shape[-1]) for t in (q, k, v)])
                layer = base.removesuffix(".in_proj_qkvz")
                add(names.get_name(layer + ".in_proj_qkv") + ".weight", qkv, [name + ".qkv"])
                add(names.get_name(layer + ".in_proj_z") + ".weight", z.reshape(-1, value.shape[-1]), [name + ".z"])
                qkv, z = given.pop(name + ".qkv"), given.pop(name + ".z")
                parts = [t.reshape(nk, -1, t.shape[-1]) for t in (qkv[:kd * nk], qkv[kd * nk:2 * kd * nk],
                                                                   qkv[2 * kd * nk:], z)]
                given[name] = np.concatenate(parts, axis=1).reshape(value.shape)
                continue
            elif "in_proj_qkv" in name:
                stored = np.concatenate([value[:2 * kd * nk], tiled(value[2 * kd * nk:], 0, vd)])
            elif "in_proj_z" in name:
                stored = tiled(value, 0, vd)
            elif "in_proj_a" in name or "in_proj_b." in name:
                stored = tiled(value, 0, 1)
            elif "out_proj" in name:
                stored = tiled(value, 1, vd)
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                stored = value + 1  # Qwen3-Next's (1 + w) norms
            if stored is not value or value.ndim < 2:  # transformed (or a vector): F32, as given back exactly
                w.add_tensor(gguf_name or names.get_name(base) + "." + suffix, np.ascontiguousarray(stored))
                given[name] = value
            else:
                add(gguf_name or names.get_name(base) + "." + suffix, value, [name])
        finish_gguf(w)
        return given

    # deepseek2 (DeepseekV2Model.set_gguf_parameters): MLA as MQA with kv_lora_rank + rope dims per "head"
    kv_lora, nope, rope_dims, v_dim = (cfg[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                        "v_head_dim"))
    w.add_head_count_kv(1)
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope_dims)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope_dims)
    w.add_value_length_mla(v_dim)
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    v3 = cfg["model_type"] == "deepseek_v3"
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else gguf.ExpertGatingFuncType.SOFTMAX)
    heads, n_exp = cfg["num_attention_heads"], cfg["n_routed_experts"]
    for name, value in sd.items():
        if ".experts." in name and ".shared_experts." not in name:
            if ".experts.0." not in name:
                continue  # stacked with expert 0
            stacked = [name.replace(".experts.0.", f".experts.{e}.") for e in range(n_exp)]
            merged = name.replace(".experts.0.", ".experts.").removesuffix(".weight")
            add(names.get_name(merged) + ".weight", np.stack([sd[s] for s in stacked]), stacked)
        elif name.endswith("kv_b_proj.weight") and split_kv_b:  # per head: nope k rows, then v rows
            kv_b = value.reshape(heads, nope + v_dim, kv_lora)
            k_b, v_b = np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(kv_b[:, nope:])
            base = name.removesuffix(".kv_b_proj.weight")
            add(names.get_name(base + ".k_b_proj") + ".weight", k_b, [name + ".k"])
            add(names.get_name(base + ".v_b_proj") + ".weight", v_b, [name + ".v"])
            given[name] = np.concatenate([given.pop(name + ".k").transpose(0, 2, 1), given.pop(name + ".v")],
                                         axis=1).reshape(value.shape)
        elif name.endswith("e_score_correction_bias"):
            add(names.get_name(name.removesuffix("_bias")) + ".bias", value, [name])
        else:
            add(names.get_name(name.removesuffix(".weight")) + ".weight", value, [name])
    finish_gguf(w)
    return given


def _gemma3(root: Path, tokenizer_dir: Path) -> Path:
    """Six layers (five local with window 8 and RoPE base 10k, one global at 1M), a final soft cap; the score scale
    llama.cpp runs for every Gemma 3 but the 27B: head_dim's."""
    return make_tiny_checkpoint("gemma3", root, tokenizer_dir, sliding_window=8, num_hidden_layers=6,
                                query_pre_attn_scalar=16, final_logit_softcapping=30.0, vocab_size=TINY_VOCAB)


def _gemma4(root: Path, tokenizer_dir: Path) -> Path:
    """test_sliding_window's Gemma 4: local layers (window 8, 2 KV heads of 16) and global ones (1 KV head of 32,
    K = V, proportional RoPE turning a quarter of the pairs), the last two layers reading earlier layers' KV (their
    MLPs twice as wide), per-layer inputs of width 8, a final soft cap."""
    from test_sliding_window import GEMMA4

    return make_tiny_checkpoint("gemma4", root, tokenizer_dir, **{**GEMMA4, "vocab_size": TINY_VOCAB,
                                                                  "vocab_size_per_layer_input": TINY_VOCAB})


def _gpt_oss(root: Path, tokenizer_dir: Path) -> Path:
    """Four layers (windowed, full, windowed, full; window 8), 4 experts of width 32 taking 2 a token, YaRN over a
    short original context; the SwiGLU clamp llama.cpp runs (7); embeddings ten times the tiny default, else its
    biases drown the prompt out at this vocab."""
    from safetensors.torch import load_file, save_file

    out = make_tiny_checkpoint("gpt_oss", root, tokenizer_dir, seed=1, sliding_window=8, num_hidden_layers=4,
                               num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, swiglu_limit=7.0,
                               vocab_size=TINY_VOCAB, rope_parameters={
                                   "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
    sd = load_file(out / "model.safetensors")
    sd["model.embed_tokens.weight"] *= 10
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _hybrid(family: str, root: Path, tokenizer_dir: Path) -> Path:
    """Three Gated DeltaNet layers (2 key heads, 4 value heads: Qwen3.5's value heads reordered in the file) and one
    gated full-attention layer."""
    from test_hybrid import make_hybrid

    return make_hybrid(family, root, tokenizer_dir, vocab_size=TINY_VOCAB)


def _deepseek(family: str, root: Path, tokenizer_dir: Path) -> Path:
    from test_deepseek import make_tiny_deepseek

    return make_tiny_deepseek(family, root, tokenizer_dir, vocab_size=TINY_VOCAB)


# gemma3; DeepSeek-V3 (q_lora, sigmoid grouped routing, YaRN) with kv_b split as newer converters write it; V2-Lite's
# shape (plain q_proj, softmax group-limited routing) with kv_b whole as older ones did
CASES = {"gemma3": ("gemma3", {}), "gemma4": ("gemma4", {}), "deepseek_v3": ("deepseek2", {}),
         "deepseek_v2": ("deepseek2", {"split_kv_b": False}), "gpt_oss": ("gpt-oss", {}),
         "qwen3_next": ("qwen3next", {}), "qwen3_5": ("qwen35", {}), "qwen3_5_moe": ("qwen35moe", {})}


def _source(case: str, root: Path, tokenizer_dir: Path) -> Path:
    if case.startswith("deepseek"):
        return _deepseek(case.split("_")[1], root, tokenizer_dir)
    if case.startswith("qwen"):
        return _hybrid(case, root, tokenizer_dir)
    return {"gemma3": _gemma3, "gemma4": _gemma4, "gpt_oss": _gpt_oss}[case](root, tokenizer_dir)


@pytest.mark.parametrize("case", list(CASES))
def test_a_llamacpp_gguf_converts_back_to_its_checkpoint_and_answers_as_transformers(
        tmp_path: Path, tokenizer_dir: Path, case: str) -> None:
    from safetensors.torch import load_file

    arch, kw = CASES[case]
    hf_dir = _source(case, tmp_path / "hf", tokenizer_dir)
    write_llamacpp_gguf(hf_dir, tmp_path / "tiny.gguf", arch, **kw)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")

    src, ours = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert ours.keys() == src.keys()
    if case == "gemma3":  # the file's end of turn ends a generation too
        for file in ("config.json", "generation_config.json"):
            assert json.loads((out / file).read_text())["eos_token_id"] == [2, 0], file
    for name, value in src.items():  # the norms' 1 + w - 1 and A_log's log(exp) within fp32 rounding, the rest exact
        torch.testing.assert_close(ours[name], value.float(), rtol=0, atol=1e-6 if "norm" in name or "A_log" in name
                                   else 0)
    prompts = _prompts()
    theirs = hf_greedy(hf_dir, prompts, N_NEW)
    assert len({tuple(t) for t in theirs}) > 1, "degenerate tiny model: outputs do not depend on the prompt"
    assert ours_greedy(out, prompts, N_NEW, max_total_tokens=256) == theirs


@pytest.mark.parametrize("case,quant", [("gemma3", "Q8_0"), ("gemma4", "Q8_0"), ("deepseek_v3", "Q8_0"),
                                        ("gpt_oss", "MXFP4"), ("qwen3_5_moe", "Q8_0")])
def test_a_quantized_gguf_converts_to_its_blocks(tmp_path: Path, tokenizer_dir: Path, case: str, quant: str) -> None:
    """A Q8_0 file: its weights are its blocks dequantized (to the fp32 modes), and the int8 mode's copies are its
    blocks as shipped, each expert's its own (the directory then runs as any HF checkpoint does); gpt-oss's MXFP4
    experts (as llama.cpp ships them) dequantized by the gguf package."""
    from safetensors.torch import load_file

    from minisgl_cli.loader.blocks import BLOCKS_FILE, Int8Groups, iter_blocks

    arch, kw = CASES[case]
    hf_dir = _source(case, tmp_path / "hf", tokenizer_dir)
    given = write_llamacpp_gguf(hf_dir, tmp_path / "tiny.gguf", arch, quant=quant, **kw)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    ours, src = load_file(out / "model.safetensors"), load_file(hf_dir / "model.safetensors")
    assert ours.keys() == src.keys() == given.keys()
    quantized = [n for n in given if not np.array_equal(given[n], src[n].float().numpy())]
    assert quantized, "nothing was quantized"
    for name, value in given.items():  # A_log through log(-(-exp)): numpy's SIMD exp / log differ by an ulp by CPU
        torch.testing.assert_close(ours[name], torch.from_numpy(value).float(), rtol=0,
                                   atol=1e-6 if "norm" in name or "A_log" in name else 0)
    blocks = dict(iter_blocks(out / BLOCKS_FILE))
    for name in quantized if quant == "Q8_0" else ():
        if name.endswith("kv_b_proj.weight"):  # joined from k_b and v_b: held as their blocks dequantized
            continue
        kept = blocks[name]
        assert isinstance(kept, Int8Groups), name
        dequant = kept.q.float().reshape(*kept.scale.shape, -1) * kept.scale.float()[..., None]
        assert torch.equal(dequant.reshape(ours[name].shape), ours[name]), name


def test_gemma3_norms_read_as_stored_change_the_answers(
        tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: without the -1 on llama.cpp's stored 1 + w the parity test above fails."""
    from minisgl_cli.loader import gguf_families

    hf_dir = _gemma3(tmp_path / "hf", tokenizer_dir)
    write_llamacpp_gguf(hf_dir, tmp_path / "tiny.gguf", "gemma3")
    import minisgl_cli.loader.gguf as gguf_mod

    def as_stored(name: str, w: np.ndarray, cfg: dict) -> list[gguf_families.Out]:
        return [gguf_families.Out(o.name, o.value + 1.0 if o.name.endswith("norm.weight") else o.value)
                for o in gguf_families.gemma3_tensor(name, w, cfg)]

    family = gguf_families.Family(gguf_families.gemma3_config, as_stored, gguf_families.gemma3_expected)
    monkeypatch.setattr(gguf_mod, "FAMILIES", {**gguf_families.FAMILIES, "gemma3": family})
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    prompts = _prompts()
    assert ours_greedy(out, prompts, N_NEW, max_total_tokens=256) != hf_greedy(hf_dir, prompts, N_NEW)


def test_qwen3_5_value_heads_left_in_llamacpp_order_change_the_answers(
        tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of the value-head reorder: Qwen3.5's linear layers read in ggml's tiled head order (2 key
    heads, 4 value heads) answer otherwise."""
    from minisgl_cli.loader import gguf_families

    hf_dir = _hybrid("qwen3_5", tmp_path / "hf", tokenizer_dir)
    write_llamacpp_gguf(hf_dir, tmp_path / "tiny.gguf", "qwen35")
    monkeypatch.setattr(gguf_families, "_grouped", lambda w, axis, cfg, head: w)
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    prompts = _prompts()
    assert ours_greedy(out, prompts, N_NEW, max_total_tokens=256) != hf_greedy(hf_dir, prompts, N_NEW)


def test_an_unconverted_architecture_is_refused_in_one_line(tmp_path: Path) -> None:
    """A GGUF of an architecture we do not convert (gemma3n here: Gemma 3n) fails `minisgl chat` and `minisgl serve`
    with one line naming it and the ones converted, and no traceback; so does a variant not converted (Gemma 4's
    MoE)."""
    path = tmp_path / "tiny-gemma3n.gguf"
    w = gguf_writer(path, "gemma3n", None)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    finish_gguf(w)
    with pytest.raises(ModelLoadError, match="gemma3n.*gemma3, gemma4, deepseek2"):
        convert_gguf(path, tmp_path / "out")
    moe = tmp_path / "tiny-gemma4-moe.gguf"
    w = gguf_writer(moe, "gemma4", None)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((4, 8), dtype=np.float32))
    finish_gguf(w)
    with pytest.raises(ModelLoadError, match="Gemma 4's MoE block .* not supported") as err:
        convert_gguf(moe, tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    for command in ("chat", "serve"):
        res = CliRunner().invoke(app, [command, "--model", str(path)], input="hi\n")
        assert res.exit_code == 1, res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
        assert "unsupported GGUF architecture 'gemma3n'" in lines[0], lines
