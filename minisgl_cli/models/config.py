"""ModelConfig: the architecture facts the engine needs, read from an HF config.json dict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


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
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None

    def heads_of(self, rank: int, tp_size: int) -> HeadSplit:
        """Rank `rank`'s attention heads under TP: whole GQA groups, as even as the counts allow.

        With at least as many KV heads as ranks each rank takes a contiguous run of KV heads (some may
        take one more: SmolLM2's 3 KV heads go 2 + 1 at TP 2) with their query heads. With fewer KV
        heads than ranks each KV head is replicated on tp / kv ranks, which split its query heads."""
        kv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
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
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; minisgl runs {', '.join(ARCHITECTURES)}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (
            rope_params if rope_params.get("rope_type", "default") != "default" else None
        )
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope_params.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )
