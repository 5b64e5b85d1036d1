"""Mixture of experts: the MoE block against a per-token reference, TP slices of the experts, tiny Qwen3-MoE /
Mixtral checkpoints' logits through the engine against HF fp32, and what is refused. Their greedy tokens against
HF: tests/test_hf_parity.py; TP 2 against one process: tests/test_runtime.py; each rank's reads:
tests/test_tp_loading.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_engine import _extend
from transformers import AutoModelForCausalLM

from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.moe import Experts, fused_experts, route

PATHS = ["loop"] + (["grouped"] if hasattr(torch, "_grouped_mm") else [])  # CPU runs torch's grouped fallback


def _expert_mats(n_exp: int, hidden: int, inter: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"gate_proj": torch.randn(inter, hidden, generator=g) * 0.2,
             "up_proj": torch.randn(inter, hidden, generator=g) * 0.2,
             "down_proj": torch.randn(hidden, inter, generator=g) * 0.2} for _ in range(n_exp)]


def _experts(mats: list[dict[str, torch.Tensor]], tp: TPInfo) -> Experts:
    inter, hidden = mats[0]["gate_proj"].shape
    experts = Experts(len(mats), hidden, inter, tp)
    for e, m in enumerate(mats):
        for proj, w in m.items():
            experts.load_expert(e, proj, w)
    return experts


def _per_token(x, mats, weights, ids) -> torch.Tensor:
    """The definition, one token and one choice at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            m = mats[e]
            h = F.silu(x[t] @ m["gate_proj"].T) * (x[t] @ m["up_proj"].T)
            out[t] += w * (h @ m["down_proj"].T)
    return out


def test_sparse_layers_are_the_ones_transformers_picks():
    """Qwen3-MoE: every decoder_sparse_step-th layer, less mlp_only_layers; Mixtral: every layer."""
    from minisgl_cli.loader.configs import builtin_config
    from minisgl_cli.models import ModelConfig

    qwen = ModelConfig.from_hf({**builtin_config("qwen3-30b-a3b"), "num_hidden_layers": 8, "decoder_sparse_step": 2,
                                "mlp_only_layers": [3]})
    assert [i for i in range(8) if qwen.is_moe_layer(i)] == [1, 5, 7]
    mixtral = ModelConfig.from_hf(builtin_config("mixtral-8x7b"))
    assert all(mixtral.is_moe_layer(i) for i in range(mixtral.num_layers)) and mixtral.norm_topk_prob
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 14336)
    dense = ModelConfig.from_hf(builtin_config("qwen3-0.6b"))
    assert not any(dense.is_moe_layer(i) for i in range(dense.num_layers))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n_exp,top_k,n_tok", [(8, 2, 1), (8, 2, 3), (4, 4, 5), (16, 3, 7), (6, 1, 40)])
def test_moe_block_equals_the_per_token_definition(n_exp, top_k, n_tok, path):
    hidden, inter = 32, 24
    mats = _expert_mats(n_exp, hidden, inter, seed=n_exp * 100 + n_tok)
    x = torch.randn(n_tok, hidden, generator=torch.Generator().manual_seed(n_tok))
    logits = torch.randn(n_tok, n_exp, generator=torch.Generator().manual_seed(7))
    for renormalize in (False, True):
        weights, ids = route(logits, top_k, renormalize)
        sums = weights.sum(-1)
        assert torch.allclose(sums, torch.ones_like(sums)) if renormalize else (sums < 1 + 1e-6).all()
        e = _experts(mats, TPInfo())
        got = fused_experts(x, e.gate_up_proj, e.down_proj, weights, ids, Kernels(), grouped=path == "grouped")
        torch.testing.assert_close(got, _per_token(x, mats, weights, ids), rtol=1e-5, atol=1e-5)
    if n_tok * top_k < n_exp:
        assert len(set(ids.flatten().tolist())) < n_exp  # some experts received no token


