"""Attention backends against the torch reference: Triton (and FlashInfer when importable) on CUDA, selection on CPU."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import random
import sys

import pytest
import torch

from minisgl_cli.attention import create_backend
from minisgl_cli.attention.torch_backend import TorchBackend
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.kvcache.pool import KVPool, KVShape

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: Triton kernels run on the GPU machine"
)
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
GPU_BACKENDS = ["triton"] + (["flashinfer"] if HAS_FLASHINFER else [])

# (num_heads, num_kv_heads, head_dim): Llama-8B, Qwen3-0.6B, SmolLM2-135M, plain MHA
HEAD_SHAPES = [(32, 8, 128), (16, 8, 128), (9, 3, 64), (8, 8, 64)]
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative L2 error vs fp32 reference


# --- helpers ---------------------------------------------------------------------------------------
def make_case(
    mode: str,
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: tuple[int, int, int],
    page_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
):
    """A one-layer pool holding random KV for every request's prefix, pages handed out in shuffled order.

    Returns (pool, batch, q, k, v) where k/v are this step's new tokens (not yet stored).
    """
    h, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_needed = sum(-(-s // page_size) for s in seq_lens)
    pool = KVPool(KVShape(1, hkv, d, dtype), pages_needed + 4, page_size, len(seq_lens) + 1, max(seq_lens), device)
    for t in (pool.k[0], pool.v[0]):  # random everywhere: stale or wrongly indexed reads show up
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    rows, out_loc = [], []
    for p, s in zip(prefix_lens, seq_lens):
        pages = pool.alloc_pages(-(-s // page_size))
        rng.shuffle(pages)
        slots = pool.slots_of_pages(pages)[:s]
        row = pool.alloc_req_row()
        pool.page_table[row, :s] = slots.to(device, torch.int32)
        rows.append(row)
        out_loc.append(slots[p:])
    T = sum(extend_lens)
    batch = ForwardBatch.build(mode, [0] * T, rows, prefix_lens, extend_lens, torch.cat(out_loc), device, HostBuffers())
    q, k, v = (torch.randn((T, n, d), generator=gen).to(device, dtype) for n in (h, hkv, hkv))
    return pool, batch, q, k, v


def fp32_reference(pool: KVPool, batch: ForwardBatch, q, k, v, heads) -> torch.Tensor:
    """The torch backend over an fp32 copy of the pool (inputs upcast), so the reference adds no rounding."""
    h, hkv, d = heads
    ref_pool = copy.copy(pool)
    ref_pool.shape = dataclasses.replace(pool.shape, dtype=torch.float32)
    ref_pool.k = [pool.k[0].float().clone()]
    ref_pool.v = [pool.v[0].float().clone()]
    ref = TorchBackend(ref_pool, h, hkv, d, 1.0 / math.sqrt(d))
    ref_batch = copy.copy(batch)
    ref.prepare(ref_batch)
    return ref.forward(q.float(), k.float(), v.float(), 0, ref_batch)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, label: str) -> None:
    assert out.shape == ref.shape
    out = out.float()
    assert torch.isfinite(out).all(), f"{label}: non-finite output"
    rel = ((out - ref).norm() / ref.norm()).item()
    max_abs = (out - ref).abs().max().item()
    print(f"ERR {label}: rel_l2={rel:.2e} max_abs={max_abs:.2e}")
    assert rel < TOL[dtype], f"{label}: relative error {rel:.2e} >= {TOL[dtype]:.0e} (max abs {max_abs:.2e})"


def run_backend(name: str, pool, batch, q, k, v, heads) -> torch.Tensor:
    h, hkv, d = heads
    be = create_backend(name, pool, h, hkv, d, 1.0 / math.sqrt(d), pool.device)
    be.prepare(batch)
    out = be.forward(q, k, v, 0, batch)
    torch.cuda.synchronize()
    return out


# Context lengths 1..8k, mixed in one batch; lengths straddle KV tiles and pages on purpose.
DECODE_SEQ_LENS = [1, 2, 17, 64, 65, 1000, 4097, 8192]
# (cached prefix, new tokens): no prefix, prefix + one token, prefix + chunk, long prefill, long prefix.
EXTEND_CASES = [(0, 1), (0, 77), (100, 1), (13, 64), (500, 300), (0, 1024), (4000, 129), (6000, 2192)]


# --- GPU: kernels vs reference -----------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda s: "h{}_kv{}_d{}".format(*s))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_decode_matches_reference(backend, heads, page_size, dtype):
    seq_lens = DECODE_SEQ_LENS
    case = make_case("decode", [s - 1 for s in seq_lens], [1] * len(seq_lens), heads, page_size, dtype, "cuda")
    pool, batch, q, k, v = case
    out = run_backend(backend, *case, heads)
    check(out, fp32_reference(pool, batch, q, k, v, heads), dtype, f"{backend} decode {heads} ps={page_size} {dtype}")
    # The step's K/V must have landed in the pool.
    assert torch.equal(pool.k[0][batch.out_cache_loc], k) and torch.equal(pool.v[0][batch.out_cache_loc], v)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_big_batch(splits):
    """A batch big enough for one KV split per request: the partial pass writes the output, no reduce."""
    from minisgl_cli.kernels.triton import attention as tk

    heads, dtype = (32, 8, 128), torch.bfloat16
    rnd = random.Random(splits)
    seq_lens = [rnd.randint(1, 1500) for _ in range(96)]
    pool, batch, q, k, v = make_case("decode", [s - 1 for s in seq_lens], [1] * 96, heads, 16, dtype, "cuda")
    pool.store(0, batch.out_cache_loc, k, v)
    out = torch.full_like(q, float("nan"))
    tk.decode_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                        1.0 / math.sqrt(heads[2]), splits, out=out)
    check(out, fp32_reference(pool, batch, q, k, v, heads), dtype, f"triton decode bs96 splits={splits}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("heads", HEAD_SHAPES, ids=lambda s: "h{}_kv{}_d{}".format(*s))
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_extend_matches_reference(backend, heads, page_size, dtype):
    prefix, ext = zip(*EXTEND_CASES)
    case = make_case("prefill", list(prefix), list(ext), heads, page_size, dtype, "cuda", seed=1)
    pool, batch, q, k, v = case
    out = run_backend(backend, *case, heads)
    check(out, fp32_reference(pool, batch, q, k, v, heads), dtype, f"{backend} extend {heads} ps={page_size} {dtype}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_triton_fp32_tight(mode):
    """fp32 in, IEEE dots: the kernels must agree with the reference to rounding, not just to bf16 noise."""
    heads = (9, 3, 64)
    if mode == "decode":
        case = make_case(mode, [0, 63, 700], [1, 1, 1], heads, 16, torch.float32, "cuda", seed=2)
    else:
        case = make_case(mode, [0, 40, 0], [5, 90, 130], heads, 16, torch.float32, "cuda", seed=2)
    pool, batch, q, k, v = case
    out = run_backend("triton", *case, heads)
    check(out, fp32_reference(pool, batch, q, k, v, heads), torch.float32, f"triton {mode} fp32")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_decode_cuda_graph_replay(backend):
    """Capture decode once at bs=8, replay twice with smaller real batches of different context lengths."""
    heads, dtype, bs, ps = (32, 8, 128), torch.bfloat16, 8, 16
    h, hkv, d = heads
    # One pool big enough for both replays' requests.
    first, second = [5, 300, 1, 2048, 77], [8192, 3, 1500]
    pool, batch1, q1, k1, v1 = make_case("decode", [s - 1 for s in first + second], [1] * 8, heads, ps, dtype, "cuda")
    be = create_backend(backend, pool, h, hkv, d, 1.0 / math.sqrt(d), "cuda")
    assert be.supports_cuda_graph
    be.init_cuda_graph_state(bs)
    static = ForwardBatch.build("decode", [0] * bs, [0] * bs, [0] * bs, [1] * bs, torch.zeros(bs, dtype=torch.int64),
                                "cuda", HostBuffers())
    be.prepare_for_capture(bs, static)
    qs, ks, vs = torch.zeros_like(q1), torch.zeros_like(k1), torch.zeros_like(v1)
    be.forward(qs, ks, vs, 0, static)  # warm-up: compiles kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = be.forward(qs, ks, vs, 0, static)
    for sel in (list(range(5)), [5, 6, 7]):
        n = len(sel)
        sub = ForwardBatch.build(
            "decode", [0] * n, batch1.req_rows[sel].tolist(), [batch1.seq_lens_cpu[i] - 1 for i in sel], [1] * n,
            batch1.out_cache_loc[sel], "cuda", HostBuffers(),
        )
        for buf, src in ((qs, q1), (ks, k1), (vs, v1)):
            buf.zero_()
            buf[:n].copy_(src[sel])
        static.out_cache_loc.zero_()  # padding rows write to the scratch page
        static.out_cache_loc[:n].copy_(sub.out_cache_loc)
        be.prepare_for_replay(sub, bs)
        graph.replay()
        torch.cuda.synchronize()
        ref = fp32_reference(pool, sub, q1[sel], k1[sel], v1[sel], heads)
        check(out_static[:n], ref, dtype, f"{backend} graph replay n={n}")


# --- CPU: backend selection and a cheap sanity check of the torch backend ---------------------------
def _tiny_pool(device: str = "cpu") -> KVPool:
    return KVPool(
        KVShape(1, 2, 16, torch.float32), num_pages=16, page_size=4, max_reqs=2, max_context_len=40, device=device
    )


def test_create_backend_auto_is_torch_on_cpu():
    gpu_mods_before = {m for m in ("triton", "flashinfer") if m in sys.modules}
    be = create_backend("auto", _tiny_pool(), 4, 2, 16, 0.25, "cpu")
    assert isinstance(be, TorchBackend)
    # The CPU path must not pull in the GPU libraries.
    assert {m for m in ("triton", "flashinfer") if m in sys.modules} == gpu_mods_before


@needs_cuda
def test_create_backend_auto_is_triton_on_cuda_even_with_flashinfer_installed(monkeypatch):
    """FlashInfer runs only by name: ours was faster end to end on an H100 and an H200 (docs/gpu.md). auto does not
    so much as import its backend (it tried FlashInfer first whenever it imported)."""
    from minisgl_cli.attention.triton_backend import TritonBackend

    monkeypatch.delitem(sys.modules, "minisgl_cli.attention.flashinfer_backend", raising=False)
    be = create_backend("auto", _tiny_pool("cuda"), 4, 2, 16, 0.25, "cuda")
    assert isinstance(be, TritonBackend)
    assert "minisgl_cli.attention.flashinfer_backend" not in sys.modules


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_create_backend_gpu_names_on_cpu_raise(name, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # under Triton's interpreter "triton" runs on the CPU
    with pytest.raises(ValueError, match="needs a CUDA device"):
        create_backend(name, _tiny_pool(), 4, 2, 16, 0.25, "cpu")


def test_create_backend_unknown_name():
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_backend("xformers", _tiny_pool(), 4, 2, 16, 0.25, "cpu")


def test_torch_decode_equals_last_row_of_extend():
    """Decoding token L-1 over a cached prefix of L-1 gives the extend's last row over all L tokens."""
    heads, L = (4, 2, 16), 23
    pool, batch, q, k, v = make_case("prefill", [0], [L], heads, 4, torch.float32, "cpu", seed=3)
    be = create_backend("torch", pool, 4, 2, 16, 0.25, "cpu")
    be.prepare(batch)
    full = be.forward(q, k, v, 0, batch)
    dec = ForwardBatch.build("decode", [0], batch.req_rows.tolist(), [L - 1], [1], batch.out_cache_loc[-1:], "cpu",
                             HostBuffers())
    be.prepare(dec)
    last = be.forward(q[-1:], k[-1:], v[-1:], 0, dec)
    torch.testing.assert_close(last, full[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_decode_rows_come_out_alike_alone_in_any_batch_on_any_thread_count(dtype):
    """On the CPU over a 16-bit pool a decode row rounds alike alone and beside longer rows, whatever the thread
    count: torch's flash attention rounded a (request, KV head) by the thread the batch size handed it to."""
    lens = [40, 75, 130, 600, 61, 90]
    pool, batch, q, k, v = make_case("decode", [n - 1 for n in lens], [1] * len(lens), (9, 3, 64), 1, dtype, "cpu",
                                     seed=7)
    be = create_backend("torch", pool, 9, 3, 64, 0.125, "cpu")
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            be.prepare(batch)
            together = be.forward(q, k, v, 0, batch)
            if n == 1:
                first = together
            assert torch.equal(together, first), n
            for i in (0, 1, 4):
                one = ForwardBatch.build("decode", [0], batch.req_rows.tolist()[i : i + 1], [lens[i] - 1], [1],
                                         batch.out_cache_loc[i : i + 1], "cpu", HostBuffers())
                be.prepare(one)
                assert torch.equal(be.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], 0, one), together[i : i + 1])
    finally:
        torch.set_num_threads(threads)


