"""GGUF -> HF directory conversion: a llama GGUF once into config.json + tokenizer + its weights, twice.

Mixtures of experts, as llama.cpp converts them: a llama GGUF with experts (`llama.expert_count`: Mixtral) becomes a
Mixtral directory, a `qwen3moe` GGUF a Qwen3-MoE one (its q / k head norms, no q / k row permutation, renormalized
top-k as llama.cpp runs it). Each layer's router `ffn_gate_inp` and stacked experts `ffn_{gate,up,down}_exps`
[E, out, in] split into HF's per-expert matrices, each expert's blocks kept as shipped.

The newer families (gemma3, gemma4, deepseek2, gpt-oss, qwen3next, qwen35, qwen35moe) go through their tables in
loader/gguf_families.py: the same steps, their config, names and llama.cpp's transforms undone there.

transformers can load a GGUF directly, but it re-parses and re-dequantizes on every load
(~26 s for SmolLM2-135M on 2 CPU cores). We do that work once with the `gguf` package and
write a plain fp32 HF directory (model.safetensors: what transformers and the exact fp32 mode load),
plus the GGUF's own quantized blocks re-laid as HF-named tensors (loader/blocks.py's BLOCKS_FILE:
Q4_0 / Q4_1 / Q8_0 kept as shipped, other types dequantized), which the quantized modes load.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.loader.gguf_families import FAMILIES, Family, Meta

if TYPE_CHECKING:
    from minisgl_cli.loader.blocks import Blocks

GGUF_MAGIC = b"GGUF"

# llama.cpp per-layer tensor names -> HF Llama names (within model.layers.{i}).
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}  # qwen3moe's head norms
ARCHS = ("llama", "qwen3moe")  # the general.architecture values read as Llama's layout (with experts: Mixtral)
ALL_ARCHS = (*ARCHS, *FAMILIES)  # and the newer families' (loader/gguf_families.py)
EXPECTED_GGUF = (f"a .gguf file of architecture {', '.join(ALL_ARCHS)} (llama with experts: Mixtral) with quant types "
                 "the gguf package can dequantize")
# A MoE layer's router and stacked experts (within model.layers.{i}): llama.cpp's names -> HF's, by architecture.
_MOE_ROUTER = {"llama": "block_sparse_moe.gate", "qwen3moe": "mlp.gate"}
_EXPERT_TENSORS = {
    "llama": {"ffn_gate_exps": "block_sparse_moe.experts.{e}.w1", "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
              "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    "qwen3moe": {"ffn_gate_exps": "mlp.experts.{e}.gate_proj", "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"},
}
# Derived on the fly by llama.cpp; HF recomputes it, so it is not a weight.
_SKIPPED_TENSORS = {"rope_freqs.weight"}


@dataclass(frozen=True)
class HParams:
    """The model hyper-parameters a GGUF carries, named as transformers' configs take them (LlamaConfig's, plus the
    experts' of MixtralConfig / Qwen3MoeConfig)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    num_local_experts: int = 0  # a MoE GGUF: its experts, and how many each token takes
    num_experts_per_tok: int = 0
    arch: str = "llama"  # the GGUF's general.architecture: "llama" (Mixtral with experts) or "qwen3moe"
    moe_intermediate_size: int = 0  # qwen3moe: an expert's width (intermediate_size: a dense MLP's)


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert a llama GGUF into an fp32 HF directory at out_dir and return out_dir.

    Everything is written into a temp dir beside out_dir and renamed into place at the end,
    so out_dir either does not exist or is complete. An existing out_dir is replaced.
    """
    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    reader = _open_reader(gguf_path)
    family = FAMILIES.get(_field(reader, "general.architecture"))
    cfg = _family_config(reader, family, gguf_path) if family is not None else None
    hp = read_hparams(reader, gguf_path) if family is None else None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if family is not None and cfg is not None:
            _write_family_weights(reader, family, cfg, gguf_path, tmp)
            _write_family_config(cfg, tmp)
            eos, max_len = cfg.get("eos_token_id"), cfg["max_position_embeddings"]
        else:
            assert hp is not None
            _write_weights(reader, hp, gguf_path, tmp)
            _write_config(hp, tmp)
            eos, max_len = hp.eos_token_id, hp.max_position_embeddings
        del reader  # releases the memmap before the (slow) tokenizer pass
        _write_tokenizer(gguf_path, eos, max_len, tmp, family is not None)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read_hparams(reader: Any, gguf_path: Path) -> HParams:
    """Read LlamaConfig values from GGUF metadata, deriving them the way transformers does."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}", gguf_path, EXPECTED_GGUF)

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}", gguf_path, EXPECTED_GGUF)
        return value

    hidden, n_head = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = _field(reader, f"{arch}.attention.head_count_kv")
    head_dim = _field(reader, f"{arch}.attention.key_length", _field(reader, f"{arch}.rope.dimension_count"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:  # older files: the embedding's row count is the vocab size
        vocab = _tensor(reader, "token_embd.weight").shape[-1]
    expert_width = int(_field(reader, f"{arch}.expert_feed_forward_length", 0))
    return HParams(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", expert_width) if arch == "qwen3moe"
                              else need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(n_kv) if n_kv is not None else n_head,
        head_dim=int(head_dim) if head_dim is not None else hidden // n_head,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need("context_length")),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_opt_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_token_id=_opt_int(_field(reader, "tokenizer.ggml.padding_token_id")),
        unk_token_id=_opt_int(_field(reader, "tokenizer.ggml.unknown_token_id")),
        num_local_experts=int(_field(reader, f"{arch}.expert_count", 0)),
        num_experts_per_tok=int(_field(reader, f"{arch}.expert_used_count", 0)),
        arch=arch,
        moe_intermediate_size=expert_width,
    )


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave on a q/k weight of shape [n_head*head_dim, hidden].

    convert_hf_to_gguf reorders each head's rows from HF's "first half / second half" rotary
    layout to llama.cpp's "adjacent pairs" layout: reshape(n_head, 2, d/2, ...) then swap
    axes 1 and 2. The inverse views rows as (n_head, d/2, 2) and swaps back. For k, n_head
    is the kv-head count (that is what the forward permute used).
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Map a llama.cpp tensor name to its HF name (Llama's; a MoE's router and a qwen3moe's head norms by `arch`);
    None for tensors HF does not store."""
    if gguf_name in _SKIPPED_TENSORS:
        return None
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{kind}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit():
        hf = _LAYER_TENSORS.get(parts[2]) or (_QK_NORMS.get(parts[2]) if arch == "qwen3moe" else None)
        if parts[2] == "ffn_gate_inp":
            hf = _MOE_ROUTER[arch]
        if hf is not None:
            return f"model.layers.{parts[1]}.{hf}.{parts[3]}"
    raise KeyError(gguf_name)


def expert_tensor_names(gguf_name: str, n_experts: int, arch: str = "llama") -> list[str] | None:
    """The HF names of a stacked-experts tensor's matrices, expert by expert; None for any other tensor."""
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _EXPERT_TENSORS[arch]:
        return None
    return [f"model.layers.{parts[1]}.{_EXPERT_TENSORS[arch][parts[2]].format(e=e)}.{parts[3]}"
            for e in range(n_experts)]


# --- steps -------------------------------------------------------------------------------


def _open_reader(gguf_path: Path) -> Any:
    import gguf  # the top-level `gguf` package (absolute import), not this module

    if not gguf_path.is_file():
        raise ModelLoadError("GGUF file not found", gguf_path, EXPECTED_GGUF)
    with open(gguf_path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError("not a GGUF file (bad magic)", gguf_path, EXPECTED_GGUF)
    try:
        return gguf.GGUFReader(gguf_path)
    except Exception as e:  # truncated / corrupt files surface as assorted numpy/ValueErrors
        raise ModelLoadError(f"unreadable GGUF file ({type(e).__name__}: {e})", gguf_path, EXPECTED_GGUF) from e


def _write_weights(reader: Any, hp: HParams, gguf_path: Path, out: Path) -> None:
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from minisgl_cli.loader.blocks import BLOCKS_FILE, save_blocks

    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, torch.Tensor | Blocks] = {}
    for t in reader.tensors:
        experts = expert_tensor_names(t.name, hp.num_local_experts, hp.arch)
        name = None
        if experts is None:
            try:
                name = hf_tensor_name(t.name, hp.arch)
            except KeyError:
                raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}", gguf_path, EXPECTED_GGUF) from None
            if name is None:
                continue
        try:
            # dequantize returns numpy order (torch order), i.e. GGUF's listed shape reversed.
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"unsupported quant type {t.tensor_type.name} in {t.name}", gguf_path, EXPECTED_GGUF
            ) from None
        w = np.asarray(w, dtype=np.float32)
        # (HF name, its matrix, its bytes as shipped or None, its row order fix) of each matrix the tensor holds
        mats: list[tuple[str, np.ndarray, np.ndarray | None, Callable[[np.ndarray], np.ndarray]]]
        if experts is None:
            assert name is not None
            rows = _qk_rows(t.name, hp)
            # Copy: F32 tensors come back as views of the read-only memmap.
            mats = [(name, rows(w).copy(), t.data if len(t.data.shape) == 2 else None, rows)]
        else:  # [E, out, in]: one HF matrix an expert, each with its own blocks
            if w.ndim != 3 or w.shape[0] != len(experts):
                raise ModelLoadError(f"GGUF tensor {t.name!r} holds {w.shape[0] if w.ndim == 3 else 0} experts, "
                                     f"not {hp.arch}.expert_count {len(experts)}", gguf_path, EXPECTED_GGUF)
            mats = [(n, np.ascontiguousarray(w[e]), t.data[e], np.ascontiguousarray) for e, n in enumerate(experts)]
        for hf_name, matrix, shipped, fix in mats:
            tensors[hf_name] = torch.from_numpy(matrix)
            kept = _blocks(t.tensor_type.name, shipped, fix) if shipped is not None else None
            blocks[hf_name] = kept or tensors[hf_name]
    missing = _expected_names(hp) - tensors.keys()
    if missing:
        raise ModelLoadError(f"GGUF lacks tensors {sorted(missing)[:3]}", gguf_path, EXPECTED_GGUF)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / BLOCKS_FILE).parent.mkdir()
    save_blocks(blocks, out / BLOCKS_FILE)


