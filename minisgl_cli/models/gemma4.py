"""Gemma 4's text decoder: Gemma 3's layer with Gemma 4's attention, per-layer inputs and layer scale.

What differs from gemma3.py, each as transformers' Gemma4ForCausalLM computes it: plain RMSNorm weights (w, not 1 + w);
scores unscaled (q and k are RMS-normed per head); V RMS-normed per head (no weight); the global layers' wider heads and
fewer KV heads (ModelConfig.head_dim_of / kv_heads_of), their V the K projection's output where attention_k_eq_v, their
RoPE "proportional" (only a leading share of the pairs turns); the last num_kv_shared_layers layers attending over the
KV of the last earlier layer of their type (kv_source_of: they store none); per-layer inputs (a second embedding of
each token, one slice per layer, mixed with a projection of the first, gated into each layer's output); each layer's
output times a loaded scalar; the KV-sharing layers' MLPs twice as wide where use_double_wide_mlp. A hub checkpoint
wrapping the decoder with vision / audio towers (Gemma4ForConditionalGeneration) loads its language model alone."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl_cli.layers.norm import RMSNorm
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.layers.rotary import RotaryEmbedding
from minisgl_cli.loader.hf import Weight, whole
from minisgl_cli.models.config import ModelConfig
from minisgl_cli.models.gemma3 import GeluMLP, Gemma3ForCausalLM, summed
from minisgl_cli.models.llama import RopeAt

log = logging.getLogger(__name__)
SharedKV = dict[int, tuple[torch.Tensor, torch.Tensor]]  # a step's K / V by the layer that computed them
_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        self.layer_id, self.rope = layer_id, rope
        self.head_dim = d = cfg.head_dim_of(layer_id)
        heads = cfg.heads_of(tp.rank, tp.size, layer_id)
        self.num_heads, self.num_kv_heads = heads.n_q, heads.n_kv
        self.window = cfg.window_of(layer_id)
        self.kv_from = cfg.kv_source_of(layer_id)  # this layer's own, or the earlier layer whose KV it reads
        self.k_eq_v = cfg.attention_k_eq_v and not self.window
        q, kv = (heads.q_start * d, heads.n_q * d), (heads.kv_start * d, heads.n_kv * d)
        n_kv = cfg.kv_heads_of(layer_id) * d
        shards = [(cfg.num_heads * d, q)]
        if self.kv_from == layer_id:
            shards += [(n_kv, kv)] * (1 if self.k_eq_v else 2)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [s for s, _ in shards], bias=False, tp=tp,
                                             ranges=[r for _, r in shards], kernels=kernels, method=method)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, tp=tp, in_range=q, kernels=kernels,
                                        method=method)
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(d, eps, kernels)
        self.k_norm = RMSNorm(d, eps, kernels) if self.kv_from == layer_id else None
        self.v_norm = RMSNorm(d, eps, kernels)  # no weight in the checkpoint: ones

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, at: RopeAt,
                shared: SharedKV) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(x, batch.is_decode)
        q = self.rope.rotate(self.q_norm(qkv[:, :q_size].reshape(-1, self.num_heads, self.head_dim)), at)
        if self.k_norm is None:  # a KV-sharing layer: the source layer stored this step's K / V already
            k, v = shared[self.kv_from]
            o = attn.attend(q, k, v, self.kv_from, batch, self.window)
        else:
            k = qkv[:, q_size : q_size + kv_size].reshape(-1, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else qkv[:, q_size + kv_size :].reshape(-1, self.num_kv_heads, self.head_dim)
            k, v = self.rope.rotate(self.k_norm(k), at), self.v_norm(v)
            shared[self.layer_id] = k, v
            o = attn.forward(q, k, v, self.layer_id, batch, window=self.window)
        return summed(self.o_proj.to_norm(o.reshape(-1, q_size), batch.is_decode))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.self_attn = Gemma4Attention(cfg, layer_id, rope, tp, kernels, method)
        wide = cfg.double_wide_mlp and cfg.kv_source_of(layer_id) != layer_id
        self.mlp = GeluMLP(dataclasses.replace(cfg, intermediate_size=2 * cfg.intermediate_size) if wide else cfg,
                           tp, kernels, method)
        self.input_layernorm = RMSNorm(h, eps, kernels)
        self.post_attention_layernorm = RMSNorm(h, eps, kernels)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, kernels)
        self.post_feedforward_layernorm = RMSNorm(h, eps, kernels)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        p = cfg.per_layer_input_size
        if p:  # replicated on every TP rank: narrow (p columns)
            self.per_layer_input_gate = ColumnParallelLinear(h, [p], bias=False, kernels=kernels, method=method)
            self.per_layer_projection = ColumnParallelLinear(p, [h], bias=False, kernels=kernels, method=method)
            self.post_per_layer_input_norm = RMSNorm(h, eps, kernels)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        if name != "layer_scalar":
            raise KeyError(f"checkpoint has a decoder-layer tensor {name!r} Gemma 4's layer does not hold")
        self.layer_scalar.data.copy_(whole(loaded))

    def forward(self, h: torch.Tensor, per_layer: torch.Tensor | None, batch: ForwardBatch, attn: AttentionBackend,
                at: RopeAt, shared: SharedKV) -> torch.Tensor:
        decode = batch.is_decode
        a = self.self_attn(self.input_layernorm(h), batch, attn, at, shared)
        h = h + self.post_attention_layernorm(a)
        h = h + self.post_feedforward_layernorm(summed(self.mlp(self.pre_feedforward_layernorm(h), decode)))
        if per_layer is not None:
            g = F.gelu(self.per_layer_input_gate(h, decode), approximate="tanh") * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(g, decode))
        return h * self.layer_scalar.to(h.dtype)


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 4 text (transformers' Gemma4ForCausalLM, config gemma4_text; or the language model of a
    Gemma4ForConditionalGeneration checkpoint)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.tp = tp
        self.kernels = kernels = kernels or Kernels()
        method = method or LinearMethod()
        full = next((i for i in range(cfg.num_layers) if not cfg.window_of(i)), 0)
        local = next((i for i in range(cfg.num_layers) if cfg.window_of(i)), 0)
        n = cfg.max_position_embeddings
        self.rope = RotaryEmbedding(cfg.head_dim_of(full), n, cfg.rope_theta, cfg.rope_scaling)
        self.local_rope = RotaryEmbedding(cfg.head_dim_of(local), n, cfg.local_rope_theta or cfg.rope_theta,
                                          cfg.local_rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(cfg, i, self.local_rope if cfg.window_of(i) else self.rope, tp, kernels,
                               method.for_layer(i, cfg.num_layers))
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, kernels, method.for_lm_head(),
                                      tied=self.embed_tokens if cfg.tie_word_embeddings else None)
        p = cfg.per_layer_input_size
        if p:
            width = cfg.num_layers * p
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.per_layer_vocab_size, width)
            self.per_layer_model_projection = ColumnParallelLinear(cfg.hidden_size, [width], bias=False,
                                                                   kernels=kernels, method=method.for_lm_head())
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps, kernels)

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor, decode: bool) -> torch.Tensor:
        """[T, layers, p]: each token's per-layer embedding (scaled by sqrt(p) in the model dtype) and the normed
        projection of its input embedding `h`, averaged by 2^-1/2 (transformers' project_per_layer_inputs)."""
        p, n = self.cfg.per_layer_input_size, self.cfg.num_layers
        own = self.embed_tokens_per_layer(ids) * torch.tensor(p**0.5, dtype=h.dtype)
        proj = self.per_layer_model_projection(h, decode) * self.cfg.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.reshape(-1, n, p))
        return (proj + own.reshape(-1, n, p)) * 2**-0.5

    def decode_layers(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, rope) -> torch.Tensor:
        per_layer = (self._per_layer_inputs(batch.input_ids, h, batch.is_decode)
                     if self.cfg.per_layer_input_size else None)
        ats = (self.rope.at(rope, h.dtype), self.local_rope.at(self.local_rope.table(batch.positions), h.dtype))
        shared: SharedKV = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, per_layer[:, i] if per_layer is not None else None, batch, attn,
                      ats[bool(self.cfg.window_of(i))], shared)
        if not batch.is_decode:
            h = h[batch.logits_indices]
        return self.norm(h)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        """Gemma4ForCausalLM's names as they are; a wrapped checkpoint's language model under model.language_model
        (its vision / audio towers left unread: this engine runs the text model)."""
        towers: list[str] = []

        def text_only() -> Iterable[tuple[str, Weight]]:
            for name, tensor in weights:
                if name.startswith(_TOWERS):
                    towers.append(name)
                    continue
                yield name.replace("model.language_model.", "model.", 1), tensor

        used = super().load_weights(text_only())
        if towers:
            log.warning("Gemma 4: %d vision / audio tower tensors left unread (this engine serves its text model)",
                        len(towers))
        return used
