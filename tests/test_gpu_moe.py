"""The fused Triton MoE experts (kernels/triton/moe.py) against the torch reference of layers/moe.py.

Runs on CUDA (bf16); without a GPU, under Triton's interpreter on CPU tensors (fp16: the interpreter's bf16
tl.dot is wrong), where triton is importable and TRITON_INTERPRET=1 was set before it was imported:

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_moe.py

`make test` runs it so on a machine without a GPU (triton in .venv/triton-interpreter), CI included.

Cases: 4 to 128 experts, top-k 1, 2 and 8, 1 to 64 tokens (1 to 4 on the few-token path, which routes itself),
experts that get no token, FP8 expert weights (w8a16,
and on the GPU w8a8); on the GPU also a CUDA graph's replay and the whole MoE block against its grouped / loop path
(FP8 at 200 tokens: w8a8 against the torch path's simulation of it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interp import INTERPRET, NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16
SMALL = (16, 16, 32, 4, 1)  # a tile smaller than the shapes: several blocks and column tiles, masked K edges
GEMV = (1, 16, 32, 4, 1)  # the GEMV form (a slot a program), smaller than the shapes likewise
NO_FP8 = DEV == "cuda" and torch.cuda.get_device_capability() < (8, 9)  # e4m3 in Triton: Ada / Hopper and newer


def _tiles(T, tile: str):
    """The tiles a test names: None (picked by the batch size), SMALL's or GEMV's."""
    return None if tile == "picked" else T.MoeTiles.both(T.MoeConfig(*(SMALL if tile == "small" else GEMV)))


@pytest.fixture(scope="module")
def T():
    patch_interpreter()
    from minisgl_cli.kernels.triton import moe as triton_moe

    return triton_moe


def _weights(n_exp: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n_exp, 2 * inter, hidden, generator=g) * hidden**-0.5,
            torch.randn(n_exp, hidden, inter, generator=g) * inter**-0.5)


def _reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    """fp32, one (token, choice) at a time."""
    x, gate_up, down = x.float(), gate_up.to(x.device).float(), down.to(x.device).float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-2) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * want.abs().max().item(), (err, want.abs().max().item())


# DeepSeek's routers: (scoring, experts, groups, groups kept, group score, bias, renormalize, scale, top-k)
GROUPED = {
    "v3": ("sigmoid", 256, 8, 4, "top2_sum", True, True, 2.5, 8),
    "v3-one-group": ("sigmoid", 64, 1, 1, "top2_sum", True, True, 1.0, 6),
    "v2": ("softmax", 160, 8, 3, "max", False, False, 16.0, 6),  # groups of 20: not a power of two
    "v2-lite": ("softmax", 64, 1, 1, "max", False, False, 1.0, 6),  # no grouping at all
}


@pytest.mark.parametrize("case", list(GROUPED))
def test_grouped_routing_in_one_launch_picks_what_the_torch_router_picks(T, case):
    """kernels/triton/moe.py's route_grouped (through layers/moe.py's route_grouped with the ops) against the torch
    steps it replaces: the same experts, ascending, and the same weights to fp32 rounding (the renormalizing sum may
    add in another order); the groups matter (the test can tell: without them other experts win)."""
    from dataclasses import replace

    from minisgl_cli.kernels.triton import ops
    from minisgl_cli.layers.moe import route_grouped
    from minisgl_cli.layers.routing import GroupedRouting

    scoring, n_exp, n_group, topk_group, group_score, has_bias, renorm, scale, top_k = GROUPED[case]
    r = GroupedRouting(scoring, n_group, topk_group, group_score, has_bias, renorm, scale)
    g = torch.Generator().manual_seed(n_exp + top_k)
    logits = (torch.randn(7, n_exp, generator=g) * 3).to(DEV)
    bias = (torch.randn(n_exp, generator=g) * 0.5).to(DEV) if has_bias else None
    want_w, want_ids = route_grouped(logits, top_k, r, bias)
    got_w, got_ids = route_grouped(logits, top_k, r, bias, ops)
    assert got_ids.dtype == torch.int32 and torch.equal(got_ids.long().cpu(), want_ids.cpu())
    torch.testing.assert_close(got_w.cpu(), want_w.cpu(), rtol=1e-6, atol=0)
    if n_group > 1:
        ungrouped = route_grouped(logits, top_k, replace(r, n_group=1, topk_group=1, group_score="max"), bias)[1]
        assert not torch.equal(ungrouped.cpu(), want_ids.cpu()), "the groups changed nothing"


@pytest.mark.parametrize("n_exp,top_k,n_tok", [(8, 2, 1), (8, 2, 33), (16, 3, 9), (60, 8, 5), (128, 8, 1),
                                               (128, 8, 64)])
def test_route_picks_torchs_top_k(T, n_exp, top_k, n_tok):
    from minisgl_cli.layers.moe import route

    logits = torch.randn(n_tok, n_exp, generator=torch.Generator().manual_seed(n_exp + n_tok)).to(DEV)
    for renormalize in (False, True):
        want_w, want_ids = route(logits, top_k, renormalize)
        got_w, got_ids = T.route(logits, top_k, renormalize)
        assert torch.equal(got_ids.long(), want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_exp,top_k,n_tok,block_m", [(8, 2, 1, 16), (8, 2, 64, 16), (128, 8, 3, 16),
                                                      (128, 8, 64, 32), (4, 1, 70, 64), (128, 8, 600, 16),
                                                      (256, 8, 600, 16)])  # 256 experts: chunks of 128
def test_align_sorts_every_slot_once_into_its_experts_blocks(T, n_exp, top_k, n_tok, block_m):
    g = torch.Generator().manual_seed(n_tok)
    ids = torch.stack([torch.randperm(n_exp, generator=g)[:top_k] for _ in range(n_tok)]).to(DEV)
    sorted_ids, block_expert, total = (t.cpu() for t in T.align(ids, n_exp, block_m))
    flat = ids.flatten().cpu()
    counts = torch.bincount(flat, minlength=n_exp)
    assert total.item() == int(((counts + block_m - 1) // block_m * block_m).sum())
    rows = sorted_ids[: total.item()].view(-1, block_m)
    real = rows < flat.numel()
    assert sorted(rows[real].tolist()) == list(range(flat.numel()))  # every slot once, padding out of range
    for b, row in enumerate(rows):  # a block's slots chose its expert, in slot order; experts ascend over blocks
        slots = row[real[b]]
        assert (flat[slots] == block_expert[b]).all() and (slots.diff() > 0).all()
    assert (block_expert[: rows.shape[0]].diff() >= 0).all()
    if n_tok * top_k < n_exp:
        assert len(set(block_expert[: rows.shape[0]].tolist())) < n_exp  # experts with no token hold no block


@pytest.mark.parametrize("n_exp,top_k,n_tok", [(8, 2, 1), (8, 2, 64), (16, 8, 3), (128, 8, 1), (128, 8, 17),
                                               (4, 1, 40)])
@pytest.mark.parametrize("tile", ["picked", "small", "gemv"])
def test_fused_experts_match_the_reference(T, n_exp, top_k, n_tok, tile):
    """The choices as given (DeepSeek's router hands them in): aligned blocks, or with the GEMV form a slot a
    program and no alignment."""
    from minisgl_cli.layers.moe import route

    hidden, inter = 64, 48  # K = 48 is not a multiple of the small tile's 32: the masked edge
    gate_up, down = _weights(n_exp, hidden, inter, seed=n_exp + n_tok)
    g = torch.Generator().manual_seed(n_tok)
    x = torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE)
    weights, ids = route(torch.randn(n_tok, n_exp, generator=g).to(DEV), top_k, True)
    tiles = _tiles(T, tile)
    got = T.fused_experts(x, gate_up.to(DEV, DTYPE), down.to(DEV, DTYPE), weights, ids, tiles=tiles)
    assert got.shape == (n_tok, hidden) and got.dtype == DTYPE
    _close(got, _reference(x, gate_up.to(DTYPE), down.to(DTYPE), weights, ids))


@pytest.mark.parametrize("n_exp,top_k,n_tok", [(8, 2, 1), (8, 2, 4), (16, 3, 2), (128, 8, 1), (60, 8, 3),
                                               (4, 1, 4)])
@pytest.mark.parametrize("tile", ["picked", "small", "gemv"])
def test_one_slot_experts_route_themselves_and_match_the_reference(T, n_exp, top_k, n_tok, tile):
    """The few-token path (a slot a block of the aligned kernels or a slot a program of the GEMV form, routed inside
    the gate/up pass) against the reference on route()'s choices, renormalized or not, summed or as terms; a tile
    smaller than the shapes masks every edge."""
    from minisgl_cli.layers.moe import route

    hidden, inter = 64, 47  # 47 rows: a masked row tile in gate/up, a masked K step in down
    gate_up, down = (w.to(DEV, DTYPE) for w in _weights(n_exp, hidden, inter, seed=n_exp + n_tok))
    g = torch.Generator().manual_seed(n_tok + 100)
    x = torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE)
    logits = torch.randn(n_tok, n_exp, generator=g).to(DEV)
    tiles = _tiles(T, tile)
    for renormalize in (False, True):
        got = T.one_slot_experts(x, logits, gate_up, down, top_k, renormalize, tiles=tiles)
        terms = T.one_slot_experts(x, logits, gate_up, down, top_k, renormalize, tiles=tiles, terms=True)
        assert terms.shape == (n_tok, top_k, hidden)
        torch.testing.assert_close(terms.sum(dim=1), got, rtol=0, atol=0)
        assert got.shape == (n_tok, hidden) and got.dtype == DTYPE
        _close(got, _reference(x, gate_up, down, *route(logits, top_k, renormalize)))
        aligned = T.fused_experts(x, gate_up, down, *T.route(logits, top_k, renormalize))
        _close(got, aligned, tol=1e-2)  # the same terms, each rounded where the aligned path rounds it


@pytest.mark.parametrize("n_exp", [8, 128])
def test_one_token_routes_apart_from_many_experts(T, n_exp, monkeypatch):
    """At one token (the GEMV form) a model of ROUTE_APART_EXPERTS experts or more routes in a launch of its own and
    runs the GEMV form on its choices; fewer experts route in the gate/up pass. Either equals the reference."""
    from minisgl_cli.layers.moe import route

    routed_in_gate_up = []
    one_slot = T.one_slot_experts
    monkeypatch.setattr(T, "one_slot_experts", lambda *a, **kw: routed_in_gate_up.append(1) or one_slot(*a, **kw))

    top_k, hidden, inter = 8 if n_exp > 8 else 2, 64, 47
    gate_up, down = (w.to(DEV, DTYPE) for w in _weights(n_exp, hidden, inter, seed=n_exp))
    g = torch.Generator().manual_seed(n_exp + 1)
    x = torch.randn(1, hidden, generator=g).to(DEV, DTYPE)
    logits = torch.randn(1, n_exp, generator=g).to(DEV)
    got = T.routed_experts(x, logits, gate_up, down, top_k, True)
    assert bool(routed_in_gate_up) == (n_exp < T.ROUTE_APART_EXPERTS)
    assert torch.equal(got, T.fused_experts(x, gate_up, down, *T.route(logits, top_k, True)))  # the same sums
    _close(got, _reference(x, gate_up, down, *route(logits, top_k, True)))


@pytest.mark.skipif(NO_FP8, reason="FP8 needs compute capability 8.9+")
@pytest.mark.parametrize("tile", ["small", "gemv"])
def test_one_slot_fp8_experts_match_their_dequantized_weights(T, tile):
    """FP8 experts on the few-token path run w8a16: codes widened, the row's scale on the finished dot."""
    from minisgl_cli.layers.moe import route

    n_exp, top_k, n_tok, hidden, inter = 16, 4, 3, 64, 48
    (gu, gs), (dn, ds) = (_fp8_rows(w) for w in _weights(n_exp, hidden, inter, seed=4))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE)
    logits = torch.randn(n_tok, n_exp, generator=g).to(DEV)
    got = T.one_slot_experts(x, logits, gu.to(DEV), dn.to(DEV), top_k, True, gs.to(DEV), ds.to(DEV),
                             tiles=_tiles(T, tile))
    want = _reference(x, *(c.float() * s[..., None] for c, s in ((gu, gs), (dn, ds))), *route(logits, top_k, True))
    _close(got, want)


