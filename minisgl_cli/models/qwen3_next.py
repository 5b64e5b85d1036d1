"""Qwen3-Next and Qwen3.5 text (dense and MoE): Gated DeltaNet linear-attention layers and gated full attention.

What differs from llama.py, each as transformers' qwen3_next / qwen3_5 / qwen3_5_moe compute it: three of every four
layers (the config's layer_types) are Gated DeltaNet — one projection to the mixed q, k, v, the output gate z and the
per-head b and a; a causal depthwise conv (kernel 4) with SiLU over the mixed q, k, v; the gated delta rule
(attention/gated_delta.py) with beta = sigmoid(b) and log decay g = -exp(A_log) softplus(a + dt_bias), q and k
L2-normalized; an RMSNorm of each head's output gated by SiLU(z); the output projection. Their state lives in the
request's state slot (kvcache/state.py), so only the full-attention layers hold KV pages. The full-attention layers
project a query and an output gate per head, normalize q and k per head, turn only the first rotary_dim channels
of each head by RoPE, and multiply the attention's output by sigmoid(gate). Every RMSNorm but the DeltaNet's output
norm scales by (1 + w) (loaded as 1 + w, as Gemma's). MoE layers add a shared expert gated by sigmoid to the routed
experts. Qwen3-Next's checkpoints fuse q, k, v, z (and b, a) grouped per key head: they are reordered on loading
into Qwen3.5's split layout, so one forward serves both. Qwen3.5's hub checkpoints (Qwen3_5ForConditionalGeneration)
load their language model; their vision tower is skipped, and so is the MTP layer (models/mtp.py loads it for
`--speculative-algorithm mtp`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.attention import gated_delta
from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kvcache.state import StatePool, StateShape
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import ColumnParallelLinear, RowParallelLinear
from minisgl_cli.layers.moe import Gate, MoE, fp8_expert_blocks
from minisgl_cli.layers.norm import LayerOut
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.layers.rotary import RopeTable, RotaryEmbedding
from minisgl_cli.loader.hf import Weight, whole
from minisgl_cli.models.config import ModelConfig
from minisgl_cli.models.gemma3 import GemmaRMSNorm, summed
from minisgl_cli.models.llama import MLP, LlamaForCausalLM, RopeAt


def linear_heads(cfg: ModelConfig, tp: TPInfo) -> tuple[int, int]:
    """One TP rank's (key heads, value heads) of the linear-attention layers: an even split of whole key heads, each
    with its group of value heads."""
    la = cfg.linear_attn
    assert la is not None  # a hybrid's config
    if la.num_k_heads % tp.size:
        raise ValueError(f"--tp {tp.size} must divide the {la.num_k_heads} linear-attention key heads of "
                         f"{cfg.architecture}")
    return la.num_k_heads // tp.size, la.num_v_heads // tp.size


def state_shape(cfg: ModelConfig, dtype: torch.dtype, tp: TPInfo = TPInfo()) -> StateShape:
    """The state a request holds on one TP rank across this model's linear-attention layers (one slot of
    kvcache/state.py)."""
    la = cfg.linear_attn
    assert la is not None
    hk, hv = linear_heads(cfg, tp)
    return StateShape(len(la.layers), 2 * hk * la.head_k_dim + hv * la.head_v_dim, la.conv_kernel - 1, hv,
                      la.head_k_dim, la.head_v_dim, dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (plain weight w), then times SiLU(z) in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        self.weight.data.copy_(whole(loaded))

    def forward(self, x: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        h = x.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(z.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; `index` is its place among the model's linear layers (its state in each slot)."""

    pool: StatePool | None = None  # set by the engine (bind_state) before the first forward
    # a verify step's (request slots, runs, conv inputs, delta-rule inputs, whether fused) until `commit`
    pending: tuple[torch.Tensor, list[int], torch.Tensor, tuple[torch.Tensor, ...], bool] | None = None

    def __init__(self, cfg: ModelConfig, index: int, tp: TPInfo, kernels: Kernels, method: LinearMethod):
        super().__init__()
        la = cfg.linear_attn
        assert la is not None
        self.la, self.index, self.kernels = la, index, kernels
        # This rank's heads: key heads [k0, k0 + hk) and their value heads [v0, v0 + hv), in every part of the input
        # projection, the conv's channels, A_log / dt_bias and the output projection's columns.
        self.hk, self.hv = hk, hv = linear_heads(cfg, tp)
        k0, v0 = tp.rank * hk, tp.rank * hv
        dk, dv = la.head_k_dim, la.head_v_dim
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.v0 = v0
        self.sizes = [la.key_dim, la.key_dim, la.value_dim, la.value_dim, la.num_v_heads, la.num_v_heads]
        ranges = [(k0 * dk, hk * dk)] * 2 + [(v0 * dv, hv * dv)] * 2 + [(v0, hv)] * 2
        self.in_proj = ColumnParallelLinear(cfg.hidden_size, self.sizes, bias=False, tp=tp, ranges=ranges,
                                            kernels=kernels, method=method)
        # This rank's conv channels, picked from the checkpoint's tensor on the host at load (the model may be built
        # under a CUDA default device)
        rows = [torch.arange(k0 * dk, (k0 + hk) * dk, device="cpu"),
                la.key_dim + torch.arange(k0 * dk, (k0 + hk) * dk, device="cpu"),
                2 * la.key_dim + torch.arange(v0 * dv, (v0 + hv) * dv, device="cpu")]
        self.conv_rows = torch.cat(rows)
        self.conv_weight = nn.Parameter(torch.empty(len(self.conv_rows), la.conv_kernel), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(hv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hv, dtype=torch.float32), requires_grad=False)
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(la.value_dim, cfg.hidden_size, tp=tp, in_range=(v0 * dv, hv * dv),
                                          kernels=kernels, method=method)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        """The checkpoint's own tensors of this layer: A_log, dt_bias, conv1d.weight and the input projections
        (Qwen3.5's in_proj_qkv / _z / _b / _a, Qwen3-Next's in_proj_qkvz / _ba)."""
        la = self.la
        if name in ("A_log", "dt_bias"):
            getattr(self, name).data.copy_(whole(loaded).float()[self.v0 : self.v0 + self.hv])
        elif name == "conv1d.weight":
            w = whole(loaded).reshape(la.conv_dim, la.conv_kernel)
            self.conv_weight.data.copy_(w[self.conv_rows.to(w.device)])
        elif name == "in_proj_qkv":
            for i, part in enumerate(whole(loaded).split(self.sizes[:3])):
                self.in_proj.load_shard("weight", part, i)
        elif name in ("in_proj_z", "in_proj_b", "in_proj_a"):
            self.in_proj.load_shard("weight", loaded, {"in_proj_z": 3, "in_proj_b": 4, "in_proj_a": 5}[name])
        elif name in ("in_proj_qkvz", "in_proj_ba"):
            # Rows grouped per key head g: [q_g, k_g, v_g, z_g] (each value part r = Hv / Hk heads) and [b_g, a_g]
            r = la.num_v_heads // la.num_k_heads
            w = whole(loaded)
            parts = ([la.head_k_dim, la.head_k_dim, r * la.head_v_dim, r * la.head_v_dim] if name == "in_proj_qkvz"
                     else [r, r])
            grouped = w.reshape(la.num_k_heads, sum(parts), w.shape[-1]).split(parts, dim=1)
            first = 0 if name == "in_proj_qkvz" else 4
            for i, part in enumerate(grouped):
                self.in_proj.load_shard("weight", part.reshape(-1, w.shape[-1]), first + i)
        else:
            raise KeyError(f"checkpoint has a linear-attention {name!r} this layer was built without")

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> LayerOut:
        la, pool, hk, hv = self.la, self.pool, self.hk, self.hv
        assert pool is not None, "the engine binds the state pool before the first forward"
        decode = batch.is_decode
        mixed, z, b, a = self.in_proj(x, decode).split([2 * self.key_dim + self.value_dim, self.value_dim, hv, hv],
                                                       dim=-1)
        slots = pool.slot_of_row[batch.req_rows]
        conv, ssm = pool.conv[self.index], pool.ssm[self.index]
        runs = batch.runs
        if runs is not None:  # a verify step: each request's slot (that of its first row), the states left alone
            slots = slots[gated_delta.first_rows(tuple(runs), slots.device)]
            mixed, seq = gated_delta.conv_verify(mixed, self.conv_weight, conv, slots, runs)
        elif decode:
            # A captured decode graph's padded rows (KV slot 0, the scratch page) must not touch a live request's
            # state: they update the scratch state slot.
            slots = torch.where(batch.out_cache_loc == 0, pool.scratch, slots)
            mixed = gated_delta.conv_step(mixed, self.conv_weight, conv, slots)
        else:
            mixed = gated_delta.conv_prefill(mixed, self.conv_weight, conv, slots, batch.extend_lens_cpu)
        T = x.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, hk, la.head_k_dim)
        k = k.reshape(T, hk, la.head_k_dim)
        v = v.reshape(T, hv, la.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.exp() * F.softplus(a.float() + self.dt_bias)
        # CUDA with the fused ops on, 16-bit (fp32 is the exact mode: torch's sums): a request's rows in one launch
        fused = q.dtype != torch.float32 and self.kernels.triton(q) is not None
        if runs is not None:
            o, inputs = gated_delta.verify(q, k, v, g, beta, ssm, slots, runs, fused)
            self.pending = (slots, runs, seq, inputs, fused)
        elif decode:
            o = gated_delta.decode(q, k, v, g, beta, ssm, slots, fused)
        else:
            o = gated_delta.prefill(q, k, v, g, beta, ssm, slots, batch.extend_lens_cpu)
        o = self.norm(o, z.reshape(T, hv, la.head_v_dim), x.dtype)
        return self.out_proj.to_norm(o.reshape(T, self.value_dim), decode)


    def commit(self, accepted: list[int]) -> None:
        """After the verify step this layer last ran: each request's state over its `accepted` rows."""
        assert self.pending is not None and self.pool is not None, "a commit follows a verify step"
        slots, runs, seq, inputs, fused = self.pending
        self.pending = None
        gated_delta.conv_commit(self.pool.conv[self.index], slots, seq, runs, accepted)
        gated_delta.commit(inputs, self.pool.ssm[self.index], slots, runs, accepted, fused)


class GatedAttention(nn.Module):
    """Full attention with a sigmoid output gate per channel, (1 + w) q/k head norms and RoPE on the first
    rotary_dim channels of each head."""

    def __init__(self, cfg: ModelConfig, kv_layer: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        self.kv_layer, self.rope = kv_layer, rope
        heads = cfg.heads_of(tp.rank, tp.size)  # this rank's: whole GQA groups (ModelConfig.heads_of)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.n_q, heads.n_kv, cfg.head_dim
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        d = cfg.head_dim
        # q_proj holds each head's query and then its gate: [q_0, gate_0, q_1, gate_1, ...]
        kv = (heads.kv_start * d, heads.n_kv * d)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [2 * cfg.num_heads * d, cfg.num_kv_heads * d,
                                                               cfg.num_kv_heads * d], bias=cfg.attention_bias, tp=tp,
                                             ranges=[(2 * heads.q_start * d, 2 * heads.n_q * d), kv, kv],
                                             kernels=kernels, method=method)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, bias=False, tp=tp,
                                        in_range=(heads.q_start * d, heads.n_q * d), kernels=kernels, method=method)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, kernels)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, kernels)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend, rope: RopeTable,
                rope_at: RopeAt | None) -> LayerOut:
        T, H, Hkv, d, rd = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim
        qg, k, v = self.qkv_proj(x, batch.is_decode).split([2 * H * d, Hkv * d, Hkv * d], dim=-1)
        q, gate = qg.reshape(T, H, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q.reshape(T * H, d)).view(T, H, d)  # as rows: every RMSNorm kernel takes those
        k = self.k_norm(k.reshape(T * Hkv, d)).view(T, Hkv, d)
        at = rope_at if rope_at is not None else self.rope.at(rope, x.dtype)
        q = torch.cat([self.rope.rotate(q[..., :rd], at), q[..., rd:]], dim=-1)
        k = torch.cat([self.rope.rotate(k[..., :rd], at), k[..., rd:]], dim=-1)
        o = attn.forward(q, k, v.reshape(T, Hkv, d).contiguous(), self.kv_layer, batch)
        o = o.reshape(T, H * d) * torch.sigmoid(gate.reshape(T, H * d))
        return self.o_proj.to_norm(o, batch.is_decode)


