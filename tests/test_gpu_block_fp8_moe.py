"""Block-wise FP8 experts (DeepSeek-V3's: e4m3 codes, an fp32 scale per bn x bk block) kept as shipped in the fused
Triton MoE kernels (kernels/triton/moe.py), against the same experts dequantized.

The w8a16 cases run on CUDA (bf16) and, without a GPU, under Triton's interpreter on CPU tensors (fp16), as
tests/test_gpu_moe.py does (`make test` runs them so):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_block_fp8_moe.py

w8a8 (FP8 MMAs, the activations per token per bk columns) and the engine case need a CUDA GPU of compute
capability 8.9+.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import INTERPRET, NEEDS_FP8, NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON, NEEDS_FP8]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
# hidden 96, width 64 in blocks of 16 rows x 32 columns (DeepSeek ships 128 x 128): gate/up's K ends in a partial
# 64-deep step, down's columns in a masked half tile; the picked tiles' deeper K steps are cut to one group (32)
HIDDEN, INTER, BLOCK = 96, 64, (16, 32)
TILE = (16, 64, 64, 4, 1)


@pytest.fixture(scope="module")
def T():
    patch_interpreter()
    from minisgl_cli.kernels.triton import moe as triton_moe

    return triton_moe


def _experts(n_exp: int, seed: int):
    """(codes and block scales for the kernels, the same experts dequantized in fp32)."""
    from minisgl_cli.loader.blocks import quantize_fp8_blocks

    g = torch.Generator().manual_seed(seed)
    packed, dense = [], []
    for rows, cols in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
        # a scale that varies from block to block: each block's rows at its own magnitude
        w = torch.randn(n_exp, rows, cols, generator=g) * cols**-0.5
        w = w * torch.rand(n_exp, rows // BLOCK[0], 1, cols // BLOCK[1], 1, generator=g).add(0.25).repeat_interleave(
            BLOCK[0], 1).flatten(2, 3).repeat_interleave(BLOCK[1], -1).flatten(-2)
        blocks = [quantize_fp8_blocks(w[e], BLOCK) for e in range(n_exp)]
        packed.append((torch.stack([b.q for b in blocks]).to(DEV), torch.stack([b.scale_inv for b in blocks]).to(DEV)))
        dense.append(torch.stack([b.dequantize() for b in blocks]))
    (gu, gs), (dn, ds) = packed
    return dict(gate_up=gu, down=dn, gate_up_scale=gs, down_scale=ds, block=BLOCK), dense


def _reference(x, gate_up, down, weights, ids, groups: int = 0) -> torch.Tensor:
    """fp32, one (token, choice) at a time; `groups`: the w8a8 kernels' arithmetic (x, and each slot's SiLU(gate) * up
    rounded to x's dtype as the kernel writes it, through e4m3 per row per that many columns and back)."""
    from minisgl_cli.kernels.fp8 import dequantize_groups, quantize_groups

    def rt(t):
        return dequantize_groups(*quantize_groups(t, groups), groups) if groups else t.float()

    xq = rt(x.cpu())
    out = torch.zeros_like(xq)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ xq[t]).chunk(2)
            if groups:
                gate, up = gate.to(x.dtype).float(), up.to(x.dtype).float()
                h = (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
            else:
                h = F.silu(gate) * up
            out[t] += w * (down[e] @ rt(h[None])[0])
    return out


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    err = (got.float().cpu() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), (err, want.abs().max().item())


@pytest.mark.parametrize("n_tok", [1, 3, 6])
@pytest.mark.parametrize("tile", ["picked", "small"])
def test_block_fp8_experts_w8a16_equal_their_dequantized_weights(T, n_tok, tile):
    """The few-token path (1, 3 tokens: routed in the gate/up pass) and the aligned one (6, w8a16), each K step's dot
    scaled by its blocks: the dequantized experts' result within bf16 rounding; a scale from the wrong block (the
    test's weights vary by block) would not be."""
    from minisgl_cli.layers.moe import route

    n_exp, top_k = 8, 2
    packed, (gate_up, down) = _experts(n_exp, seed=n_tok)
    g = torch.Generator().manual_seed(100 + n_tok)
    x = torch.randn(n_tok, HIDDEN, generator=g).to(DEV, DTYPE)
    logits = torch.randn(n_tok, n_exp, generator=g).to(DEV)
    tiles = (T.MoeTiles.both(T.MoeConfig(*TILE)) if tile == "small"
             else T.pick_tiles(n_tok, True, w8a8=False))
    weights, ids = route(logits, top_k, True)
    if n_tok <= T.SMALL_MAX_TOKENS:
        got = T.one_slot_experts(x, logits, top_k=top_k, renormalize=True, tiles=tiles, **packed)
    else:
        got = T.fused_experts(x, weights=weights, ids=ids, tiles=tiles, **packed)
    assert got.shape == (n_tok, HIDDEN) and got.dtype == DTYPE
    _close(got, _reference(x, gate_up, down, weights.cpu(), ids.cpu()), tol=1e-2)


def test_deepseek_routing_runs_block_fp8_experts_as_chosen(T):
    """DeepSeek's grouped top-k (sigmoid, correction bias, scaling factor) hands the fused kernels its weights and
    ids; the block-FP8 experts run that choice, as terms too."""
    from minisgl_cli.layers.moe import route_grouped
    from minisgl_cli.layers.routing import GroupedRouting

    n_exp, top_k, n_tok = 16, 4, 5
    packed, (gate_up, down) = _experts(n_exp, seed=11)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n_tok, HIDDEN, generator=g).to(DEV, DTYPE)
    r = GroupedRouting(scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum", correction_bias=True,
                       renormalize=True, routed_scaling_factor=2.5)
    weights, ids = route_grouped(torch.randn(n_tok, n_exp, generator=g).to(DEV), top_k, r,
                                 (torch.randn(n_exp, generator=g) * 0.1).to(DEV))
    tiles = T.MoeTiles.both(T.MoeConfig(*TILE))
    got = T.fused_experts(x, weights=weights, ids=ids.to(torch.int32), tiles=tiles, terms=True, **packed)
    assert got.shape == (n_tok, top_k, HIDDEN)
    _close(got.sum(dim=1), _reference(x, gate_up, down, weights.cpu(), ids.cpu()), tol=1e-2)