@pytest.mark.skipif(NO_FP8, reason="FP8 needs compute capability 8.9+")
def test_fp8_experts_match_their_dequantized_weights(T):
    from minisgl_cli.layers.moe import route

    n_exp, top_k, n_tok, hidden, inter = 16, 4, 9, 64, 48
    gate_up, down = _weights(n_exp, hidden, inter, seed=2)
    codes, scales = [], []
    for w in (gate_up, down):  # e4m3 with an fp32 scale per output row, as --quantization fp8 stores a linear
        s = w.abs().amax(-1) / 448.0
        codes.append((w / s[..., None]).to(torch.float8_e4m3fn))
        scales.append(s)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE)
    weights, ids = route(torch.randn(n_tok, n_exp, generator=g).to(DEV), top_k, False)
    got = T.fused_experts(x, codes[0].to(DEV), codes[1].to(DEV), weights, ids, scales[0].to(DEV),
                          scales[1].to(DEV), tiles=T.MoeTiles.both(T.MoeConfig(*SMALL)))
    want = _reference(x, *(c.float() * s[..., None] for c, s in zip(codes, scales)), weights, ids)
    _close(got, want)


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.skipif(NO_FP8, reason="FP8: 8.9+"))])
def test_gpt_oss_experts_biases_and_clamped_swiglu_match_the_torch_path(T, fp8):
    """gpt-oss's experts (a bias on each projection, the clamped SwiGLU) on the aligned and the few-token path,
    against layers/moe.py's torch path on the same (dequantized) weights, gpt-oss's routing (top-k, then softmax)."""
    from minisgl_cli.layers.kernel_choice import Kernels
    from minisgl_cli.layers.moe import SwiGLU, fused_experts, route

    n_exp, top_k, hidden, inter = 8, 2, 64, 48
    gate_up, down = _weights(n_exp, hidden, inter, seed=7)
    g = torch.Generator().manual_seed(8)
    gate_up, down = gate_up * 4, down * 4  # past the clamp's limit: both clamps cut some values
    biases = (torch.randn(n_exp, 2 * inter, generator=g), torch.randn(n_exp, hidden, generator=g))
    act = SwiGLU(limit=1.5, alpha=1.702)
    if fp8:
        (gu, gs), (dn, ds) = (_fp8_rows(w) for w in (gate_up, down))
        gate_up, down = gu.float() * gs[..., None], dn.float() * ds[..., None]
        weights_kw = dict(gate_up=gu.to(DEV), down=dn.to(DEV), gate_up_scale=gs.to(DEV), down_scale=ds.to(DEV))
    else:
        weights_kw = dict(gate_up=gate_up.to(DEV, DTYPE), down=down.to(DEV, DTYPE))
    swiglu = T.SwiGLUExperts(biases[0].to(DEV, DTYPE), biases[1].to(DEV, DTYPE), act.limit, act.alpha)
    for n_tok in (3, 6):  # the few-token path, then the aligned one (FP8: w8a16 both, below W8A8_MIN_TOKENS)
        x = torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE)
        logits = torch.randn(n_tok, n_exp, generator=g).to(DEV)
        weights, ids = route(logits, top_k, True, topk_first=True)
        want = fused_experts(x.float().cpu(), gate_up.to(DTYPE).float(), down.to(DTYPE).float(), weights.cpu(),
                             ids.cpu(), Kernels(), grouped=False, act_fn=act,
                             biases=(biases[0].to(DTYPE).float(), biases[1].to(DTYPE).float()))
        got = T.routed_experts(x, logits, **weights_kw, top_k=top_k, renormalize=True, swiglu=swiglu)
        _close(got.cpu(), want)
        plain = T.routed_experts(x, logits, **weights_kw, top_k=top_k, renormalize=True)
        assert (plain.cpu().float() - want).abs().max() > 0.1, "the biases and activation changed nothing"


