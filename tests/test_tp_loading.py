"""Tensor-parallel loading: each rank reads only its shard of the checkpoint, and the shards make the whole."""

from __future__ import annotations

import pytest
import torch

from minisgl_cli.distributed import TPInfo
from minisgl_cli.loader import hf
from minisgl_cli.models import ModelConfig, create_model


def _load(model_dir, rank: int, size: int, monkeypatch) -> tuple[torch.nn.Module, int, int]:
    """The model of `rank` loaded from the checkpoint, and (elements read, elements in the checkpoint)."""
    read = [0]
    real_narrow, real_full = hf.LazyTensor.narrow, hf.LazyTensor.full

    def narrow(self, dim, start, length):
        out = real_narrow(self, dim, start, length)
        read[0] += out.numel()
        return out

    def full(self):
        out = real_full(self)
        read[0] += out.numel()
        return out

    monkeypatch.setattr(hf.LazyTensor, "narrow", narrow)
    monkeypatch.setattr(hf.LazyTensor, "full", full)
    mc = ModelConfig.from_hf(hf.read_hf_config(model_dir))
    model = create_model(mc, TPInfo(rank, size))
    total = 0
    for name, t in hf.iter_safetensors(model_dir):
        total += t.shape.numel()
        model.load_weights([(name, t)])
    return model, read[0], total


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_each_tp_rank_reads_only_its_shard(tiny_model_dirs, arch, monkeypatch):
    model_dir = tiny_model_dirs[arch]
    whole, read1, total = _load(model_dir, 0, 1, monkeypatch)
    assert read1 == total  # TP 1 reads the checkpoint once, nothing twice
    ranks = [_load(model_dir, r, 2, monkeypatch) for r in range(2)]
    for _, read, _ in ranks:
        # Matrices are split in two; only the small norm vectors are read whole by both ranks.
        assert read < 0.55 * total
    w = {n: p for n, p in whole.named_parameters()}
    parts = [{n: p for n, p in m.named_parameters()} for m, _, _ in ranks]
    q = "layers.0.self_attn.qkv_proj.weight"
    o = "layers.0.self_attn.o_proj.weight"
    # Column-split rows and row-split columns put back together are the TP 1 weights.
    assert torch.equal(torch.cat([p[o] for p in parts], dim=1), w[o])
    assert sum(p[q].shape[0] for p in parts) == w[q].shape[0]
    assert torch.equal(parts[0]["norm.weight"], w["norm.weight"])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_each_tp_rank_reads_only_its_slice_of_every_expert(tiny_moe_dirs, arch, monkeypatch):
    model_dir = tiny_moe_dirs[arch]
    whole, read1, total = _load(model_dir, 0, 1, monkeypatch)
    assert read1 == total
    ranks = [_load(model_dir, r, 2, monkeypatch) for r in range(2)]
    for _, read, _ in ranks:  # experts split in two like the dense MLP; the routers are read whole by both
        assert read < 0.55 * total
    w = {n: p for n, p in whole.named_parameters()}
    parts = [{n: p for n, p in m.named_parameters()} for m, _, _ in ranks]
    gate_up, down = "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj"
    assert torch.equal(torch.cat([p[down] for p in parts], dim=2), w[down])
    n = parts[0][gate_up].shape[1] // 2  # each rank: [its gate rows; its up rows] of every expert
    gates, ups = zip(*(p[gate_up].split(n, dim=1) for p in parts))
    assert torch.equal(torch.cat(gates + ups, dim=1), w[gate_up])
    assert torch.equal(parts[1]["layers.0.mlp.gate.weight"], w["layers.0.mlp.gate.weight"])
