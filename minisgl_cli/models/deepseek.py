"""DeepSeek-V2 / V3 (and V2-Lite): MLA attention over a latent KV cache, and MoE of shared plus routed experts.

What differs from llama.py, each as transformers' DeepseekV2ForCausalLM / DeepseekV3ForCausalLM computes it:
  attention  queries through q_a_proj, q_a_layernorm, q_b_proj (q_lora_rank) or one q_proj (V2-Lite); keys and
             values from kv_a_proj_with_mqa's latent (kv_lora_rank, normalized by kv_a_layernorm) through kv_b_proj,
             plus one rope key every head shares; the KV pool keeps only [latent | rope key] a token
             (attention/mla.py: prefill expanded, decode absorbed); the softmax scale with YaRN's mscale
             (ModelConfig.mla.scale)
  rope       over qk_rope_head_dim only; where the checkpoint lays its rope dims out in (x0, x1) pairs (V2's
             complex rotation, V3's rope_interleave) the q and k rows are permuted to halves as they load, so the
             rotation is the engine's own (the same numbers: transformers' interleaved rotation writes its output as
             halves too; V2's complex one keeps pairs, which only reorders the terms of the q . k sum)
  MoE        layers/moe.py with DeepSeek's router (GroupedRouting) and the shared experts; the first
             first_k_dense_replace layers dense
MTP layers a checkpoint ships beyond num_hidden_layers are skipped here (transformers skips them too; models/mtp.py
loads the first as the draft of `--speculative-algorithm mtp`). TP splits the heads
(q_b_proj / q_proj, kv_b_proj, o_proj) and the experts; the low-rank projections and the latent are whole on every
rank."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.attention.mla import MlaBackend
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl_cli.layers.moe import MoE, fp8_expert_blocks, grouped_mm_runs
from minisgl_cli.layers.norm import LayerOut, RMSNorm
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.layers.rotary import RopeTable, RotaryEmbedding
from minisgl_cli.loader.blocks import Fp8Blocks
from minisgl_cli.loader.hf import Weight, whole
from minisgl_cli.models.config import MlaConfig, ModelConfig
from minisgl_cli.models.llama import MLP, DecoderLayer, LlamaForCausalLM, RopeAt


class MlaAttention(nn.Module):
    """One layer's MLA: this rank's heads' queries, the step's [latent | rope key] rows, kv_b_proj as the expansion
    (prefill) and as W_UK / W_UV (decode) for the backend (attention/mla.py's MlaWeights)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.layer_id, self.rope, self.m, self.kernels = layer_id, rope, m, kernels
        heads = cfg.heads_of(tp.rank, tp.size)
        self.num_heads = n = heads.n_q
        start = heads.q_start
        qk, kv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim + m.v_head_dim
        h, eps, bias = cfg.hidden_size, cfg.rms_norm_eps, cfg.attention_bias

        def whole_rows(size: int, in_features: int, with_bias: bool = False) -> ColumnParallelLinear:
            """A linear every rank holds whole (the low-rank projections)."""
            return ColumnParallelLinear(in_features, [size], bias=with_bias, tp=tp, ranges=[(0, size)],
                                        kernels=kernels, method=method)

        def head_rows(width: int, in_features: int, lm: LinearMethod = method) -> ColumnParallelLinear:
            """A linear whose rows are `width` per head: this rank's heads'."""
            return ColumnParallelLinear(in_features, [cfg.num_heads * width], bias=False, tp=tp,
                                        ranges=[(start * width, n * width)], kernels=kernels, method=lm)

        if m.q_lora_rank:
            self.q_a_proj = whole_rows(m.q_lora_rank, h, bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, eps, kernels)
            self.q_b_proj = head_rows(qk, m.q_lora_rank)
        else:
            self.q_proj = head_rows(qk, h)
        self.kv_a_proj_with_mqa = whole_rows(m.latent_dim, h, bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, eps, kernels)
        # dense whatever the method: decode reads its halves as W_UK and W_UV (attention/mla.py)
        self.kv_b_proj = head_rows(kv, m.kv_lora_rank, LinearMethod())
        self.o_proj = RowParallelLinear(cfg.num_heads * m.v_head_dim, h, bias=bias, tp=tp,
                                        in_range=(start * m.v_head_dim, n * m.v_head_dim), kernels=kernels,
                                        method=method)

    @property
    def w_uk(self) -> torch.Tensor:
        m = self.m
        return self.kv_b_proj.weight.view(self.num_heads, -1, m.kv_lora_rank)[:, : m.qk_nope_head_dim]

    @property
    def w_uv(self) -> torch.Tensor:
        m = self.m
        return self.kv_b_proj.weight.view(self.num_heads, -1, m.kv_lora_rank)[:, m.qk_nope_head_dim :]

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self.kv_b_proj(c).view(c.shape[0], self.num_heads, -1)
        return kv[..., : self.m.qk_nope_head_dim], kv[..., self.m.qk_nope_head_dim :]

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return False  # q_a_proj / q_proj and kv_a_proj_with_mqa both take the norm's rows: 16-bit

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, rope: RopeTable,
                rope_at: RopeAt | None) -> LayerOut:
        m, decode, n = self.m, batch.is_decode, self.num_heads
        assert isinstance(attn, MlaBackend)  # the engine builds one for MLA models
        q = (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, decode)), decode) if m.q_lora_rank
             else self.q_proj(x, decode)).view(-1, n, m.qk_nope_head_dim + m.qk_rope_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x, decode).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        at = rope_at if rope_at is not None else self.rope.at(rope, q.dtype)
        # A decode step's rows: both in place, one launch (the torch ops below are eight). Not a prefill's: a program
        # a head, its cos / sin loads apiece, is the layout ops.pick_rope_config found slow for thousands of tokens.
        ops = self.kernels.triton(q) if decode and q.dtype in (torch.bfloat16, torch.float16) else None
        if ops is not None:
            ops.rope_pair_(q_pe, k_pe, *at, pdl=self.kernels.pdl)
        else:
            q_pe, k_pe = self.rope.rotate(q_pe, at), self.rope.rotate(k_pe[:, None], at)[:, 0]
        latent = torch.cat((self.kv_a_layernorm(c), k_pe), dim=-1)
        o = attn.forward_mla(q_nope, q_pe, latent, self.layer_id, batch, self)
        return self.o_proj.to_norm(o.reshape(-1, n * m.v_head_dim), decode)