@pytest.mark.skipif(INTERPRET, reason="FP8 MMAs need a GPU")
@pytest.mark.parametrize("n_tok", [8, 40])
def test_block_fp8_experts_w8a8_quantize_the_activations_per_token_group(T, n_tok):
    """From W8A8_MIN_TOKENS tokens: x and each slot's gate/up output to e4m3 per token per bk columns (as the dense
    block-FP8 linears take them), FP8 MMAs, each step scaled by the rows' group scales and the blocks' scales: tight
    against a reference that rounds as the kernels do, and not the w8a16 numbers."""
    from minisgl_cli.layers.moe import route

    n_exp, top_k = 16, 4
    packed, (gate_up, down) = _experts(n_exp, seed=n_tok)
    g = torch.Generator().manual_seed(n_tok)
    x = torch.randn(n_tok, HIDDEN, generator=g).to(DEV, DTYPE)
    weights, ids = route(torch.randn(n_tok, n_exp, generator=g).to(DEV), top_k, True)
    tiles = T.pick_tiles(n_tok, True)
    assert tiles.fp8_act
    got = T.fused_experts(x, weights=weights, ids=ids, tiles=tiles, **packed)
    _close(got, _reference(x, gate_up, down, weights.cpu(), ids.cpu(), groups=BLOCK[1]), tol=1e-2)
    w8a16 = T.fused_experts(x, weights=weights, ids=ids, tiles=T.pick_tiles(n_tok, True, w8a8=False), **packed)
    assert not torch.equal(got, w8a16)  # the activations were rounded


@pytest.mark.skipif(INTERPRET, reason="the engine on a CUDA GPU")
def test_block_fp8_checkpoint_keeps_its_experts_blocks_on_cuda_and_runs_the_torch_paths_numbers(tmp_path_factory,
                                                                                               tokenizer_dir):
    """A tiny DeepSeek-V3 block-FP8 checkpoint in bf16 on CUDA: auto keeps the experts' e4m3 blocks, run by the fused
    Triton experts; teacher-forced (prefill chunks of 8 tokens: w8a8; then decode steps: w8a16), its logits are the
    torch path's simulation of the same arithmetic (the fused ops off: the blocks dequantized per call, the
    activations through e4m3 per group where w8a8 runs) within 5%, the greedy choice the same at 90% of positions
    (bf16 sums in another order move an e4m3 code now and then)."""
    from test_deepseek import _prompts, _teacher_forced_logits, block_fp8_checkpoints, make_tiny_deepseek

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    root = tmp_path_factory.mktemp("deepseek_fp8_moe")
    dirs = block_fp8_checkpoints(make_tiny_deepseek("v3", root / "v3", tokenizer_dir), root / "blocks")
    fused, torch_path = (Engine(EngineConfig(model=str(dirs["fp8"]), device="cuda", max_total_tokens=256,
                                             disable_fused_ops=off, disable_cuda_graph=True)) for off in (False, True))
    experts = fused.model.layers[1].mlp.experts
    assert fused.quantization == "fp8-block" and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.fp8_block == (16, 32) and experts.gate_up_scale.shape == (8, 4, 2)
    rel, same = [], []
    for prompt in _prompts():
        got, want = (_teacher_forced_logits(e, prompt, len(prompt) - 4).float().cpu() for e in (fused, torch_path))
        rel.append((got - want).norm(dim=-1) / want.norm(dim=-1))
        same.append(got.argmax(-1) == want.argmax(-1))
    assert torch.cat(rel).mean().item() <= 0.05 and torch.cat(same).float().mean().item() >= 0.9