@pytest.mark.parametrize("path", PATHS)
def test_tp_ranks_slices_of_every_expert_sum_to_the_whole(path):
    """Each rank holds half of every expert's intermediate size; their partial outputs add up (the all-reduce)."""
    mats = _expert_mats(8, 32, 48, seed=3)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(4))
    weights, ids = route(torch.randn(9, 8, generator=torch.Generator().manual_seed(5)), 2, True)
    grouped = path == "grouped"
    whole = _experts(mats, TPInfo())
    want = fused_experts(x, whole.gate_up_proj, whole.down_proj, weights, ids, Kernels(), grouped)
    parts = [_experts(mats, TPInfo(r, 2)) for r in range(2)]
    assert parts[0].gate_up_proj.shape == (8, 48, 32) and parts[0].down_proj.shape == (8, 32, 24)
    got = sum(fused_experts(x, p.gate_up_proj, p.down_proj, weights, ids, Kernels(), grouped) for p in parts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_tp_ranks_hold_their_columns_of_tp1_s_quantized_down_projections(quantization):
    """A per-row scale is the whole row's: each rank's slice of an expert's down_proj (its columns) multiplies by the
    very numbers TP 1 holds there, e4m3 codes (fp8) or the int8 decode copy, not by a finer scale of its own."""
    from minisgl_cli.kernels.fp8 import dequantize
    from minisgl_cli.layers.quant import METHODS

    mats = _expert_mats(4, 32, 64, seed=6)
    for m in mats:  # each row's largest value in TP 2's second half, so a rank's own scale would differ
        m["down_proj"][:, 48] = 1.0

    def down(tp: TPInfo) -> list[torch.Tensor]:
        """Each expert's down_proj as its decode multiplies by it, [H, I / tp]."""
        copies = METHODS[quantization]() if quantization == "int8" else None
        experts = Experts(len(mats), 32, 64, tp, fp8=quantization == "fp8", copies=copies)
        for e, m in enumerate(mats):
            for proj, w in m.items():
                experts.load_expert(e, proj, w)
        experts.finish_loading()
        if quantization == "fp8":
            assert experts.down_scale is not None
            return [dequantize(experts.down_proj.data[e], experts.down_scale.data[e][:, None]) for e in range(4)]
        assert copies is not None and experts.down_copies is not None
        eye = torch.eye(64 // tp.size)  # unit rows: each output one product, the copy's weight itself
        return [copies.apply(h, eye, None, decode=True).float().t() for h in experts.down_copies]

    whole = down(TPInfo())
    ranks = [down(TPInfo(r, 2)) for r in range(2)]
    for e in range(4):
        assert torch.equal(torch.cat([ranks[0][e], ranks[1][e]], dim=1), whole[e]), e


def test_fp8_experts_hold_e4m3_rows_and_run_their_dequantized_weights():
    """--quantization fp8: each expert matrix is quantized per output row as it loads; the torch path multiplies by
    codes x scales, which stay within e4m3's rounding of the checkpoint's weights."""
    from minisgl_cli.kernels.fp8 import FP8
    from minisgl_cli.layers.moe import MoE

    mats = _expert_mats(8, 32, 48, seed=11)
    e = _experts(mats, TPInfo())
    q = Experts(8, 32, 48, TPInfo(), fp8=True)
    for i, m in enumerate(mats):
        for proj, w in m.items():
            q.load_expert(i, proj, w)
    assert q.gate_up_proj.dtype == q.down_proj.dtype == FP8
    assert q.gate_up_scale is not None and q.gate_up_scale.shape == (8, 96)
    assert q.down_scale is not None and q.down_scale.shape == (8, 32)
    gate_up, down = q.dense(torch.float32)
    for got, want in ((gate_up, e.gate_up_proj), (down, e.down_proj)):  # e4m3: 3 mantissa bits, scale per row
        assert ((got - want).abs() <= want.abs().amax(-1, keepdim=True) / 448 * 32 / 2 + 1e-7).all()
        assert not torch.equal(got, want)
    block = MoE(8, 2, 32, 48, True, TPInfo(), Kernels(), fp8=True)
    block.experts = q
    block.gate.weight.data.normal_(generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    weights, ids = route(block.gate(x), 2, True)
    want = fused_experts(x, gate_up, down, weights, ids, Kernels(), grouped=False)
    torch.testing.assert_close(block(x), want, rtol=0, atol=0)
    dense = fused_experts(x, e.gate_up_proj, e.down_proj, weights, ids, Kernels(), grouped=False)
    assert ((block(x) - dense).norm() / dense.norm()).item() < 0.05


@pytest.mark.parametrize("w8a8", [False, True])
def test_fp8_experts_simulate_the_activations_the_kernels_round(w8a8):
    """FP8 experts on the torch path model the arithmetic the GPU picks for the batch (kernels/triton/moe_tiles.py):
    from W8A8_MIN_TOKENS tokens both projections' inputs go per token through e4m3 and back (w8a8), below it none."""
    from minisgl_cli.kernels.fp8 import round_trip_rows
    from minisgl_cli.kernels.triton.moe_tiles import W8A8_MIN_TOKENS
    from minisgl_cli.layers.moe import MoE

    block = MoE(8, 2, 32, 48, True, TPInfo(), Kernels(), fp8=True)
    for i, m in enumerate(_expert_mats(8, 32, 48, seed=12)):
        for proj, w in m.items():
            block.experts.load_expert(i, proj, w)
    block.gate.weight.data.normal_(generator=torch.Generator().manual_seed(3))
    x = torch.randn(W8A8_MIN_TOKENS - (not w8a8), 32, generator=torch.Generator().manual_seed(4))
    weights, ids = route(block.gate(x), 2, True)
    gate_up, down = block.experts.dense(torch.float32)
    act = round_trip_rows if w8a8 else torch.Tensor.float
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ act(x[t : t + 1])[0]).chunk(2)
            want[t] += w * (down[e] @ act((F.silu(gate) * up)[None])[0])
    got = block(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = fused_experts(x, gate_up, down, weights, ids, Kernels(), grouped=False)
    assert torch.equal(got, plain) != w8a8 and ((got - plain).norm() / plain.norm()).item() < 0.1


def test_fp8_moe_engine_holds_e4m3_experts_between_its_dense_edge_layers(monkeypatch):
    """--quantization fp8 on a Qwen3-MoE config (dummy weights, CPU): the middle layers' experts are e4m3 with
    per-row scales, the first and last stay dense (as the dense linears do), and the logits stay within FP8's
    rounding of the bf16 model's."""
    from minisgl_cli.kernels.fp8 import FP8
    from minisgl_cli.loader.configs import BUILTIN_CONFIGS

    small = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                 num_experts_per_tok=2, bos_token_id=1, eos_token_id=2)
    monkeypatch.setitem(BUILTIN_CONFIGS, "test-moe", {**BUILTIN_CONFIGS["qwen3-30b-a3b"], **small})
    logits = {}
    for quantization in ("none", "fp8"):
        engine = Engine(EngineConfig(model="test-moe", load_format="dummy", dtype="bfloat16",
                                     quantization=quantization, attention_backend="torch", max_total_tokens=1024))
        experts = [layer.mlp.experts for layer in engine.model.layers]
        want = [quantization == "fp8" and 0 < i < 3 for i in range(4)]
        assert [e.gate_up_proj.dtype == FP8 and e.down_proj.dtype == FP8 for e in experts] == want
        logits[quantization] = _extend(engine, [[5, 6, 7, 8, 9]], 0).float()
    dense, fp8 = logits["none"], logits["fp8"]
    assert not torch.equal(fp8, dense) and ((fp8 - dense).norm() / dense.norm()).item() < 0.1


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tiny_moe_logits_match_hf_fp32(tiny_moe_dirs, arch):
    model_dir = tiny_moe_dirs[arch]
    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17, 1)]
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", quantization="none",
                                 attention_backend="torch", max_total_tokens=4096))
    ours = _extend(engine, prompts, 0)  # one batched prefill: the last token's logits of each prompt
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = torch.cat([hf(torch.tensor([p])).logits[:, -1] for p in prompts])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_hf_twin_of_a_moe_model_is_the_checkpoint(tiny_moe_dirs, arch):
    """models/hf_export.hf_twin (the GPU numerics tests' reference) holds our stacked experts under transformers'
    names: it computes what the checkpoint loaded by transformers does."""
    from minisgl_cli.loader.hf import read_hf_config
    from minisgl_cli.models.hf_export import hf_twin

    model_dir = tiny_moe_dirs[arch]
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", quantization="none", max_total_tokens=256))
    twin = hf_twin(engine.model, read_hf_config(model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([[5, 17, 99, 4000, 12, 7]])
    with torch.no_grad():
        torch.testing.assert_close(twin(x).logits, hf(x).logits, rtol=0, atol=1e-6)


def test_dummy_weights_of_an_moe_config_run(tiny_moe_dirs):
    """--load-format dummy on a MoE config: random experts of the config's shapes, finite logits."""
    engine = Engine(EngineConfig(model=str(tiny_moe_dirs["qwen3_moe"]), load_format="dummy", max_total_tokens=256))
    logits = _extend(engine, [[1, 2, 3, 4]], 0)
    assert torch.isfinite(logits).all() and logits.std() > 0


def _dequantized(method_name: str, w: torch.Tensor) -> torch.Tensor:
    """What the method's copy of w holds: Q4_1-like groups of 32, or int8 per channel, back in fp32."""
    from minisgl_cli.loader.blocks import quantize_int4, quantize_int8

    return (quantize_int4(w) if method_name == "int4" else quantize_int8(w)).dequantize()


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_int4_int8_experts_decode_through_their_low_bit_copies(quantization):
    """--quantization int4 / int8: each expert matrix gets the method's copy once loaded; decode rows multiply by it
    (the expert's output is that of the dequantized copy on bf16 rows), prefill rows by the dense weights."""
    from minisgl_cli.layers.moe import MoE
    from minisgl_cli.layers.quant import METHODS

    n_exp, hidden, inter, top_k = 4, 64, 32, 2
    block = MoE(n_exp, top_k, hidden, inter, True, TPInfo(), Kernels(), copies=METHODS[quantization]())
    block.gate.weight.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    for e, m in enumerate(_expert_mats(n_exp, hidden, inter, seed=4)):
        for proj, w in m.items():
            block.experts.load_expert(e, proj, w)
    block = block.to(torch.bfloat16)
    block.experts.finish_loading()
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    weights, ids = route(block.gate(x), top_k, True)
    e = block.experts
    mats = [{"gate_proj": _dequantized(quantization, e.gate_up_proj.data[i])[:inter],
             "up_proj": _dequantized(quantization, e.gate_up_proj.data[i])[inter:],
             "down_proj": _dequantized(quantization, e.down_proj.data[i])} for i in range(n_exp)]
    decoded = block(x, decode=True)
    want = _per_token(x.float(), mats, weights, ids)
    torch.testing.assert_close(decoded.float(), want, rtol=0, atol=3e-2 * want.abs().max().item())
    dense = [{"gate_proj": e.gate_up_proj.data[i, :inter].float(), "up_proj": e.gate_up_proj.data[i, inter:].float(),
              "down_proj": e.down_proj.data[i].float()} for i in range(n_exp)]
    extended = block(x, decode=False)  # the dense weights
    torch.testing.assert_close(extended.float(), _per_token(x.float(), dense, weights, ids), rtol=0,
                               atol=3e-2 * want.abs().max().item())
    assert not torch.equal(decoded, extended)


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_a_quantized_moe_engine_decodes_eagerly_and_refuses_torch_compile_on(tiny_moe_dirs, quantization):
    """The int4 / int8 CPU modes take MoE checkpoints: greedy tokens come out, decode stays eager (the experts' loop
    reads row counts back, which no exported step holds), and --torch-compile on says so in one line."""
    from minisgl_cli.llm import LLM
    from minisgl_cli.types import SamplingParams

    model = str(tiny_moe_dirs["qwen3_moe"])
    engine = Engine(EngineConfig(model=model, quantization=quantization, max_total_tokens=256))
    assert engine.quantization == quantization and engine.compiled is None  # a dense model's would load or build
    assert engine.model.layers[0].mlp.experts.decode_matmul() is not None
    with LLM(model, quantization=quantization, max_total_tokens=1024) as llm:
        out = llm.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [len(c.token_ids) for c in out] == [6, 6]
    with pytest.raises(ValueError) as err:
        Engine(EngineConfig(model=model, quantization=quantization, torch_compile="on", max_total_tokens=256))
    assert "\n" not in str(err.value) and "--torch-compile on" in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_grouped_experts_on_cuda_match_the_loop_and_replay_in_a_cuda_graph():
    """bf16 on the GPU: the grouped GEMM (where it runs) equals the per-expert loop, and a CUDA graph captures it
    (no host sync) and replays it on new tokens and routes."""
    from minisgl_cli.layers.moe import grouped_mm_runs

    dev = torch.device("cuda")
    if not grouped_mm_runs(dev, torch.bfloat16):
        pytest.skip("torch._grouped_mm's kernel needs SM 9.x / 10.x and torch 2.8+")
    n_exp, hidden, inter, top_k, n_tok = 16, 256, 128, 4, 24
    e = _experts(_expert_mats(n_exp, hidden, inter, seed=1), TPInfo()).to(dev, torch.bfloat16)
    kernels = Kernels()

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n_tok, hidden, generator=g).to(dev, torch.bfloat16)
        weights, ids = route(torch.randn(n_tok, n_exp, generator=g).to(dev), top_k, True)
        return x, weights, ids

    x, weights, ids = inputs(0)
    loop = fused_experts(x, e.gate_up_proj, e.down_proj, weights, ids, kernels, grouped=False)
    grouped = fused_experts(x, e.gate_up_proj, e.down_proj, weights, ids, kernels, grouped=True)
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)
    static = [t.clone() for t in (x, weights, ids)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(*static[:1], e.gate_up_proj, e.down_proj, *static[1:], kernels, grouped=True)
    x2, w2, i2 = inputs(1)
    for dst, src in zip(static, (x2, w2, i2)):
        dst.copy_(src)
    graph.replay()
    want = fused_experts(x2, e.gate_up_proj, e.down_proj, w2, i2, kernels, grouped=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