def _qk_rows(gguf_name: str, hp: HParams) -> Callable[[np.ndarray], np.ndarray]:
    """The row order fix of a tensor (llama's q/k: undo llama.cpp's rotary interleave; qwen3moe's are not
    interleaved), for any array with its rows first."""
    if hp.arch != "llama":
        return np.ascontiguousarray
    if gguf_name.endswith(".attn_q.weight"):
        return lambda a: np.ascontiguousarray(unpermute_qk(a, hp.num_attention_heads))
    if gguf_name.endswith(".attn_k.weight"):
        return lambda a: np.ascontiguousarray(unpermute_qk(a, hp.num_key_value_heads))
    return np.ascontiguousarray


def _blocks(kind: str, data: np.ndarray, rows: Callable[[np.ndarray], np.ndarray]) -> Blocks | None:
    """A Q4_0 / Q4_1 / Q8_0 matrix's integers and fp16 scales as shipped (loader/blocks.py), from its bytes
    `data` [rows, bytes a row]; None for other types.

    Each 32-weight block is [d: fp16][m: fp16, Q4_1 only][values]; the 4-bit kinds hold weight i in the low
    nibble of byte i and weight i + 16 in its high nibble."""
    import torch

    from minisgl_cli.loader.blocks import Int4Groups, Int8Groups

    if kind not in ("Q4_0", "Q4_1", "Q8_0"):
        return None
    n = data.shape[0]
    b = np.asarray(data).reshape(n, -1, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind])

    def plane(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows(a))

    scale = b[..., 0:2].copy().view(np.float16)[..., 0]
    if kind == "Q8_0":
        return Int8Groups(plane(b[..., 2:].copy().view(np.int8).reshape(n, -1)), plane(scale))
    qs = b[..., -16:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, -1)
    low = -8 * scale if kind == "Q4_0" else b[..., 2:4].copy().view(np.float16)[..., 0]  # Q4_0: d * (q - 8)
    return Int4Groups(plane(q), plane(scale), plane(low))


