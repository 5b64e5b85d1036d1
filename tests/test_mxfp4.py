"""gpt-oss checkpoints with MXFP4 experts, loaded as shipped: a tiny gpt-oss whose stacked experts are packed as
the real checkpoints pack them (`*_blocks` uint8 e2m1 pairs, `*_scales` e8m0 per 32 values) gives greedy ids equal
to transformers fp32 loading the same directory (which dequantizes it); malformed pairs are refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import make_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_hf_parity import EXACT, hf_greedy

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.loader.errors import ModelLoadError

N_NEW = 16
_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, cols] -> (blocks [E, rows, cols / 32, 16], scales [E, rows, cols / 32]): each block's power of two
    the smallest that fits its largest value under 6, each value rounded to the nearest e2m1 code."""
    e, rows, cols = w.shape
    groups = w.float().reshape(e, rows, cols // 32, 32)
    exp = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0 ** -100) / 6.0)).to(torch.int32)
    scaled = groups / torch.pow(2.0, exp.float())[..., None]
    code = (scaled.abs()[..., None] - _MAGNITUDES).abs().argmin(-1) | ((scaled < 0).long() << 3)
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4), (exp + 127).to(torch.uint8)


def mxfp4_checkpoint(src, out, edit=None):
    """`src` (a bf16 gpt-oss checkpoint) with its experts MXFP4-packed as the hub's gpt-oss checkpoints are, and its
    config saying so; `edit(tensors)` changes the tensors before they are saved."""
    shutil.copytree(src, out)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(_EXPERTS):  # [E, cols, rows] -> packed along cols
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = pack_mxfp4(t.transpose(1, 2))
        else:
            tensors[name] = t
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def oss_bf16(out, tokenizer_dir, expert_scale: float = 4.0):
    """A tiny bf16 gpt-oss checkpoint: hidden 64, intermediate 32 (two and one 32-value blocks per row), windows of 8,
    sinks, 4 experts, their weights `expert_scale` x the init's scale (4: their rounding to MXFP4 changes the answers,
    so the test can tell)."""
    bf16 = make_tiny_checkpoint("gpt_oss", out, tokenizer_dir, sliding_window=8, num_hidden_layers=4,
                                num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, swiglu_limit=1.5,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 16})
    weights = load_file(str(bf16 / "model.safetensors"))
    save_file({k: v * expert_scale if k.endswith(_EXPERTS) else v for k, v in weights.items()},
              str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    return bf16


@pytest.fixture(scope="module")
def oss_dirs(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("mxfp4")
    bf16 = oss_bf16(root / "bf16", tokenizer_dir)
    return bf16, mxfp4_checkpoint(bf16, root / "mxfp4")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (4, 11, 19, 30)]


def test_mxfp4_experts_load_as_shipped_and_match_transformers(oss_dirs):
    bf16, packed = oss_dirs
    prompts = _prompts()
    theirs = hf_greedy(packed, prompts, N_NEW)  # transformers dequantizes the packed experts on the CPU
    assert len({tuple(t) for t in theirs}) > 1, "degenerate tiny model: outputs do not depend on the prompt"
    assert theirs != hf_greedy(bf16, prompts, N_NEW), "packing changed nothing: the test could not tell"
    params = SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)
    with LLM(str(packed), attention_backend="torch", **EXACT) as llm:
        ours = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        llm.client.check_pages()
    assert ours == theirs


def _malformed(tensors):
    name = "model.layers.1.mlp.experts.down_proj_blocks"
    tensors[name] = tensors[name].reshape(4, 64, 16)  # each row's bytes without their block dimension


def _unpaired(tensors):
    del tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]


@pytest.mark.parametrize("edit,message", [(_malformed, r"layers\.1\.mlp\.experts\.down_proj: blocks .*\[4, 64, 16\]"),
                                          (_unpaired, r"layers\.0\.mlp\.experts\.gate_up_proj_scales missing")])
def test_malformed_mxfp4_experts_are_refused_by_name(oss_dirs, tmp_path, edit, message):
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    bad = mxfp4_checkpoint(oss_dirs[0], tmp_path / "bad", edit)
    with pytest.raises(ModelLoadError, match=message):
        Engine(EngineConfig(model=str(bad), **EXACT))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs CUDA with FP8 (compute capability 8.9+)")
