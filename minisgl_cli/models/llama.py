"""The decoder for Llama, Mistral, Qwen2, Qwen3, gpt-oss and their MoE kin over flat token batches: one class,
config switches.

Qwen3-MoE, Mixtral and gpt-oss are the same decoder with a sparse MoE block (layers/moe.py) in place of the dense
MLP in the layers their config makes sparse (ModelConfig.is_moe_layer). Each layer attends fully or through its
sliding window (ModelConfig.window_of: Mistral's sliding_window, gpt-oss's alternating layers), with gpt-oss's
sinks where the config has them."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kernels.fp8 import Fp8Rows
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl_cli.layers.moe import EXPERT_PROJ, Experts, MoE, SwiGLU, fp8_expert_blocks, grouped_mm_runs
from minisgl_cli.layers.norm import LayerOut, RMSNorm, rows_of
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.layers.rotary import MRotaryEmbedding, RopeTable, RotaryEmbedding
from minisgl_cli.loader.hf import Weight, whole
from minisgl_cli.models.config import ModelConfig

RopeAt = tuple[torch.Tensor, torch.Tensor]  # RotaryEmbedding.at(positions, dtype): one step's cos, sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        self.layer_id = layer_id
        self.rope = rope
        self.kernels = kernels
        self.head_dim = d = cfg.head_dim
        heads = cfg.heads_of(tp.rank, tp.size)
        self.num_heads, self.num_kv_heads = heads.n_q, heads.n_kv
        q, kv = (heads.q_start * d, heads.n_q * d), (heads.kv_start * d, heads.n_kv * d)
        sizes = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, sizes, bias=cfg.attention_bias, tp=tp, ranges=[q, kv, kv],
                                             kernels=kernels, method=method)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=cfg.o_bias, tp=tp, in_range=q,
                                        kernels=kernels, method=method)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, kernels) if cfg.qk_norm else None
        self.window = cfg.window_of(layer_id)  # 0: full attention
        self.q_start = heads.q_start
        # gpt-oss: a learned logit per query head in each softmax's denominator (this rank's heads), kept fp32
        self.sinks = (nn.Parameter(torch.zeros(heads.n_q, dtype=torch.float32), requires_grad=False)
                      if cfg.attn_sinks else None)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        if name != "sinks" or self.sinks is None:
            raise KeyError(f"checkpoint has an attention {name!r} this layer was built without")
        self.sinks.data.copy_(whole(loaded.narrow(0, self.q_start, self.num_heads)))

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return self.qkv_proj.takes_fp8_rows(x)

    def forward(self, x: torch.Tensor | Fp8Rows, batch: ForwardBatch, attn: AttentionBackend, rope: RopeTable,
                rope_at: RopeAt | None) -> LayerOut:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self._qkv_rope_kv(x, batch, attn, rope)
        if qkv is not None:  # rotated, K/V stored: what the branches below do after the projection
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            o = attn.forward(q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                             v.view(-1, self.num_kv_heads, self.head_dim), self.layer_id, batch, kv_stored=True,
                             window=self.window, sinks=self.sinks)
            return self.o_proj.to_norm(o.reshape(-1, q_size), batch.is_decode)
        qkv = self.qkv_proj(x, batch.is_decode)
        sgl = self.kernels.sgl_ops(qkv)  # --engine sgl: its RoPE (and RMSNorm) below, attention stores K/V
        ops = self.kernels.triton(qkv) if sgl is None and self.head_dim in (64, 128, 256) else None
        kv_out = attn.kv_buffers(self.layer_id, batch) if ops is not None else None
        if ops is not None:  # one kernel: q/k head norms and RoPE in place on the fused qkv rows, K/V to the pool
            qn, kn = self.q_norm, self.k_norm
            ops.qk_norm_rope_(
                qkv, rope.rows, rope.cos, rope.sin, self.num_heads, self.num_kv_heads,
                self.head_dim, qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                qn.eps if qn is not None else 0.0, kv_out, pdl=self.kernels.pdl,
            )
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if ops is None and sgl is not None:
            if self.q_norm is not None and self.k_norm is not None:  # both or neither (cfg.qk_norm)
                q, k = self.q_norm(q), self.k_norm(k)
            self.rope.apply_sgl_(sgl, rope, q, k)
        elif ops is None:
            at = rope_at if rope_at is not None else self.rope.at(rope, qkv.dtype)
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.rope.rotate(self.q_norm(q), at), self.rope.rotate(self.k_norm(k), at)
            else:  # q and k sit side by side in qkv: one rotation for both
                qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
                qk = self.rope.rotate(qk, at)
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = attn.forward(q, k, v, self.layer_id, batch, kv_stored=kv_out is not None, window=self.window,
                         sinks=self.sinks)
        return self.o_proj.to_norm(o.reshape(-1, q_size), batch.is_decode)  # for post_attention_layernorm

    def _qkv_rope_kv(self, x: torch.Tensor | Fp8Rows, batch: ForwardBatch, attn: AttentionBackend,
                     rope: RopeTable) -> torch.Tensor | None:
        """The qkv projection with RoPE and the K/V store in its GEMV's epilogue, where the kernels have that for x
        (a few CUDA rows: Kernels.qkv_rope) and this layer needs nothing between them (no q/k norm): the rotated
        rows, K/V in the pool. Else None."""
        if (isinstance(x, Fp8Rows) or self.q_norm is not None or self.kernels.sgl_ops(x) is not None
                or self.kernels.qkv_rope(x, self.qkv_proj.weight) is None):
            return None
        kv_out = attn.kv_buffers(self.layer_id, batch)
        if kv_out is None:
            return None
        return self.qkv_proj.forward_rope_kv(x, rope, (self.num_heads, self.num_kv_heads, self.head_dim), kv_out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPInfo, kernels: Kernels, method: LinearMethod):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=False, tp=tp,
                                                 kernels=kernels, method=method)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, tp=tp, kernels=kernels,
                                           method=method)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        return self.gate_up_proj.takes_fp8_rows(x)

    def forward(self, x: torch.Tensor | Fp8Rows, decode: bool) -> LayerOut:
        """`decode`: a decode step's rows (a quantized method's low-bit copy takes them: layers/quant.py). The
        next layer's input norm (or the final norm) takes the result: it may stay a `Partial` sum for it."""
        act = self.gate_up_proj.forward_gate_up_silu(x)  # a few CUDA rows: the SiLU-and-mul in the GEMV's epilogue
        if act is not None:
            return self.down_proj.to_norm(act, decode)
        return self.down_proj.to_norm(self.gate_up_proj(x, decode), decode, silu_mul=True)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.self_attn = Attention(cfg, layer_id, rope, tp, kernels, method)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.mlp: MLP | MoE = (
            MoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                cfg.norm_topk_prob, tp, kernels, fp8=method.name == "fp8", copies=method,
                swiglu=SwiGLU(cfg.swiglu_limit, cfg.swiglu_alpha) if cfg.swiglu_limit else None,
                mxfp4=method.name == "mxfp4", fp8_block=fp8_expert_blocks(method, cfg.moe_intermediate_size, tp))
            if cfg.is_moe_layer(layer_id) else MLP(cfg, tp, kernels, method)
        )

    def forward(
        self, h: LayerOut, residual: torch.Tensor | None, batch: ForwardBatch, attn: AttentionBackend,
        rope: RopeTable, rope_at: RopeAt | None,
    ) -> tuple[LayerOut, torch.Tensor]:
        """(the layer's output, the residual): the output may be a TP rank's `Partial` sum or the MoE experts'
        `Terms`, for the next norm to sum."""
        x: torch.Tensor | Fp8Rows  # a norm's output: FP8 codes where the linear after it takes them
        if residual is None:
            assert isinstance(h, torch.Tensor)  # the first layer's input: the embeddings
            residual, x = h, self.input_layernorm(h)
        else:
            fp8 = self.self_attn.takes_fp8_rows(rows_of(h))
            x, residual = self.input_layernorm.forward_residual(h, residual, fp8)
        h = self.self_attn(x, batch, attn, rope, rope_at)
        fp8 = self.mlp.takes_fp8_rows(rows_of(h))
        x, residual = self.post_attention_layernorm.forward_residual(h, residual, fp8)
        return self.mlp(x, batch.is_decode), residual


# HF checkpoint names that land in one of our merged parameters: (our name, shard index).
_MERGED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# One expert's matrix in a checkpoint: Qwen3-MoE's mlp.experts.E.{gate,up,down}_proj, Mixtral's
# block_sparse_moe.experts.E.w{1,3,2} (its gate is block_sparse_moe.gate: our mlp.gate).
_EXPERT = re.compile(r"(?P<layer>layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\.(?P<proj>\w+)\.weight")


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral; Qwen2 (bias on q/k/v), Qwen3 (q/k norm), Qwen3-MoE and Mixtral (MoE blocks) differ only
    by config switches.

    `kernels` is the engine's choice of implementation, shared by every layer of this model; `method` how its
    linear layers and LM head hold their weights (layers/quant.py: dense, int4, int8, fp8; a method may keep
    some decoder layers dense: `for_layer`)."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.kernels = kernels = kernels or Kernels()
        method = method or LinearMethod()
        self.rope = (RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
                     if cfg.vision is None else  # a VLM's decoder: M-RoPE
                     MRotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.vision.mrope_section))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.rope, tp, kernels, method.for_layer(i, cfg.num_layers))
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, kernels, method.for_lm_head(),
                                      tied=self.embed_tokens if cfg.tie_word_embeddings else None)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        """Hidden states of each request's last token: [B, hidden]."""
        return self.decode_layers(self.embed_tokens(batch.input_ids), batch, attn, self.rope.table(batch.positions))

    def decode_layers(self, h: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                      rope: RopeTable) -> torch.Tensor:
        """The decoder over the step's input embeddings `h` [T, hidden], each token turned by `rope`'s row: hidden
        states of each request's last token [B, hidden]."""
        residual = None
        h_: LayerOut = h
        rope_at = self._rope_at(h, rope)
        for layer in self.layers:
            h_, residual = layer(h_, residual, batch, attn, rope, rope_at)
        assert residual is not None  # set by the first layer
        if batch.keep_hidden:  # every row's normed state for MTP drafts (a row's norm is the same whatever its batch)
            h, _ = self.norm.forward_residual(h_, residual)
            batch.hidden = h
            return h if batch.is_decode else h[batch.logits_indices]
        if not batch.is_decode:  # only each request's last token is sampled
            idx = batch.logits_indices
            h_ = h_[idx] if isinstance(h_, torch.Tensor) else h_.select(idx)
            residual = residual[idx]
        h, _ = self.norm.forward_residual(h_, residual)
        return h

    def _rope_at(self, h: torch.Tensor, rope: RopeTable) -> RopeAt | None:
        """The torch RoPE's cos / sin of this step's positions, once for every layer (CUDA's fused ops need none)."""
        fused = self.kernels.triton(h) is not None or self.kernels.sgl_ops(h) is not None
        return None if fused else self.rope.at(rope, h.dtype)

    def graph_safe(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a forward makes no host sync there, so CUDA graphs can capture it (MoE experts: the grouped GEMM,
        or the fused Triton experts, which take every batch size where the grouped GEMM is missing)."""
        fused = device.type == "cuda" and self.kernels.fused and dtype in (torch.bfloat16, torch.float16)
        return not self.cfg.num_experts or grouped_mm_runs(device, dtype) or fused

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, vocab] in the model dtype: the sampler widens to fp32 only where it computes on them."""
        return self.lm_head.logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        """Copy HF-named tensors (or quantized groups) in, streamed one by one, each layer reading its rank's part,
        then let each layer finish its weights (quantized methods pack them); returns the HF names it used."""
        modules = dict(self.named_modules())
        used: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
                continue
            path = name.removeprefix("model.")
            expert = _EXPERT.fullmatch(path)
            if expert is not None and f"{expert['layer']}.mlp.experts" in modules:
                experts = modules[f"{expert['layer']}.mlp.experts"]
                assert isinstance(experts, Experts)
                experts.load_expert(int(expert["e"]), EXPERT_PROJ[expert["proj"]], tensor)
                used.add(name)
                continue
            # Mixtral's block_sparse_moe and gpt-oss's router: our mlp and its gate
            mod_path, _, leaf = path.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.", ".mlp.gate.") \
                .rpartition(".")
            owner, _, short = mod_path.rpartition(".")
            shard = 0
            if short in _MERGED:
                short, shard = _MERGED[short]
                mod_path = f"{owner}.{short}"
            module = modules.get(mod_path)
            if module is None or not hasattr(module, "load_shard"):
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            module.load_shard(leaf, tensor, shard)
            used.add(name)
        for module in modules.values():
            if hasattr(module, "finish_loading"):
                module.finish_loading()
        return used


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass


class MixtralForCausalLM(LlamaForCausalLM):
    pass


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss: windowed and full layers alternating, a sink per head, biases on the attention's projections, and
    MoE blocks of biased experts with the clamped SwiGLU (config switches of the one decoder)."""