def _expected_names(hp: HParams) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not hp.tie_word_embeddings:
        names.add("lm_head.weight")
    ffn = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    for i in range(hp.num_hidden_layers):
        names |= {f"model.layers.{i}.{hf}.weight" for hf in _LAYER_TENSORS.values()
                  if not (hp.num_local_experts and hf in ffn)}
        if hp.arch == "qwen3moe":
            names |= {f"model.layers.{i}.{hf}.weight" for hf in _QK_NORMS.values()}
        if hp.num_local_experts:
            names.add(f"model.layers.{i}.{_MOE_ROUTER[hp.arch]}.weight")
            for kind in _EXPERT_TENSORS[hp.arch]:
                names |= set(expert_tensor_names(f"blk.{i}.{kind}.weight", hp.num_local_experts, hp.arch) or ())
    return names


def _write_config(hp: HParams, out: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, MixtralConfig, Qwen3MoeConfig

    # Every field is named as the config class takes it (rope_theta too: transformers 5 reads it from kwargs); a
    # dense model's config names no experts.
    fields = asdict(hp)
    del fields["arch"], fields["moe_intermediate_size"]
    config: LlamaConfig | MixtralConfig | Qwen3MoeConfig
    if hp.arch == "qwen3moe":  # every layer sparse; llama.cpp renormalizes the top k (its norm_w)
        n_exp, top = fields.pop("num_local_experts"), fields.pop("num_experts_per_tok")
        config = Qwen3MoeConfig(**fields, num_experts=n_exp, num_experts_per_tok=top,
                                moe_intermediate_size=hp.moe_intermediate_size, norm_topk_prob=True,
                                decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"],
                                dtype="float32")
    elif hp.num_local_experts:
        config = MixtralConfig(**fields, architectures=["MixtralForCausalLM"], dtype="float32", sliding_window=None)
    else:
        del fields["num_local_experts"], fields["num_experts_per_tok"]
        config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"], dtype="float32")
    config.save_pretrained(out)
    # Readers that parse config.json by hand (or older transformers) look for these keys.
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw.setdefault("rope_theta", hp.rope_theta)
    raw.setdefault("torch_dtype", "float32")
    path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")

    GenerationConfig(
        bos_token_id=hp.bos_token_id, eos_token_id=hp.eos_token_id, pad_token_id=hp.pad_token_id
    ).save_pretrained(out)


# --- the newer families (loader/gguf_families.py) ---------------------------------------------------------------


def _family_config(reader: Any, family: Family, gguf_path: Path) -> dict[str, Any]:
    """The HF config fields of a family's GGUF, with the token ids and tied head every family's file gives alike."""
    from gguf.quants import dequantize

    tensors = {t.name: t for t in reader.tensors}

    def values(name: str) -> np.ndarray | None:
        t = tensors.get(name)
        return None if t is None else np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    def shape(name: str) -> tuple[int, ...] | None:  # HF's order: the GGUF's listed shape reversed
        t = tensors.get(name)
        return None if t is None else tuple(int(d) for d in reversed(t.shape))

    meta = Meta(lambda key, default: _field(reader, key, default), _field(reader, "general.architecture"), values,
                shape)
    ids: dict[str, Any] = {k: _opt_int(_field(reader, f"tokenizer.ggml.{g}")) for k, g in (
        ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))}
    # llama.cpp ends a generation at the end-of-turn / end-of-message tokens too (Gemma's <end_of_turn>), not only eos
    ends = [ids["eos_token_id"], *(_opt_int(_field(reader, f"tokenizer.ggml.{k}")) for k in ("eot_token_id",
                                                                                         "eom_token_id"))]
    ends = list(dict.fromkeys(e for e in ends if e is not None))
    if len(ends) > 1:
        ids["eos_token_id"] = ends
    try:
        cfg = family.config(meta, _tensor(reader, "token_embd.weight").shape[-1])
    except KeyError as e:
        raise ModelLoadError(f"GGUF metadata lacks {e.args[0]}", gguf_path, EXPECTED_GGUF) from None
    except ValueError as e:  # a variant of the architecture not converted
        raise ModelLoadError(str(e), gguf_path, EXPECTED_GGUF) from None
    return dict(ids, **cfg, tie_word_embeddings="output.weight" not in tensors)