class SharedExpertMoE(MoE):
    """The routed experts plus one shared expert whose output is scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo, kernels: Kernels, method: LinearMethod):
        super().__init__(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                         cfg.norm_topk_prob, tp, kernels, fp8=method.name == "fp8", copies=method,
                         fp8_block=fp8_expert_blocks(method, cfg.moe_intermediate_size, tp))
        self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size), tp,
                                 kernels, method)
        self.shared_expert_gate = Gate(cfg.hidden_size, 1, kernels)

    def forward(self, x: torch.Tensor, decode: bool = False) -> torch.Tensor:  # type: ignore[override]
        routed = summed(super().forward(x, decode))
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * summed(self.shared_expert(x, decode))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rope: RotaryEmbedding, tp: TPInfo, kernels: Kernels,
                 method: LinearMethod):
        super().__init__()
        la = cfg.linear_attn
        assert la is not None
        eps, h = cfg.rms_norm_eps, cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(h, eps, kernels)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, kernels)
        self.linear_attn = GatedDeltaNet(cfg, la.layers.index(layer_id), tp, kernels, method) \
            if layer_id in la.layers else None
        self.self_attn = GatedAttention(cfg, cfg.kv_layers.index(layer_id), rope, tp, kernels, method) \
            if layer_id not in la.layers else None
        self.mlp: nn.Module
        if cfg.is_moe_layer(layer_id) and cfg.shared_expert_intermediate_size:
            self.mlp = SharedExpertMoE(cfg, tp, kernels, method)
        elif cfg.is_moe_layer(layer_id):
            self.mlp = MoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                           cfg.norm_topk_prob, tp, kernels, fp8=method.name == "fp8", copies=method,
                           fp8_block=fp8_expert_blocks(method, cfg.moe_intermediate_size, tp))
        else:
            self.mlp = MLP(cfg, tp, kernels, method)

    def forward(self, h: LayerOut, residual: torch.Tensor | None, batch: ForwardBatch, attn: AttentionBackend,
                rope: RopeTable, rope_at: RopeAt | None) -> tuple[LayerOut, torch.Tensor]:
        if residual is None:
            assert isinstance(h, torch.Tensor)  # the embeddings
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm.forward_residual(h, residual)
        if self.linear_attn is not None:
            h = self.linear_attn(x, batch)
        else:
            assert self.self_attn is not None
            h = self.self_attn(x, batch, attn, rope, rope_at)
        x, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(x, batch.is_decode), residual


# A linear-attention tensor the layer loads itself (its names are no module of ours)
_LINEAR = re.compile(r"(?P<layer>layers\.\d+\.linear_attn)\.(?P<name>in_proj_\w+|A_log|dt_bias|conv1d\.weight)"
                     r"(?:\.weight)?")


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Qwen3-Next (transformers' qwen3_next) and the Qwen3.5 text models (qwen3_5_text, qwen3_5_moe_text): one
    class, config switches. A speculative verify step leaves the linear layers' states to `commit_verify`. Under TP
    each rank holds whole key heads of the linear layers (with their value heads) and whole GQA groups of the
    full-attention ones."""

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        nn.Module.__init__(self)
        linear_heads(cfg, tp)  # refuses a TP size that splits a linear layer's key head
        self.cfg, self.tp = cfg, tp
        self.kernels = kernels = kernels or Kernels()
        method = method or LinearMethod()
        self.rope = RotaryEmbedding(cfg.rotary_dim or cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                    cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, i, self.rope, tp, kernels,
                                                       method.for_layer(i, cfg.num_layers))
                                    for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, kernels, method.for_lm_head(),
                                      tied=self.embed_tokens if cfg.tie_word_embeddings else None)

    def bind_state(self, pool: StatePool) -> None:
        """The engine's state slots: where each linear layer keeps its requests' states."""
        self.linear = [m for m in self.modules() if isinstance(m, GatedDeltaNet)]  # commit_verify's, every verify step
        for module in self.linear:
            module.pool = pool

    def commit_verify(self, accepted: list[int]) -> None:
        """After a verify step: each request's linear-attention states over its first accepted[i] rows."""
        for module in self.linear:
            module.commit(accepted)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        modules = dict(self.named_modules())
        used: set[str] = set()

        def rest() -> Iterator[tuple[str, Weight]]:
            for name, tensor in weights:
                # the multi-token-prediction layer (models/mtp.py's); a Qwen3.5 checkpoint's vision tower
                if name.startswith(("mtp.", "model.visual.", "visual.")):
                    continue
                name = name.replace("model.language_model.", "model.", 1)  # a Qwen3.5 checkpoint's language model
                m = _LINEAR.fullmatch(name.removeprefix("model."))
                if m is None:
                    yield name, tensor
                    continue
                layer = modules[m["layer"]]
                assert isinstance(layer, GatedDeltaNet)
                layer.load_shard(m["name"], tensor)
                used.add(name)

        loaded = super().load_weights(rest())
        return used | loaded


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    pass


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    pass