def test_torch_extend_rows_come_out_alike_cold_after_a_prefix_hit_and_in_chunks():
    """On the CPU over a 16-bit pool every prefill row rounds alike whatever of its prompt was cached and wherever the
    step ends: a prompt's KV, and so its greedy answer, does not depend on what ran before it (issue 30: SDPA rounded
    a row by the rows of its call, which a prefix hit or a chunk boundary changes)."""
    heads, L = (9, 3, 64), 100
    pool, batch, q, k, v = make_case("prefill", [0], [L], heads, 1, torch.bfloat16, "cpu", seed=5)
    be = create_backend("torch", pool, 9, 3, 64, 0.125, "cpu")
    be.prepare(batch)
    cold = be.forward(q, k, v, 0, batch)  # stores the prompt's KV: the prefix the steps below reuse
    loc, row = batch.out_cache_loc, batch.req_rows.tolist()
    for start, end in [(24, L), (24, 35), (31, 33), (L - 1, L), (50, 80)]:
        step = ForwardBatch.build("prefill", [0] * (end - start), row, [start], [end - start], loc[start:end], "cpu",
                                  HostBuffers())
        be.prepare(step)
        out = be.forward(q[start:end], k[start:end], v[start:end], 0, step)
        assert torch.equal(out, cold[start:end]), (start, end)