def _write_family_weights(reader: Any, family: Family, cfg: dict[str, Any], gguf_path: Path, out: Path) -> None:
    """As _write_weights, through the family's names and transforms: a tensor kept as its blocks where its HF tensor
    is its bytes as shipped (the whole tensor, or one expert of a stacked one)."""
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    from minisgl_cli.loader.blocks import BLOCKS_FILE, save_blocks

    values: dict[str, np.ndarray] = {}
    blocks: dict[str, Blocks] = {}
    for t in reader.tensors:
        if t.name in _SKIPPED_TENSORS:
            continue
        try:
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise ModelLoadError(
                f"unsupported quant type {t.tensor_type.name} in {t.name}", gguf_path, EXPECTED_GGUF) from None
        try:
            outs = family.tensor(t.name, w, cfg)
        except KeyError:
            raise ModelLoadError(f"unexpected GGUF tensor {t.name!r}", gguf_path, EXPECTED_GGUF) from None
        for o in outs:
            values[o.name] = np.array(o.value, dtype=np.float32)  # a copy: F32 tensors are views of the memmap
            shipped = t.data if o.shipped and len(t.data.shape) == 2 else (
                t.data[o.expert] if o.expert is not None else None)
            kept = _blocks(t.tensor_type.name, shipped, np.ascontiguousarray) if shipped is not None else None
            if kept is not None:
                blocks[o.name] = kept
    family.join(values, cfg)
    missing = family.expected(cfg) - values.keys()
    if missing:
        raise ModelLoadError(f"GGUF lacks tensors {sorted(missing)[:3]}", gguf_path, EXPECTED_GGUF)
    tensors = {k: torch.from_numpy(v) for k, v in values.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / BLOCKS_FILE).parent.mkdir()
    save_blocks({k: blocks.get(k, v) for k, v in tensors.items()}, out / BLOCKS_FILE)


