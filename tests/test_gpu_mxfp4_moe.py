"""gpt-oss's MXFP4 experts kept packed in the fused Triton MoE kernels (kernels/triton/moe.py, w4a16) against the same
experts dequantized (loader/mxfp4.py's `dequantize`, the bf16 path).

The kernel cases run on CUDA (bf16) and, without a GPU, under Triton's interpreter on CPU tensors (fp16: its bf16
tl.dot is wrong), as tests/test_gpu_moe.py does (`make test` runs them so):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_mxfp4_moe.py

The engine cases need a CUDA GPU: a tiny gpt-oss MXFP4 checkpoint kept packed by default and answering as its
dequantized load (--quantization none), and the built-in gpt-oss-20b's dummy weights packed as the hub ships them.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.triton_interp import INTERPRET, NEEDS_TRITON, TRITON_RUNS, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine on a CUDA GPU")
# hidden 96 (3 exponents a gate/up row), width 64 (2 a down row): with a 64-deep, 64-wide tile the K steps and the
# down's columns end in a masked half tile, and the picked tiles (128 deep; 256 at one token) mask K in every step
HIDDEN, INTER = 96, 64
TILE = (16, 64, 64, 4, 1)
GEMV = (1, 8, 64, 4, 1)  # the GEMV form: two 32-value blocks a step, so K = 96 ends in a masked half step


if TRITON_RUNS:  # triton importable: a kernel that widens one tile, for the first test
    import triton
    import triton.language as tl

    from minisgl_cli.kernels.triton.moe import _mxfp4_tile

    @triton.jit
    def _widen(b_ptr, s_ptr, out_ptr):
        rows = tl.arange(0, 16)
        packed = tl.load(b_ptr + rows[:, None] * 16 + tl.arange(0, 16)[None, :])
        exps = tl.load(s_ptr + rows[:, None] + tl.arange(0, 1)[None, :])
        tile = _mxfp4_tile(packed, exps, tl.float32, 16, 32)  # [32, 16]
        tl.store(out_ptr + tl.arange(0, 32)[:, None] * 16 + rows[None, :], tile)


if TRITON_RUNS:
    from minisgl_cli.kernels.triton.moe import _e4m3_codes

    @triton.jit
    def _codes(v_ptr, even_ptr, odd_ptr):
        i = tl.arange(0, 64)
        even, odd = _e4m3_codes(tl.load(v_ptr + i))
        tl.store(even_ptr + i, even)
        tl.store(odd_ptr + i, odd)


@pytest.fixture(scope="module")
def T():
    patch_interpreter()
    from minisgl_cli.kernels.triton import moe as triton_moe

    return triton_moe


def _packed(rows: int, cols: int, n_exp: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 rows as a checkpoint stores them: bytes [E, rows, cols / 32, 16], exponents [E, rows, cols / 32]
    (2^-6 .. 2^-1: values up to 3, exact in fp16 too)."""
    blocks = torch.randint(0, 256, (n_exp, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    return blocks, torch.randint(121, 127, (n_exp, rows, cols // 32), generator=g, dtype=torch.uint8)


def _experts(n_exp: int, seed: int):
    """(packed kwargs for the kernels, the same experts dequantized in DTYPE)."""
    from minisgl_cli.loader.mxfp4 import dequantize

    g = torch.Generator().manual_seed(seed)
    gu_b, gu_s = _packed(2 * INTER, HIDDEN, n_exp, g)
    dn_b, dn_s = _packed(HIDDEN, INTER, n_exp, g)
    packed = dict(gate_up=gu_b.flatten(-2).to(DEV), gate_up_scale=gu_s.to(DEV), down=dn_b.flatten(-2).to(DEV),
                  down_scale=dn_s.to(DEV))
    dense = dict(gate_up=dequantize(gu_b, gu_s, DTYPE).to(DEV), down=dequantize(dn_b, dn_s, DTYPE).to(DEV))
    return packed, dense


def _swiglu(n_exp: int, g: torch.Generator, T):
    from minisgl_cli.layers.moe import SwiGLU

    act = SwiGLU(limit=1.5, alpha=1.702)
    biases = (torch.randn(n_exp, 2 * INTER, generator=g), torch.randn(n_exp, HIDDEN, generator=g))
    return act, biases, T.SwiGLUExperts(biases[0].to(DEV, DTYPE), biases[1].to(DEV, DTYPE), act.limit, act.alpha)


def _torch_path(x, dense, weights, ids, act, biases) -> torch.Tensor:
    """layers/moe.py's torch experts in fp32 on the dequantized weights (gpt-oss's biases and clamped SwiGLU)."""
    from minisgl_cli.layers.kernel_choice import Kernels
    from minisgl_cli.layers.moe import fused_experts

    return fused_experts(x.float().cpu(), dense["gate_up"].float().cpu(), dense["down"].float().cpu(), weights.cpu(),
                         ids.cpu(), Kernels(), grouped=False, act_fn=act,
                         biases=(biases[0].to(DTYPE).float(), biases[1].to(DTYPE).float()))


def _bf16_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within the rounding of the output dtype (the fp32 sums may run in another order)."""
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * torch.finfo(DTYPE).eps,
                               atol=2 * torch.finfo(DTYPE).eps * want.abs().max().item())


def test_the_tile_widens_every_code_under_every_exponent_exactly(T):
    """`_mxfp4_tile` in fp32: all 256 bytes (both nibbles, every sign) under exponents 2^-125 .. 2^113, bit for bit
    loader/mxfp4.py's `dequantize` (transformers' numbers)."""
    from minisgl_cli.loader.mxfp4 import dequantize

    blocks = torch.arange(256, dtype=torch.uint8).view(16, 1, 16)
    exps = torch.tensor([2, 3, 50, 100, 112, 113, 114, 119, 121, 126, 127, 128, 133, 160, 200, 240], dtype=torch.uint8)
    out = torch.empty(32, 16, device=DEV)
    _widen[(1,)](blocks.to(DEV), exps.to(DEV), out)
    want = dequantize(blocks, exps[:, None], torch.float32).view(16, 32).t()
    assert torch.equal(out.cpu(), want)


def test_e2m1_codes_become_e4m3_bytes_of_their_values_times_2_to_the_minus_6(T):
    """`_e4m3_codes` (the widening of the GEMV's fp16-pair loop on CUDA): every byte's two codes, as e4m3, read the
    e2m1 values times 2 ** -6 exactly, zeros, 0.5 and the signs included."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    table = torch.cat([table, -table])
    v = torch.arange(256, dtype=torch.uint8).view(torch.int32).to(DEV)
    even, odd = torch.empty_like(v), torch.empty_like(v)
    _codes[(1,)](v, even, odd)
    b = torch.arange(256)
    for word, codes in ((even, b % 16), (odd, b // 16)):
        got = word.cpu().view(torch.uint8).view(torch.float8_e4m3fn).float() * 64
        assert torch.equal(got, table[codes])


@CUDA_ONLY
@pytest.mark.parametrize("n_tok", [1, 3])
def test_fp16_pair_products_stay_near_the_dequantized_experts(T, n_tok):
    """The GEMV's MXFP4 loop on CUDA (`_block_sums_f16`, inline PTX) against the kernels on the dequantized weights:
    fp16 products summed a word (4 a half) before fp32, within a few bf16 roundings."""
    n_exp, top_k = 8, 2
    packed, dense = _experts(n_exp, seed=20 + n_tok)
    g = torch.Generator().manual_seed(200 + n_tok)
    _, _, swiglu = _swiglu(n_exp, g, T)
    x = torch.randn(n_tok, HIDDEN, generator=g).to(DEV, DTYPE)
    logits = torch.randn(n_tok, n_exp, generator=g).to(DEV)
    tiles = T.MoeTiles.both(T.MoeConfig(*GEMV))

    def run(**w):
        return T.one_slot_experts(x, logits, top_k=top_k, renormalize=True, tiles=tiles, swiglu=swiglu, **w)

    got, want = run(**packed).float(), run(**dense).float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


@pytest.mark.parametrize("n_tok", [1, 3, 6])
@pytest.mark.parametrize("tile", ["picked", "small", "gemv"])
def test_packed_gpt_oss_experts_equal_the_dequantized_ones(T, n_tok, tile):
    """gpt-oss's experts (biases, clamped SwiGLU, top-k then softmax routing) packed: the few-token path (1, 3 tokens)
    and the aligned one (6; the GEMV form takes the choices as given, a slot a program), each equal to the kernels on
    the dequantized weights within bf16 rounding and close to the torch path; the biases and the clamp change the
    answer (the test can tell)."""
    from minisgl_cli.layers.moe import route

    n_exp, top_k = 8, 2
    packed, dense = _experts(n_exp, seed=n_tok)
    g = torch.Generator().manual_seed(100 + n_tok)
    act, biases, swiglu = _swiglu(n_exp, g, T)
    x = torch.randn(n_tok, HIDDEN, generator=g).to(DEV, DTYPE)
    logits = torch.randn(n_tok, n_exp, generator=g).to(DEV)
    tiles = None if tile == "picked" else T.MoeTiles.both(T.MoeConfig(*(TILE if tile == "small" else GEMV)))
    if tile == "picked":  # one token: the packed experts' own tiles (the GEMV form), not the FP8 table's
        from minisgl_cli.kernels.triton.moe_tiles import TILES_MXFP4

        assert (T.pick_tiles(n_tok, mxfp4=True) == TILES_MXFP4[0][1]) == (n_tok == 1)
    if n_tok <= T.SMALL_MAX_TOKENS:
        def run(**w):
            return T.one_slot_experts(x, logits, top_k=top_k, renormalize=True, tiles=tiles, swiglu=swiglu, **w)
    else:
        def run(**w):
            return T.fused_experts(x, weights=weights, ids=ids, tiles=tiles, swiglu=swiglu, **w)
    weights, ids = route(logits, top_k, True, topk_first=True)
    got = run(**packed)
    assert got.shape == (n_tok, HIDDEN) and got.dtype == DTYPE
    _bf16_close(got, run(**dense))
    want = _torch_path(x, dense, weights, ids, act, biases)
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    plain = T.routed_experts(x, logits, top_k=top_k, renormalize=True, **packed)
    assert (plain.float().cpu() - want).abs().max() > 0.1, "the biases and the clamped SwiGLU changed nothing"


def test_packed_silu_experts_take_the_routing_weights_as_given(T):
    """Plain SiLU experts packed, the routing weights and ids handed in (several tokens, aligned blocks, experts that
    get no token), as terms: each token's k terms equal the dequantized kernels' within bf16 rounding."""
    from minisgl_cli.layers.moe import route

    n_exp, top_k, n_tok = 16, 3, 5
    packed, dense = _experts(n_exp, seed=9)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n_tok, HIDDEN, generator=g).to(DEV, DTYPE)
    weights, ids = route(torch.randn(n_tok, n_exp, generator=g).to(DEV), top_k, False)
    tiles = T.MoeTiles.both(T.MoeConfig(*TILE))
    got = T.fused_experts(x, weights=weights, ids=ids, tiles=tiles, terms=True, **packed)
    assert got.shape == (n_tok, top_k, HIDDEN)
    _bf16_close(got, T.fused_experts(x, weights=weights, ids=ids, tiles=tiles, terms=True, **dense))
    assert got.abs().amax() > 0


def test_packed_experts_refuse_a_width_off_the_exponent_blocks(T):
    """An expert width that splits a 32-value block (a TP slice of one) cannot run packed: refused by name."""
    n_exp, top_k = 4, 1
    packed, _ = _experts(n_exp, seed=3)
    x = torch.randn(2, HIDDEN - 16).to(DEV, DTYPE)
    with pytest.raises(ValueError, match="multiples of 32"):
        T.routed_experts(x, torch.randn(2, n_exp).to(DEV), top_k=top_k, renormalize=True, **packed)


def test_packed_rows_off_a_16_byte_boundary_are_refused(T):
    """The GEMV form loads a block's 4 code words at once: rows whose start is not 16-byte aligned (a view with a row
    stride of 13 words) are refused by name, not read misaligned."""
    packed, _ = _experts(4, seed=4)
    for name in ("gate_up", "down"):
        w = packed[name]
        wide = torch.zeros(*w.shape[:-1], w.shape[-1] + 4, dtype=w.dtype, device=w.device)
        wide[..., : w.shape[-1]] = w
        packed[name] = wide[..., : w.shape[-1]]  # the same bytes, each row 4 bytes further on
    tiles = T.MoeTiles.both(T.MoeConfig(*GEMV))
    x = torch.randn(1, HIDDEN).to(DEV, DTYPE)
    with pytest.raises(ValueError, match="16-byte boundary"):
        T.one_slot_experts(x, torch.randn(1, 4).to(DEV), top_k=1, renormalize=True, tiles=tiles, **packed)


@pytest.fixture(scope="module")
def oss_mxfp4(tmp_path_factory, tokenizer_dir):
    """A tiny gpt-oss MXFP4 checkpoint as the hub packs them (tests/test_mxfp4.py's)."""
    from test_mxfp4 import mxfp4_checkpoint, oss_bf16

    root = tmp_path_factory.mktemp("mxfp4_gpu")
    return mxfp4_checkpoint(oss_bf16(root / "bf16", tokenizer_dir), root / "mxfp4")


@CUDA_ONLY
@pytest.mark.skipif(INTERPRET, reason="the engine on a CUDA GPU")
def test_mxfp4_checkpoint_stays_packed_on_cuda_and_answers_as_its_dequantized_load(oss_mxfp4):
    """By default (auto) a CUDA engine keeps the shipped bytes and exponents (the fused kernels run them); its greedy
    answers, cold and cached, are those of --quantization none (the experts dequantized to bf16 at load)."""
    from test_mxfp4 import _prompts

    from minisgl_cli import LLM, SamplingParams
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    engine = Engine(EngineConfig(model=str(oss_mxfp4), device="cuda", max_total_tokens=2048))
    experts = engine.model.layers[0].mlp.experts
    assert engine.quantization == "mxfp4" and experts.gate_up_proj.dtype == torch.uint8
    assert experts.gate_up_scale.shape == (4, 64, 2) and experts.down_proj.shape == (4, 64, 16)
    del engine
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * len(prompts)
    answers = {}
    for quantization in ("auto", "none"):
        with LLM(str(oss_mxfp4), device="cuda", quantization=quantization) as llm:
            cold = [r.token_ids for r in llm.generate(prompts, params)]
            cached = [r.token_ids for r in llm.generate(prompts, params)]
            llm.client.check_pages()
        assert cold == cached
        answers[quantization] = cold
    assert answers["auto"] == answers["none"]


@CUDA_ONLY
@pytest.mark.skipif(INTERPRET, reason="the engine on a CUDA GPU")
def test_gpt_oss_dummy_weights_are_packed_and_the_kv_pool_gets_the_bytes_saved():
    """The built-in gpt-oss-20b (cut to 4 layers) with --load-format dummy: random MXFP4 experts kept packed; the KV
    pool, sized from the memory left after the weights, gets the bytes packing saved against --quantization none."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.loader import configs

    cfg = configs.builtin_config("gpt-oss-20b")
    cfg.update(num_hidden_layers=4, layer_types=cfg["layer_types"][:4])
    configs.BUILTIN_CONFIGS["gpt-oss-20b-4layer"] = cfg
    free, pages, expert_bytes = {}, {}, {}
    try:
        for quantization in ("auto", "none"):
            engine = Engine(EngineConfig(model="gpt-oss-20b-4layer", load_format="dummy", device="cuda",
                                         quantization=quantization, mem_fraction=0.2, disable_cuda_graph=True))
            # (a fifth of an H200 keeps both pools under the cap of --max-running-requests' longest contexts: sized
            # by memory, as the test means)
            assert (engine.quantization == "mxfp4") == (quantization == "auto")
            free[quantization], pages[quantization] = engine._free_after_weights, engine.pool.num_pages
            expert_bytes[quantization] = sum(p.numel() * p.element_size() for name, p in engine.model.named_parameters()
                                             if ".experts." in name and "bias" not in name)
            del engine
            gc.collect()  # the engine's memory back before the next one measures what is free
            torch.cuda.empty_cache()
    finally:
        del configs.BUILTIN_CONFIGS["gpt-oss-20b-4layer"]
    # 4 bits a weight and a byte per 32: 17 / 64 of bf16's bytes
    assert expert_bytes["auto"] * 64 == expert_bytes["none"] * 17
    saved = expert_bytes["none"] - expert_bytes["auto"]
    assert abs((free["auto"] - free["none"]) - saved) < 0.05 * saved
    assert pages["auto"] > pages["none"]