def test_mxfp4_experts_kept_as_fp8_on_cuda_take_the_fused_kernels_and_answer_as_the_torch_path(tmp_path,
                                                                                               tokenizer_dir):
    """What keeps them compact on a GPU: --quantization fp8 stores the dequantized experts as e4m3 rows (the sparse
    layers between the dense edge ones); the fused Triton experts (biases, clamped SwiGLU) answer as the torch path's
    simulation of them (the fused ops off) under tests/test_gpu_fp8.py's rule for FP8 engines (top-5 logprobs within
    ENGINE_TOL, the same top-1 but for near ties): a prefill of the four prompts together (64 tokens: the experts run
    w8a8, moe_tiles.fp8_act) and 8 decode steps of the four (w8a16). Not greedy ids equal: where the two paths' bf16
    roundings move an activation across an e4m3 boundary it moves a whole 8-bit step. The experts at the init's
    scale: at 4x it (`oss_dirs`) the tiny model is chaotic enough that bf16's own kernels and simulation part by
    0.43 (H200, 2026-12-02)."""
    from test_gpu_fp8 import ENGINE_TOL, _logits

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.kernels.fp8 import FP8

    packed = mxfp4_checkpoint(oss_bf16(tmp_path / "bf16", tokenizer_dir, expert_scale=1.0), tmp_path / "mxfp4")

    def engine(**kw) -> Engine:
        return Engine(EngineConfig(model=str(packed), device="cuda", dtype="bfloat16", quantization="fp8",
                                   max_total_tokens=2048, **kw))

    fast = engine()
    assert [layer.mlp.experts.gate_up_proj.dtype == FP8 for layer in fast.model.layers] == [False, True, True, False]
    sim = engine(attention_backend="torch", disable_fused_ops=True, disable_cuda_graph=True)
    steps = 8
    prompts = _prompts()
    g = torch.Generator().manual_seed(7)
    seqs = [p + torch.randint(3, 49152, (steps,), generator=g).tolist() for p in prompts]  # the teacher-forced tail
    lens = [len(p) for p in prompts]
    worst, agree, total = 0.0, 0, 0
    for la, lb in zip(_logits(fast, seqs, lens, steps), _logits(sim, seqs, lens, steps)):
        for x, y in zip(la.log_softmax(-1), lb.log_softmax(-1)):
            top = y.topk(5).indices
            worst = max(worst, (x[top] - y[top]).abs().max().item())
            i, j = x.argmax().item(), y.argmax().item()
            agree += i == j or (y[j] - y[i]).item() < ENGINE_TOL
            total += 1
    print(f"\nFP8 experts, kernels vs simulation: worst top-5 logprob diff {worst:.3f}, top-1 {agree}/{total}")
    assert worst <= ENGINE_TOL and agree == total


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_experts_hold_each_tp_ranks_share_of_the_shipped_bytes(tp):
    """Experts kept packed (layers/quant.py's mxfp4, as on CUDA) load the parts as shipped: each rank's gate and up
    rows (the checkpoint interleaves them) and its 32-value blocks of the down rows; dequantized (the torch paths'
    weights) they are exactly that rank's experts of the dequantized load (the bf16 path's)."""
    from minisgl_cli.distributed import TPInfo
    from minisgl_cli.layers.moe import Experts
    from minisgl_cli.loader.mxfp4 import dequantize

    n_exp, hidden, inter = 3, 64, 128  # a TP 2 rank: two of each down row's four blocks
    g = torch.Generator().manual_seed(tp)
    parts = {}
    for proj, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
        parts[f"{proj}_blocks"] = torch.randint(0, 256, (n_exp, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        parts[f"{proj}_scales"] = torch.randint(120, 130, (n_exp, rows, cols // 32), generator=g, dtype=torch.uint8)
    for rank in range(tp):
        packed = Experts(n_exp, hidden, inter, TPInfo(rank, tp), mxfp4=True)
        dense = Experts(n_exp, hidden, inter, TPInfo(rank, tp))
        for name, t in parts.items():
            packed.load_shard(name, t)
        for proj in ("gate_up_proj", "down_proj"):  # as loader/mxfp4.py yields them dequantized: [E, cols, rows]
            dense.load_shard(proj, dequantize(parts[f"{proj}_blocks"], parts[f"{proj}_scales"], torch.float32)
                             .transpose(1, 2))
        assert packed.gate_up_proj.dtype == torch.uint8 and packed.gate_up_proj.shape == (n_exp, 2 * inter // tp, 32)
        for got, want in zip(packed.dense(torch.float32), dense.dense(torch.float32)):
            assert torch.equal(got, want)