def _write_family_config(cfg: dict[str, Any], out: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    fields = dict(cfg)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(out)
    GenerationConfig(bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
                     pad_token_id=cfg["pad_token_id"]).save_pretrained(out)


def _write_tokenizer(gguf_path: Path, eos_token_id: int | list[int] | None, max_len: int, out: Path,
                     family: bool) -> None:
    # transformers' own GGUF tokenizer conversion: it rebuilds the BPE model, pre-tokenizer,
    # special tokens and chat template exactly as its GGUF loading path would see them.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # The newer families' files through the tokenizer alone: AutoTokenizer first reads the file's model config, which
    # transformers lacks for some (deepseek2) and misreads for others (gpt-oss's rope scaling).
    auto = PreTrainedTokenizerFast if family else AutoTokenizer
    tok = auto.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))

    # transformers 5 writes the template to chat_template.jinja; HF checkpoints (and older
    # readers) also carry it in tokenizer_config.json, so keep both in agreement.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = tok.chat_template
    if template is None and (out / "chat_template.jinja").is_file():
        template = (out / "chat_template.jinja").read_text()
    if template is not None:
        cfg["chat_template"] = template
    if isinstance(eos_token_id, list):  # several ends (Gemma 4's turn ends): the tokenizer's eos is the first
        eos_token_id = eos_token_id[0]
    if eos_token_id is not None:
        cfg["eos_token"] = tok.convert_ids_to_tokens(eos_token_id)
    cfg["model_max_length"] = max_len  # instead of transformers' 1e30 "unset"
    for key in ("is_local", "local_files_only"):  # load-time flags, not tokenizer properties
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    if out_dir.exists():
        # os.replace cannot overwrite a non-empty directory: park the old one, swap, drop it.
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "d")
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


# --- metadata helpers --------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return default if value is None else value


def _tensor(reader: Any, name: str) -> Any:
    for t in reader.tensors:
        if t.name == name:
            return t
    raise KeyError(name)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)
