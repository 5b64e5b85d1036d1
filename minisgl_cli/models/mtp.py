"""DeepSeek-V3's multi-token prediction (MTP) module as a model of its own: the draft source of
`--speculative-algorithm mtp` (scheduler/mtp.py).

A checkpoint ships it as decoder layer `num_hidden_layers` (`num_nextn_predict_layers` of them; the first is used):
its row at position i takes the target's hidden state h_i (after the final norm) and the embedding of token i + 1,

    x = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)]),  out = layer(x) (+ its residual),
    logits = lm_head(shared_head.norm(out)),

so its logits guess token i + 2, and `out` stands in for h_{i+1} in the next draft's row. The embedding and the LM
head are the target's (the checkpoint's copies in the MTP layer are the same tensors and are not loaded twice). The
module is one MLA layer with its own KV cache, built here as a one-layer DeepSeek model whose layer is a MoE layer
(as the checkpoint's is) and whose KV pool is the draft engine's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import ColumnParallelLinear
from minisgl_cli.layers.norm import RMSNorm
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.loader.hf import Weight
from minisgl_cli.models.config import MLA_ARCHITECTURES, ModelConfig
from minisgl_cli.models.deepseek import DeepseekV3ForCausalLM

# The MTP layer's own tensors beside its decoder block, by checkpoint name (after model.layers.N.).
_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # the target's embedding and head


def mtp_layers(hf_cfg: dict[str, Any]) -> int:
    """How many MTP layers a checkpoint's config says it ships (0 for none, or for a family not built here)."""
    arch = (hf_cfg.get("architectures") or [""])[0]
    return int(hf_cfg.get("num_nextn_predict_layers") or 0) if arch in MLA_ARCHITECTURES else 0


def mtp_config(hf_cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of the MTP module as a one-layer model (its layer a MoE layer, as layer `num_hidden_layers` of the
    checkpoint is); ValueError where the model ships none."""
    if not mtp_layers(hf_cfg):
        arch = (hf_cfg.get("architectures") or ["?"])[0]
        why = ("its config has no num_nextn_predict_layers" if arch in MLA_ARCHITECTURES else
               "MTP drafts are built for DeepSeek-V3's layout only (Qwen3-Next / Qwen3.5's mtp.* is not)")
        raise ValueError(f"--speculative-algorithm mtp: the model ({arch}) has no MTP layer to draft with: {why}")
    return {**hf_cfg, "num_hidden_layers": 1, "first_k_dense_replace": 0}


def mtp_weights(weights: Iterable[tuple[str, Weight]], first: int) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors of MTP layer `first` (= num_hidden_layers) under the one-layer model's names: its block
    as model.layers.0.*, its own norms and projection under their short names; the rest (the target's layers, the
    shared embedding and head, later MTP layers) left out."""
    prefix = f"model.layers.{first}."
    for name, tensor in weights:
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest in _SHARED:
            continue
        yield (rest if rest in _OWN else f"model.layers.0.{rest}"), tensor


def dummy_extras(hidden: int, device: torch.device, dtype: torch.dtype, seed: int,
                 std: float = 0.02) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights for the MTP layer's own tensors (`--load-format dummy`), as models/dummy.py draws a checkpoint's:
    norms at one, the projection Normal(0, std)."""
    gen = torch.Generator(device=device).manual_seed(seed * 100003 + 99991)
    for name in _OWN:
        if name == "eh_proj.weight":
            yield name, (torch.randn((hidden, 2 * hidden), generator=gen, device=device) * std).to(dtype)
        else:
            yield name, torch.ones(hidden, device=device, dtype=dtype)


class DeepseekMTP(DeepseekV3ForCausalLM):
    """The MTP module (see the module docstring): a one-layer DeepSeek model whose input is each row's token and
    `batch.prev_hidden`, whose forward gives the head's normed rows and keeps every row's output in `batch.hidden`."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        super().__init__(cfg, tp, kernels, method)
        kernels = self.kernels
        h = cfg.hidden_size
        # The embedding and head are the target's (share); dropped here before any weight is loaded into them.
        del self.embed_tokens, self.lm_head, self.norm
        self.embed_tokens: VocabParallelEmbedding | None = None  # type: ignore[assignment]
        self.lm_head: ParallelLMHead | None = None  # type: ignore[assignment]
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, kernels)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, kernels)
        self.eh_proj = ColumnParallelLinear(2 * h, [h], False, TPInfo(), kernels=kernels)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps, kernels)

    def share(self, target: torch.nn.Module) -> None:
        """Take the target model's embedding and LM head (after loading: their weights are the target's)."""
        self.embed_tokens = target.embed_tokens  # type: ignore[assignment]
        self.lm_head = target.lm_head  # type: ignore[assignment]

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """The head's normed rows of each request's last token [B, hidden]; every row's output in `batch.hidden`."""
        assert self.embed_tokens is not None and batch.prev_hidden is not None  # share(); the proposer's input
        e = self.enorm(self.embed_tokens(batch.input_ids))
        x = self.eh_proj(torch.cat((e, self.hnorm(batch.prev_hidden.to(e.dtype))), dim=-1))
        rope = self.rope.table(batch.positions)
        h, residual = self.layers[0](x, None, batch, attn, rope, self._rope_at(x, rope))
        normed, out = self.shared_head_norm.forward_residual(h, residual)
        batch.hidden = out
        return normed if batch.is_decode else normed[batch.logits_indices]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None  # share()
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        """`mtp_weights`' stream (or a one-layer dummy checkpoint's, whose embedding, final norm and head are left
        out: the target's serve)."""
        own: set[str] = set()

        def block() -> Iterator[tuple[str, Weight]]:
            for name, tensor in weights:
                if name in _OWN:
                    path = name.removesuffix(".weight").replace("shared_head.norm", "shared_head_norm")
                    self.get_submodule(path).load_shard("weight", tensor)  # type: ignore[operator]
                    own.add(name)
                elif name.startswith("model.layers."):
                    yield name, tensor

        used = super().load_weights(block()) | own
        if own != set(_OWN) or not any(n.startswith("model.layers.0.") for n in used):
            raise ValueError("--speculative-algorithm mtp: the checkpoint lacks its MTP layer's weights (decoder layer "
                             "num_hidden_layers with enorm, hnorm, eh_proj, shared_head), though its config names one")
        return used
