"""The multi-token-prediction (MTP) layer a checkpoint ships beside its decoder, as a model of its own: the draft
source of `--speculative-algorithm mtp` (scheduler/mtp.py). DeepSeek-V3's, and Qwen3-Next's / Qwen3.5's.

Its row at position i takes the target's hidden state h_i (after the final norm) and the embedding of token i + 1,

    x = fc([norm_e(embed(t_{i+1})) ; norm_h(h_i)]),  y = block(x) (+ its residual),  logits = lm_head(norm(y)),

so its logits guess token i + 2, and its output stands in for h_{i+1} in the next draft's row: y itself on DeepSeek
(its head's norm is applied for the logits only), norm(y) on Qwen3-Next / Qwen3.5 (their MTP returns the normed rows,
as vLLM's and SGLang's do). The embedding and the LM head are the target's, not loaded twice.

    DeepSeek-V3   decoder layer num_hidden_layers: eh_proj; enorm, hnorm; an MLA + MoE block; shared_head.norm
    Qwen3-Next,   mtp.*: fc; pre_fc_norm_embedding, pre_fc_norm_hidden; a gated full-attention block (mtp.layers.0);
    Qwen3.5       norm (their norms scale by 1 + w)

Built here as a one-layer model of the target's family (the block a MoE layer where the target's are), on the draft
engine's one-layer KV pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import ColumnParallelLinear
from minisgl_cli.layers.norm import RMSNorm
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.loader.hf import Weight
from minisgl_cli.models.config import HYBRID_ARCHITECTURES, MLA_ARCHITECTURES, ModelConfig
from minisgl_cli.models.deepseek import DeepseekV3ForCausalLM
from minisgl_cli.models.dummy import random_matrix
from minisgl_cli.models.gemma3 import GemmaRMSNorm
from minisgl_cli.models.llama import LlamaForCausalLM
from minisgl_cli.models.qwen3_next import Qwen3NextForCausalLM

# The MTP layer's own tensors beside its block, by our names: fc, norm_e, norm_h, the head's norm.
OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")
_QWEN_OWN = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
             "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "shared_head.norm.weight"}
_DEEPSEEK_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the target's embedding and head


def _arch(hf_cfg: dict[str, Any]) -> str:
    return (hf_cfg.get("architectures") or ["?"])[0]


def _text(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """The config's decoder fields (a Qwen3.5 hub config nests them in text_config)."""
    return {**hf_cfg, **hf_cfg.get("text_config", {})}


def mtp_layers(hf_cfg: dict[str, Any]) -> int:
    """How many MTP layers a checkpoint's config says it ships (0: none, or a family without them here)."""
    arch, cfg = _arch(hf_cfg), _text(hf_cfg)
    if arch in MLA_ARCHITECTURES:
        return int(cfg.get("num_nextn_predict_layers") or 0)
    if arch in HYBRID_ARCHITECTURES:
        return int(cfg.get("mtp_num_hidden_layers") or cfg.get("num_nextn_predict_layers") or 0)
    return 0