class DeepseekDecoderLayer(DecoderLayer):
    """Llama's layer (its forward) with MLA attention and DeepSeek's MoE blocks (routed plus shared experts)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        # not llama's Attention, but all DecoderLayer.forward asks of it (its call and takes_fp8_rows)
        self.self_attn = MlaAttention(cfg, layer_id, rope, tp, kernels, method)  # type: ignore[assignment]
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp: MLP | MoE
        if cfg.is_moe_layer(layer_id):
            shared = None
            if cfg.n_shared_experts:
                width = cfg.moe_intermediate_size * cfg.n_shared_experts
                shared = MLP(dataclasses.replace(cfg, intermediate_size=width), tp, kernels, method)
            self.mlp = MoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                           cfg.norm_topk_prob, tp, kernels, fp8=method.name == "fp8", copies=method,
                           routing=cfg.routing, shared_experts=shared,
                           fp8_block=fp8_expert_blocks(method, cfg.moe_intermediate_size, tp))
        else:
            self.mlp = MLP(cfg, tp, kernels, method)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 (transformers' DeepseekV3ForCausalLM); DeepSeek-V2 / V2-Lite differ by config (softmax routing,
    no q_lora_rank on Lite, rope always interleaved)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        nn.Module.__init__(self)
        if cfg.mla is None:
            raise ValueError(f"{cfg.architecture} needs its MLA config (kv_lora_rank, qk_rope_head_dim, ...)")
        self.cfg = cfg
        self.tp = tp
        self.kernels = kernels = kernels or Kernels()
        method = method or LinearMethod()
        self.rope = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, i, self.rope, tp, kernels,
                                                         method.for_layer(i, cfg.num_layers))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, kernels, method.for_lm_head(),
                                      tied=self.embed_tokens if cfg.tie_word_embeddings else None)

    def _rope_at(self, h: torch.Tensor, rope: RopeTable) -> RopeAt:
        return self.rope.at(rope, h.dtype)  # MLA rotates with torch always: once a step for every layer

    def graph_safe(self, device: torch.device, dtype: torch.dtype) -> bool:
        """DeepSeek's routing stays on the device; the experts are graph-safe where torch's grouped GEMM runs (the fused
        Triton experts route by softmax themselves, so DeepSeek's blocks do not take them)."""
        return not self.cfg.num_experts or grouped_mm_runs(device, dtype)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        direct: set[str] = set()

        def rest() -> Iterator[tuple[str, Weight]]:
            for name, tensor in self._as_loaded(weights):
                if name.endswith(".self_attn.q_proj.weight"):  # llama's loader would take it for a q/k/v shard
                    q_proj = self.get_submodule(name.removeprefix("model.").removesuffix(".weight"))
                    assert isinstance(q_proj, ColumnParallelLinear)
                    q_proj.load_shard("weight", tensor)
                    direct.add(name)
                    continue
                yield name, tensor

        return super().load_weights(rest()) | direct

    def _as_loaded(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """The checkpoint's tensors as this model takes them: MTP layers (past num_hidden_layers) left out, the rope
        rows of interleaved checkpoints permuted to halves (see the module docstring)."""
        m = self.cfg.mla
        assert m is not None
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        for name, tensor in weights:
            layer = _LAYER.match(name)
            if layer is not None and int(layer[1]) >= self.cfg.num_layers:
                continue
            if m.rope_interleave and name.endswith((".q_proj.weight", ".q_b_proj.weight")):
                yield name, _halves(tensor, qk, m.qk_nope_head_dim)
            elif m.rope_interleave and ".kv_a_proj_with_mqa." in name:
                yield name, _halves(tensor, m.latent_dim, m.kv_lora_rank)
            else:
                yield name, tensor


def _halves(w: Weight, width: int, start: int) -> Weight:
    """Rows of `w` in blocks of `width` (a head's), each block's rows start.. reordered from (x0, x1), (x2, x3)
    pairs to halves (x0, x2, ..., x1, x3, ...). Block-wise FP8 rows stay FP8 (DeepSeek-V3's rope rows never leave
    their 128-row block: loader/blocks.py's take_rows)."""
    rope = width - start
    order = torch.cat((torch.arange(start), start + torch.arange(0, rope, 2), start + torch.arange(1, rope, 2)))
    rows = (torch.arange(w.shape[0]).view(-1, width)[:, order]).reshape(-1)
    if isinstance(w, Fp8Blocks):
        return w.take_rows(rows)
    w = whole(w)
    return w[rows.to(w.device)]


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    pass


__all__ = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MlaConfig"]
