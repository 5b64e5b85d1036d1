"""The decode-step fusions (Kernels.fused_decode): the gate-up GEMV with the SiLU-and-mul in its epilogue, the qkv GEMV
with RoPE and the K/V store in its epilogue, and the GEMV of 2-4 rows (kernels/triton/gemv.py), each against the
unfused kernels or torch it replaces.

Runs on CUDA (bf16, Llama-3.1-8B's and Qwen3-0.6B's widths, and the engine's decode logits with the fusions on vs
off); without a GPU the kernels run under Triton's interpreter on CPU tensors (fp16, small widths), where triton is
importable and TRITON_INTERPRET=1 was set before it was imported (`make test` does that, as for tests/test_gpu_moe.py):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_decode_fusions.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl_cli.kernels import fp8
from tests.triton_interp import NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON]
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float16
# (I, K) of a gate-up projection (2I weight rows): Llama-3.1-8B's and Qwen3-0.6B's on the GPU; under the interpreter
# small ones, I not a multiple of a program's outputs and K not of the chunk (masked edges)
GATE_UP = [(14336, 4096), (3072, 1024), (300, 1000)] if CUDA else [(13, 96)]
ROWS = [1, 2, 3, 4] if CUDA else [1, 3]  # the interpreter takes seconds a launch: a few cases there
NO_FP8 = CUDA and torch.cuda.get_device_capability() < (8, 9)


@pytest.fixture(scope="module")
def T():
    patch_interpreter()
    from minisgl_cli.kernels.triton import ops

    return ops


def _rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEV, DTYPE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("i,k", GATE_UP)
@pytest.mark.parametrize("rows", ROWS)
def test_gate_up_gemv_with_silu_epilogue_equals_gemv_then_activation(T, i, k, rows):
    """One launch = the gate-up GEMV (or, at 2-4 rows, the GEMM) and silu_and_mul after it, rounded the same."""
    w = _rand(2 * i, k, seed=i + k, scale=k**-0.5)
    x = _rand(rows, k, seed=rows)
    out = torch.full((rows, i), float("nan"), dtype=DTYPE, device=DEV)
    out.copy_(T.gemv(x, w, gate_up=True))
    gate_up = T.gemv(x, w) if rows == 1 else F.linear(x.float(), w.float()).to(DTYPE)  # the unfused GEMV's rounding
    want = T.silu_and_mul(gate_up)
    assert out.shape == (rows, i) and not out.isnan().any()
    # the sums differ only in their order: a bf16 ulp here and there on the rounded gate / up
    assert _rel(out, want) <= 1e-2
    ref = F.silu(x.double() @ w[:i].double().T) * (x.double() @ w[i:].double().T)
    assert _rel(out, ref) <= 2 * _rel(want, ref) + 1e-3


@pytest.mark.parametrize("config", [None, (8, 512, 4), (8, 64, 4, 3, 2 if CUDA else 0)], ids=["picked", "fma", "mma"])
def test_fp8_gate_up_gemv_with_silu_epilogue(T, config):
    """FP8 weights at one row: both GEMV kernels (FMA; tensor cores) pair gate and up rows in the epilogue."""
    if NO_FP8:
        pytest.skip("e4m3 in Triton: Ada / Hopper and newer")
    if config is None and not CUDA:
        pytest.skip("the picked tensor-core config prefetches through inline PTX, which the interpreter lacks")
    i, k = (14336, 4096) if CUDA else (24, 1024)  # the tensor-core kernel takes K in steps of 16 * 64
    codes, scale = fp8.quantize_rows(_rand(2 * i, k, seed=k, scale=k**-0.5).float())
    scale = scale[:, 0].contiguous()
    x = _rand(1, k, seed=3)
    out = T.gemv(x, codes, config=config, scale=scale, gate_up=True)
    want = T.silu_and_mul(T.gemv(x, codes, config=config, scale=scale))
    assert out.shape == (1, i) and _rel(out, want) <= 1e-2
    if config is None or len(config) == 3:  # the FMA kernel: the same sums in the same order
        assert torch.equal(out, want)


@pytest.mark.parametrize("n,k", [(6144, 4096), (1024, 3072), (77, 4100)] if CUDA else [(9, 600)])
@pytest.mark.parametrize("rows", [2, 3, 4] if CUDA else [3])
@pytest.mark.parametrize("act", [False, True], ids=["plain", "silu-in"])
def test_gemv_of_a_few_rows_equals_the_gemm(T, n, k, rows, act):
    """2-4 rows in one pass over the weight (bias; the down projection's SiLU-and-mul on its input) vs torch's GEMM."""
    w = _rand(n, k, seed=n, scale=k**-0.5)
    b = _rand(n, seed=k)
    x = _rand(rows, 2 * k if act else k, seed=rows + act)
    out = T.gemv(x, w, b, act_mul=act)
    xin = T.silu_and_mul(x) if act else x
    gemm = F.linear(xin, w, b) if CUDA else F.linear(xin.float(), w.float(), b.float()).to(DTYPE)
    ref = xin.double() @ w.double().T + b.double()
    assert out.shape == (rows, n) and _rel(out, ref) <= 2 * _rel(gemm, ref) + 1e-3


@pytest.mark.skipif(not CUDA, reason="a few seconds under the interpreter for what the GPU run covers")
def test_gemv_of_rows_that_are_a_view(T):
    """Rows a stride apart (a slice of a wider batch) read as they lie, written to a fresh [M, N]."""
    w = _rand(48, 64, seed=1, scale=0.125)
    wide = _rand(3, 128, seed=2)
    out = T.gemv(wide[:, :64], w)
    want = F.linear(wide[:, :64].float(), w.float()).to(DTYPE)
    assert _rel(out, want) <= 1e-2


@pytest.mark.parametrize("rows,kv_fp8", [(1, False), (2, False), (4, False), (1, True), (3, True)] if CUDA
                         else [(3, True)])
def test_qkv_gemv_with_rope_and_kv_store_equals_gemv_then_rope_kernel(T, rows, kv_fp8):
    """One launch = the qkv GEMV (bias, as Qwen2's), then ops.qk_norm_rope_ (no q/k norm) with its K/V store: the
    same rotated rows and the same cache entries (bf16, or an FP8 pool's codes), other slots untouched."""
    if kv_fp8 and NO_FP8:
        pytest.skip("e4m3 in Triton: Ada / Hopper and newer")
    from minisgl_cli.kernels.fp8 import FP8, KVQuant
    from minisgl_cli.layers.rotary import RotaryEmbedding

    (nq, nkv, d), k = ((32, 8, 128), 4096) if CUDA else ((2, 1, 8), 64)
    n = (nq + 2 * nkv) * d
    w, b, x = _rand(n, k, seed=rows, scale=k**-0.5), _rand(n, seed=2), _rand(rows, k, seed=3)
    rope = RotaryEmbedding(d, 4096, 500000.0)
    rope.to(DEV)
    pos = torch.tensor([5, 4000, 17, 3][:rows], device=DEV)
    loc = torch.tensor([2, 7, 9, 11][:rows], device=DEV)
    g = torch.Generator().manual_seed(rows)
    scales = [torch.rand(nkv, generator=g) * 0.1 + 0.01 for _ in range(2)]
    means = [torch.randn(nkv, d, generator=g) * 0.1 for _ in range(2)]
    quant = KVQuant(*(t.to(DEV) for t in (*scales, *means))) if kv_fp8 else None
    caches = [torch.randn(16, nkv, d, generator=g).to(DEV, DTYPE).to(FP8 if kv_fp8 else DTYPE) for _ in range(4)]
    caches[2].copy_(caches[0]), caches[3].copy_(caches[1])  # the fused kernel's pair, then the reference's
    got = T.gemv_rope_kv(x, w, b, pos, rope.cos, rope.sin, nq, nkv, d, (caches[0], caches[1], loc, quant))
    want = T.gemv(x, w, b) if rows == 1 else (F.linear(x, w, b) if CUDA else
                                               F.linear(x.float(), w.float(), b.float()).to(DTYPE))
    T.qk_norm_rope_(want, pos, rope.cos, rope.sin, nq, nkv, d, None, None, 0.0, (caches[2], caches[3], loc, quant))
    assert _rel(got, want) <= 1e-2
    for mine, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert _rel(mine.float(), ref.float()) <= 1e-2
        others = torch.ones(16, dtype=torch.bool, device=DEV)
        others[loc] = False
        assert torch.equal(mine[others].float(), ref[others].float())


@pytest.mark.skipif(not CUDA, reason="the engine's CUDA graphs")
@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-0.6b"])
def test_engine_decode_logits_with_the_fusions_on_and_off(name, monkeypatch):
    """The same decode step at 1 and 3 rows (a graph of 4) with the fusions on and off: the logits agree within
    bf16's noise (tests/test_gpu_numerics.py's bar; its HF comparison runs with them on). Not greedy ids: the fused
    kernels sum in another order, and this dummy model's near-uniform logits would flip on a last-bit tie."""
    from minisgl_cli.engine.batch import ForwardBatch
    from tests.test_gpu_numerics import TOL, _compare, _engine

    engine, cfg = _engine(name, monkeypatch)
    pool, dev, vocab = engine.pool, engine.device, cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    for lens in ([60], [17, 100, 250]):
        seqs = [torch.randint(0, vocab, (n + 1,), generator=g).tolist() for n in lens]
        rows = [pool.alloc_req_row() for _ in lens]
        pages = [pool.alloc_pages(n + 1) for n in lens]
        slots = [pool.slots_of_pages(p).tolist() for p in pages]
        for r, s in zip(rows, slots):
            pool.page_table[r, : len(s)] = torch.tensor(s, dtype=torch.int32, device=dev)
        flat = [t for s, n in zip(seqs, lens) for t in s[:n]]
        locs = [x for s, n in zip(slots, lens) for x in s[:n]]
        engine.forward(ForwardBatch.build("prefill", flat, rows, [0] * len(lens), lens, locs, dev, engine.host))
        logits = {}
        for on in (True, False):
            engine.kernels.fused_decode = on
            engine.capture_graphs()
            batch = ForwardBatch.build("decode", [s[n] for s, n in zip(seqs, lens)], rows, lens, [1] * len(lens),
                                       [s[n] for s, n in zip(slots, lens)], dev, engine.host)
            assert engine.graphs.can_run(batch)
            logits[on] = engine.forward(batch).float()
        for a, b in zip(logits[True], logits[False]):
            diff, agree = _compare(a, b)
            assert diff <= TOL and agree
        for r, p in zip(rows, pages):
            pool.free_req_row(r)
            pool.free_pages(p)