def mtp_config(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the MTP module as a one-layer model of the target's family; ValueError where it ships none."""
    arch = _arch(hf_cfg)
    if not mtp_layers(hf_cfg):
        key = "num_nextn_predict_layers" if arch in MLA_ARCHITECTURES else "mtp_num_hidden_layers"
        why = (f"its config has no {key}" if arch in (*MLA_ARCHITECTURES, *HYBRID_ARCHITECTURES) else
               "MTP layers are built for DeepSeek-V3, Qwen3-Next and Qwen3.5")
        raise ValueError(f"--speculative-algorithm mtp: the model ({arch}) has no MTP layer to draft with: {why}")
    if arch in MLA_ARCHITECTURES:  # DeepSeek's MTP block is a MoE layer (its index is past first_k_dense_replace)
        return {**hf_cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0}
    one = {"num_hidden_layers": 1, "layer_types": ["full_attention"]}  # a gated full-attention block
    if "text_config" in hf_cfg:
        return {**hf_cfg, "text_config": {**hf_cfg["text_config"], **one}}
    return {**hf_cfg, **one}


def mtp_weights(weights: Iterable[tuple[str, Weight]], hf_cfg: dict[str, Any]) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors of the (first) MTP layer under the one-layer model's names: its block as
    model.layers.0.*, its own tensors as OWN names; the rest (the target's, the shared embedding and head, later MTP
    layers) left out."""
    deepseek = _arch(hf_cfg) in MLA_ARCHITECTURES
    prefix = f"model.layers.{_text(hf_cfg)['num_hidden_layers']}." if deepseek else "mtp.layers.0."
    for name, tensor in weights:
        if not deepseek and name in _QWEN_OWN:
            yield _QWEN_OWN[name], tensor
        elif name.startswith(prefix):
            rest = name[len(prefix):]
            if deepseek and rest in _DEEPSEEK_SHARED:
                continue
            yield (rest if deepseek and rest in OWN else f"model.layers.0.{rest}"), tensor


def dummy_extras(hidden: int, device: torch.device, dtype: torch.dtype, seed: int,
                 std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights for the MTP layer's own tensors (`--load-format dummy`), as models/dummy.py draws a checkpoint's:
    norms at one, the projection Normal(0, std)."""
    for name in OWN:
        if name == "eh_proj.weight":
            yield name, random_matrix((hidden, 2 * hidden), device, dtype, seed * 100003 + 99991, std)
        else:
            yield name, torch.ones(hidden, device=device, dtype=dtype)


class MtpHead(LlamaForCausalLM):
    """What an MTP module adds to the one-layer model of its family (a base before the family's class): the input
    projection and norms, the shared embedding and head, a forward over `batch.prev_hidden`."""

    chain_normed = False  # the next draft's row takes the head's normed output (else the block's)
    norm_cls: type[RMSNorm] = RMSNorm

    def _mtp_parts(self, cfg: ModelConfig, kernels: Kernels) -> None:
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        # The embedding and head are the target's (share); dropped here before any weight is loaded into them.
        del self.embed_tokens, self.lm_head, self.norm
        self.embed_tokens = self.lm_head = None  # type: ignore[assignment]
        self.enorm = self.norm_cls(h, eps, kernels)
        self.hnorm = self.norm_cls(h, eps, kernels)
        self.eh_proj = ColumnParallelLinear(2 * h, [h], False, TPInfo(), kernels=kernels)
        self.shared_head_norm = self.norm_cls(h, eps, kernels)

    def share(self, target: LlamaForCausalLM) -> None:
        """Take the target model's embedding and LM head (after loading: their weights are the target's)."""
        self.embed_tokens, self.lm_head = target.embed_tokens, target.lm_head

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The head's normed rows of each request's last token [B, hidden]; every row's output for the next draft in
        `batch.hidden`."""
        assert batch.prev_hidden is not None  # the proposer's input
        e = self.enorm(self.embed_tokens(batch.input_ids))
        x = self.eh_proj(torch.cat((e, self.hnorm(batch.prev_hidden.to(e.dtype))), dim=-1))
        rope = self.rope.table(batch.positions)
        h, residual = self.layers[0](x, None, batch, attn, rope, self._rope_at(x, rope))
        normed, out = self.shared_head_norm.forward_residual(h, residual)
        batch.hidden = normed if self.chain_normed else out
        return normed if batch.is_decode else normed[batch.logits_indices]

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        """`mtp_weights`' stream (or a one-layer dummy checkpoint's, whose embedding, final norm and head are left
        out: the target's serve)."""
        own: set[str] = set()

        def block() -> Iterator[tuple[str, Weight]]:
            for name, tensor in weights:
                if name in OWN:
                    module = self.get_submodule(name.removesuffix(".weight").replace("shared_head.", "shared_head_"))
                    assert isinstance(module, (RMSNorm, ColumnParallelLinear))
                    module.load_shard("weight", tensor)
                    own.add(name)
                elif name.startswith("model.layers."):
                    yield name, tensor

        used = super().load_weights(block()) | own
        if own != set(OWN) or not any(n.startswith("model.layers.0.") for n in used):
            raise ValueError("--speculative-algorithm mtp: the checkpoint lacks its MTP layer's weights, though its "
                             "config names one")
        return used


class DeepseekMTP(MtpHead, DeepseekV3ForCausalLM):
    """DeepSeek-V3's MTP layer (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        super().__init__(cfg, tp, kernels, method)
        self._mtp_parts(cfg, self.kernels)


class QwenNextMTP(MtpHead, Qwen3NextForCausalLM):
    """Qwen3-Next's / Qwen3.5's MTP layer (see the module docstring): (1 + w) norms, the normed output chained."""

    chain_normed = True
    norm_cls = GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        super().__init__(cfg, tp, kernels, method)
        self._mtp_parts(cfg, self.kernels)


def create_mtp_model(cfg: ModelConfig, tp: TPInfo, kernels: Kernels, method: LinearMethod) -> LlamaForCausalLM:
    """The MTP module of a model of `cfg`'s family (cfg: `mtp_config`'s)."""
    cls = DeepseekMTP if cfg.mla is not None else QwenNextMTP
    return cls(cfg, tp, kernels, method)