def _fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes with an fp32 scale per output row, as --quantization fp8 stores an expert matrix."""
    s = w.abs().amax(-1) / 448.0
    return (w / s[..., None]).to(torch.float8_e4m3fn), s


def _w8a8_reference(x, gate_up, down, weights, ids) -> torch.Tensor:
    """The w8a8 kernels' arithmetic in fp32 (dequantized weights): each token row, and each slot's SiLU(gate) * up
    rounded to x's dtype as the kernel writes it, through e4m3 per row and back before its projection."""
    from minisgl_cli.kernels.fp8 import round_trip_rows

    xq, gate_up, down = round_trip_rows(x), gate_up.to(x.device).float(), down.to(x.device).float()
    out = torch.zeros_like(xq)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (gate_up[e] @ xq[t]).to(x.dtype).float().chunk(2)
            h = (F.silu(gate).to(x.dtype).float() * up).to(x.dtype)
            out[t] += w * (down[e] @ round_trip_rows(h[None])[0])
    return out


@pytest.mark.skipif(NO_FP8 or INTERPRET, reason="FP8 MMAs need compute capability 8.9+ (and a GPU)")
@pytest.mark.parametrize("n_exp,top_k,n_tok", [(8, 2, 1), (16, 8, 3), (128, 8, 17), (4, 1, 40), (128, 8, 64)])
@pytest.mark.parametrize("tile", ["w8a8", "small"])
def test_w8a8_experts_match_the_quantized_reference(T, n_exp, top_k, n_tok, tile):
    """w8a8 (activations per token to e4m3, FP8 MMAs): tight against a reference that rounds the activations as
    the kernels do (left: fp32 sums in another order, a bf16 ulp of h now and then moving an e4m3 code), loose
    against the bf16 one. e4m3 keeps 3 mantissa bits, a rounding errs by up to 2^-4 of the value (RMS ~3.6%);
    two of them (x, h) put ~5% RMS on the output: 10% of its norm is the bound."""
    from minisgl_cli.layers.moe import route

    hidden, inter = 64, 48  # K = 48: a masked edge under every BLOCK_K
    gate_up, down = _weights(n_exp, hidden, inter, seed=n_exp + n_tok)
    (gu, gs), (dn, ds) = _fp8_rows(gate_up), _fp8_rows(down)
    g = torch.Generator().manual_seed(n_tok)
    x = torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE)
    weights, ids = route(torch.randn(n_tok, n_exp, generator=g).to(DEV), top_k, True)
    tiles = T.MoeTiles.both(T.MoeConfig(*SMALL), fp8_act=True) if tile == "small" else T.pick_tiles(n_tok, True, True)
    assert tiles.fp8_act
    got = T.fused_experts(x, gu.to(DEV), dn.to(DEV), weights, ids, gs.to(DEV), ds.to(DEV), tiles=tiles)
    assert got.shape == (n_tok, hidden) and got.dtype == DTYPE
    wq = [c.float() * s[..., None] for c, s in ((gu, gs), (dn, ds))]
    _close(got, _w8a8_reference(x, *wq, weights, ids), tol=1e-2)
    want = _reference(x, *wq, weights, ids)
    assert ((got.float() - want).norm() / want.norm()).item() < 0.1
    w8a16 = T.fused_experts(x, gu.to(DEV), dn.to(DEV), weights, ids, gs.to(DEV), ds.to(DEV),
                            tiles=T.pick_tiles(n_tok, True, False))
    assert not torch.equal(got, w8a16)  # the activations were rounded


@pytest.mark.parametrize("n_tok,k", [(1, 8), (3, 2), (5, 8)])
def test_the_norm_sums_the_experts_terms_as_torch_does(T, n_tok, k):
    """rmsnorm(terms=k) over [T k, H] terms: the residual add and norm of their sum, as torch's sum then the norm."""
    from minisgl_cli.kernels.triton import ops as triton_ops

    g = torch.Generator().manual_seed(n_tok)
    terms = torch.randn(n_tok, k, 96, generator=g).to(DEV, DTYPE)
    residual = torch.randn(n_tok, 96, generator=g).to(DEV, DTYPE)
    weight = (1 + 0.1 * torch.randn(96, generator=g)).to(DEV, DTYPE)
    r1, r2 = residual.clone(), residual.clone()
    got = triton_ops.rmsnorm(terms.view(-1, 96), weight, 1e-6, residual=r1, pdl=False, terms=k)
    want = triton_ops.rmsnorm(terms.sum(dim=1), weight, 1e-6, residual=r2, pdl=False)
    assert got.shape == (n_tok, 96)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA graph")
def test_fused_experts_replay_in_a_cuda_graph(T):
    from minisgl_cli.layers.moe import route

    n_exp, top_k, n_tok, hidden, inter = 128, 8, 4, 256, 128
    gate_up, down = (w.to(DEV, DTYPE) for w in _weights(n_exp, hidden, inter, seed=5))

    def inputs(seed: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        logits = torch.randn(n_tok, n_exp, generator=g).to(DEV)  # fp32: no ties for torch.topk to break its way
        return [torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE), logits]

    def aligned(x, logits):
        return T.fused_experts(x, gate_up, down, *T.route(logits, top_k, True), pdl=True)

    def one_slot(x, logits):
        return T.one_slot_experts(x, logits, gate_up, down, top_k, True, pdl=True)

    def one_token(x, logits):  # the picked tiles' GEMV form
        return T.one_slot_experts(x[:1], logits[:1], gate_up, down, top_k, True, pdl=True)

    assert T.pick_tiles(1).gate_up.block_m == 1
    for run in (aligned, one_slot, one_token):
        static = inputs(0)
        run(*static)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run(*static)
        for dst, src in zip(static, inputs(1)):
            dst.copy_(src)
        graph.replay()
        torch.testing.assert_close(out, run(*static), rtol=0, atol=0)
        rows = out.shape[0]
        w, ids = route(static[1][:rows], top_k, True)
        _close(out, _reference(static[0][:rows], gate_up, down, w, ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the MoE block on CUDA")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n_tok", [1, 3, 8, 200])
def test_moe_block_takes_the_fused_path_and_matches_the_torch_one(T, n_tok, fp8):
    """Qwen3-30B-A3B's expert shapes (a quarter of its experts), bf16 or FP8 experts: the block with the fused ops
    on (Triton) and off (the grouped GEMM or the loop, over the dequantized FP8 weights) agree."""
    from minisgl_cli.distributed import TPInfo
    from minisgl_cli.kernels.triton.moe_tiles import fp8_act
    from minisgl_cli.layers.kernel_choice import Kernels
    from minisgl_cli.layers.moe import MoE, triton_experts
    from minisgl_cli.layers.norm import Terms

    if fp8 and NO_FP8:
        pytest.skip("FP8 needs compute capability 8.9+")
    kernels = Kernels()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE)
    try:
        with torch.device(DEV):  # as the engine builds a model: FP8 codes stay e4m3
            block = MoE(32, 8, 2048, 768, True, TPInfo(), kernels, fp8=fp8)
    finally:
        torch.set_default_dtype(prev)
    g = torch.Generator(DEV).manual_seed(n_tok)
    block.gate.weight.data.normal_(0, 2048**-0.5, generator=g)
    for e in range(32):
        for proj, shape in (("gate_proj", (768, 2048)), ("up_proj", (768, 2048)), ("down_proj", (2048, 768))):
            w = torch.randn(shape, device=DEV, generator=g, dtype=DTYPE) * shape[1] ** -0.5
            block.experts.load_expert(e, proj, w)
    x = torch.randn(n_tok, 2048, device=DEV, generator=g, dtype=DTYPE)
    assert triton_experts(x, kernels, fp8) is not None
    out = block(x)  # one rank on CUDA: the choices' terms, for the next norm to sum
    assert isinstance(out, Terms) and out.terms.shape[:2] == (n_tok, 8)
    fused = out.summed()
    # bf16 logits tie now and then; where the 8th and 9th probabilities do, either expert is right
    probs = torch.softmax(block.gate(x).float(), dim=-1).sort(dim=-1, descending=True).values
    clear = probs[:, 7] > probs[:, 8]
    kernels.fused = False
    assert triton_experts(x, kernels, fp8) is None
    torch_path = block(x)
    if fp8 and fp8_act(n_tok):
        # w8a8: the torch path rounds the dequantized x and weights to bf16 and sums in another order, so h
        # differs by an ulp (2^-8) here and there, and where it does the e4m3 code moves a whole step (2^-3) with
        # odds ~2^-5: with every element an ulp off, ~3% of h moves, sqrt(1/32) / 8 = 2.2% of the output's norm
        # (2.1% measured at 8 tokens, H200). The exact rounding is test_w8a8_experts_match_the_quantized_reference's.
        got, want = fused[clear].float(), torch_path[clear].float()
        assert ((got - want).norm() / want.norm()).item() < 4e-2
        _close(got, want, tol=1e-1)
    else:
        _close(fused[clear], torch_path[clear])


def test_deepseek_routing_runs_through_the_fused_experts(T):
    """DeepSeek's grouped top-k (sigmoid scores, correction bias, scaling factor) chooses; the fused kernels run
    that choice as it is (layers/moe.py hands `fused_experts` the weights and ids)."""
    from minisgl_cli.layers.moe import route_grouped
    from minisgl_cli.layers.routing import GroupedRouting

    n_exp, top_k, hidden, inter, n_tok = 16, 4, 64, 48, 5
    gate_up, down = (w.to(DEV, DTYPE) for w in _weights(n_exp, hidden, inter, seed=3))
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n_tok, hidden, generator=g).to(DEV, DTYPE)
    r = GroupedRouting(scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum", correction_bias=True,
                       renormalize=True, routed_scaling_factor=2.5)
    weights, ids = route_grouped(torch.randn(n_tok, n_exp, generator=g).to(DEV), top_k, r,
                                 (torch.randn(n_exp, generator=g) * 0.1).to(DEV))
    got = T.fused_experts(x, gate_up, down, weights, ids.to(torch.int32))
    _close(got, _reference(x, gate_up, down, weights, ids))
