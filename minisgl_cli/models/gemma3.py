"""Gemma 3's text decoder: the Llama decoder's attention with Gemma's norms, MLP, embedding scale and two RoPEs.

What differs from llama.py, each as transformers' Gemma3ForCausalLM computes it: RMSNorm by (1 + w) (the
weights loaded as 1 + w, so every RMSNorm kernel runs them as they are); a norm before and after both the
attention and the MLP; q/k head norms; a GELU-tanh gated MLP; embeddings scaled by sqrt(hidden); scores scaled
by query_pre_attn_scalar^-1/2 (ModelConfig.attn_scale); local (sliding-window) layers turning by their own RoPE
base, global ones by rope_theta and its scaling; an optional final soft cap on the logits; a tied LM head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.distributed import TPInfo
from minisgl_cli.distributed.comm import all_reduce
from minisgl_cli.distributed.push_rows import Partial
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.norm import LayerOut, RMSNorm, Terms
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.layers.rotary import RopeTable, RotaryEmbedding
from minisgl_cli.loader.hf import Weight, whole
from minisgl_cli.models.config import ModelConfig
from minisgl_cli.models.llama import MLP, Attention, LlamaForCausalLM, RopeAt


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), held as the plain RMSNorm of weight 1 + w."""

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        self.weight.data.copy_(whole(loaded).float() + 1.0)


def summed(x: LayerOut) -> torch.Tensor:
    """A layer's output as plain rows (a TP rank's `Partial` all-reduced, the experts' `Terms` added)."""
    if isinstance(x, Partial):
        return all_reduce(x.rows, x.tp)
    if isinstance(x, Terms):
        return x.summed()
    return x


class GeluMLP(MLP):
    """Llama's MLP with GELU-tanh for SiLU: the same projections, an unfused activation."""

    def forward(self, x: torch.Tensor, decode: bool) -> torch.Tensor:  # type: ignore[override]
        gate, up = self.gate_up_proj(x, decode).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up, decode)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Attention(cfg, layer_id, rope, tp, kernels, method)
        # its q/k head norms are Gemma's too
        self.self_attn.q_norm = GemmaRMSNorm(cfg.head_dim, eps, kernels)
        self.self_attn.k_norm = GemmaRMSNorm(cfg.head_dim, eps, kernels)
        self.mlp = GeluMLP(cfg, tp, kernels, method)
        self.input_layernorm = GemmaRMSNorm(h, eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, kernels)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, kernels)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, kernels)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch, attn: AttentionBackend,
                rope: RopeTable, rope_at: RopeAt | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the layer's output, the residual), summed: the next layer's input norm adds them."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.forward_residual(h, residual)
        a = self.post_attention_layernorm(summed(self.self_attn(x, batch, attn, rope, rope_at)))
        x, residual = self.pre_feedforward_layernorm.forward_residual(a, residual)
        return self.post_feedforward_layernorm(self.mlp(x, batch.is_decode)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text (transformers' Gemma3ForCausalLM, config gemma3_text)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.tp = tp
        self.kernels = kernels = kernels or Kernels()
        method = method or LinearMethod()
        if cfg.vision is not None:
            raise ValueError("Gemma 3's vision tower is not supported: load its text model (Gemma3ForCausalLM)")
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.local_rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                          cfg.local_rope_theta or cfg.rope_theta, cfg.local_rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, self.local_rope if cfg.window_of(i) else self.rope, tp, kernels,
                               method.for_layer(i, cfg.num_layers))
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, kernels, method.for_lm_head(),
                                      tied=self.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        h = h * torch.tensor(self.cfg.hidden_size**0.5, dtype=h.dtype)  # rounded to the dtype, as transformers does
        return self.decode_layers(h, batch, attn, self.rope.table(batch.positions))

    def decode_layers(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                      rope: RopeTable) -> torch.Tensor:
        residual = None
        fused = self.kernels.triton(h) is not None or self.kernels.sgl_ops(h) is not None
        # each RoPE's table of this step (and its cos / sin for the torch path), once for every layer: global, local
        local = self.local_rope.table(batch.positions)
        ropes = [(t, None if fused else emb.at(t, h.dtype)) for emb, t in ((self.rope, rope), (self.local_rope, local))]
        for i, layer in enumerate(self.layers):
            table, at = ropes[bool(self.cfg.window_of(i))]
            h, residual = layer(h, residual, batch, attn, table, at)
        assert residual is not None
        if not batch.is_decode:
            idx = batch.logits_indices
            h, residual = h[idx], residual[idx]
        out, _ = self.norm.forward_residual(h, residual)
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        cap = self.cfg.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits
