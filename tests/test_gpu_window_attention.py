"""Sliding-window and sink attention in every attention path against a naive fp32 definition: the Triton decode
(one split and several) and extend kernels, and the torch backend (the CPU's path, blocks and all).

The Triton cases run on CUDA, or without a GPU under Triton's interpreter on CPU tensors (fp32) where triton is
importable and TRITON_INTERPRET=1 was set before it was imported (as tests/test_gpu_moe.py):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_window_attention.py
"""

from __future__ import annotations

import math

import pytest
import torch
from test_attention_kernels import make_case

from minisgl_cli.attention.torch_backend import TorchBackend
from minisgl_cli.kvcache.pool import KVPool
from tests.triton_interp import NEEDS_TRITON, TRITON_RUNS, patch_interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HEADS = (8, 2, 32)  # 4 query heads a KV head
WINDOWS = [0, 8, 45]
# (cached prefix, new tokens): a prompt past the window, a chunk starting inside one, a chunk past two tiles
EXTEND = [(0, 70), (13, 20), (90, 40), (3, 1)]
DECODE = [1, 7, 9, 64, 130, 300]


def naive(pool, batch, q, heads, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """fp32, one query row at a time: keys j <= p (and j > p - window), the sink's exp in the denominator."""
    h, hkv, d = heads
    out = torch.empty(q.shape, dtype=torch.float32)
    t = 0
    for row, seq_len, ext in zip(batch.req_rows.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu):
        slots = pool.page_table[row, :seq_len].long().cpu()
        k, v = pool.k[0].cpu()[slots].float(), pool.v[0].cpu()[slots].float()
        for p in range(seq_len - ext, seq_len):
            lo = max(0, p - window + 1) if window else 0
            for head in range(h):
                kh = head // (h // hkv)
                s = (k[lo : p + 1, kh] @ q[t, head].float().cpu()) / math.sqrt(d)
                if sinks is not None:
                    s = torch.cat([s, sinks[head : head + 1].float().cpu()])
                w = torch.softmax(s, 0)[: p + 1 - lo]
                out[t, head] = w @ v[lo : p + 1, kh]
            t += 1
    return out


def _case(mode: str, dtype: torch.dtype, device: str):
    if mode == "decode":
        return make_case("decode", [s - 1 for s in DECODE], [1] * len(DECODE), HEADS, 16, dtype, device, seed=4)
    prefix, ext = zip(*EXTEND)
    return make_case("prefill", list(prefix), list(ext), HEADS, 16, dtype, device, seed=5)


def _sinks(device: str) -> torch.Tensor:
    return torch.randn(HEADS[0], generator=torch.Generator().manual_seed(6)).mul(2).to(device)


@pytest.mark.gpu
@NEEDS_TRITON
@pytest.mark.parametrize("mode,splits,short", [("decode", 1, None), ("decode", 3, 0), ("merged", 3, 0),
                                                  ("merged", 3, 128), ("merged", 3, None), ("extend", 0, None)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_triton_kernels_window_and_sinks_match_the_definition(mode, splits, short, window, with_sinks):
    """`merged`: the split programs merge their own partials through the split counters (one launch); the same
    output as the separate reduce pass, and the counters left at zero for the next call. short 0: every context over 3
    splits; 128: the contexts up to a tile in one split that writes the output itself, the rest merged, in one batch;
    None (the default, SHORT_CONTEXT 256): every context here in one split but the
    300-position one."""
    patch_interpreter()
    from minisgl_cli.kernels.triton import attention as tk

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    pool, batch, q, k, v = _case("extend" if mode == "extend" else "decode", dtype, DEV)
    pool.store(0, batch.out_cache_loc, k, v)
    sinks = _sinks(DEV) if with_sinks else None
    scale = 1.0 / math.sqrt(HEADS[2])
    if mode != "extend":
        counters = torch.zeros(len(DECODE) * HEADS[1], dtype=torch.int32, device=DEV) if mode == "merged" else None
        out = tk.decode_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens, scale,
                                  splits, window=window, sinks=sinks, counters=counters, short=short)
        if counters is not None:
            assert not counters.any()
            two_pass = tk.decode_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                                           scale, splits, window=window, sinks=sinks, short=short)
            torch.testing.assert_close(out, two_pass, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
            per_head = tk.decode_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                                           scale, splits, window=window, sinks=sinks, counters=counters, short=short,
                                           group_merge=False)  # the merge a head at a time, as before the group's
            torch.testing.assert_close(out, per_head, rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    else:
        out = tk.extend_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                                  batch.qo_indptr, max(batch.extend_lens_cpu), scale, window=window, sinks=sinks)
    ref = naive(pool, batch, q, HEADS, window, sinks)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < tol


@pytest.mark.gpu
@NEEDS_TRITON
@pytest.mark.parametrize("merged", [False, True], ids=["reduce", "merged"])
def test_triton_decode_of_wide_heads_matches_the_definition(merged):
    """Head dim 512 (Gemma 4's global layers): its own tiles, and the split partials merged in column halves, by the
    reduce pass and by the last split program; window and sinks on."""
    patch_interpreter()
    from minisgl_cli.kernels.triton import attention as tk

    heads, window = (HEADS[0], 1, 512), 45
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    pool, batch, q, k, v = make_case("decode", [s - 1 for s in DECODE], [1] * len(DECODE), heads, 16, dtype, DEV,
                                     seed=10)
    pool.store(0, batch.out_cache_loc, k, v)
    sinks = _sinks(DEV)
    counters = torch.zeros(len(DECODE), dtype=torch.int32, device=DEV) if merged else None
    out = tk.decode_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                              1.0 / math.sqrt(heads[2]), 3, window=window, sinks=sinks, counters=counters, short=0)
    ref = naive(pool, batch, q, heads, window, sinks)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < tol


class OneCallBackend(TorchBackend):
    """The torch backend as it attends on the GPU (the kernels' reference) and over an FP8 pool: not row_invariant,
    so decode runs SDPA under the window's mask and each request's extend rows attend in one call."""

    row_invariant = False


@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", [TorchBackend, OneCallBackend], ids=["cpu", "one_call"])
def test_torch_backend_window_and_sinks_match_the_definition(mode, window, with_sinks, dtype, backend):
    """The CPU path: decode through minisgl::decode_attn where it is built (else SDPA over padded keys), extend in
    position-aligned blocks; and the one-call path (OneCallBackend): SDPA under the window's mask."""
    pool, batch, q, k, v = _case("decode" if mode == "decode" else "prefill", dtype, "cpu")
    sinks = _sinks("cpu") if with_sinks else None
    be = backend(pool, *HEADS, 1.0 / math.sqrt(HEADS[2]))
    be.prepare(batch)
    out = be.forward(q, k, v, 0, batch, window=window, sinks=sinks)
    ref = naive(pool, batch, q, HEADS, window, sinks)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert ((out.float() - ref).norm() / ref.norm()).item() < tol


def _in_window_pages(pool: KVPool, batch, window: int, seed: int = 7) -> KVPool:
    """The same KV with layer 0 a window layer (kvcache/pool.py): its own pages, linked to the full ones in shuffled
    order through the slot map, and the positions behind every query's window unlinked (slot 0: stale for attention
    to mask), as a mixed model's pool holds them."""
    p, n = pool.page_size, pool.num_pages
    wp = KVPool(pool.shape, n, p, pool.page_table.shape[0], pool.max_context_len, pool.device, window_layers=(0,),
                num_window_pages=n)
    wp.page_table.copy_(pool.page_table)
    full = torch.arange(p, (n + 1) * p)
    linked = (torch.randperm(n, generator=torch.Generator().manual_seed(seed)) + 1).repeat_interleave(p) * p + full % p
    wp.slot_map[full.to(pool.device)] = linked.to(pool.device)
    for t, src in ((wp.k[0], pool.k[0]), (wp.v[0], pool.v[0])):
        t[linked.to(pool.device)] = src[full.to(pool.device)]
    for row, seq_len, ext in zip(batch.req_rows.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu):
        behind = max(0, seq_len - ext - window + 1)  # the first query's window starts there
        wp.slot_map[pool.page_table[row, :behind].long()] = 0
    return wp


@pytest.mark.parametrize("mode", ["decode", "extend"])
@pytest.mark.parametrize("backend", ["cpu", "one_call", "triton"])
def test_window_layer_reads_its_own_pages_through_the_slot_map(mode, backend):
    """A window layer of a mixed model's pool: stored and read through the full -> window slot map, behind the window
    nothing at all (unlinked), the same attention as the definition over the full pages; the torch backend's paths
    and the Triton decode / extend kernels (MAPPED)."""
    window, dtype = 8, torch.float32
    if backend == "triton":
        if not TRITON_RUNS:
            pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1 with triton importable)")
        patch_interpreter()
        dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    dev = DEV if backend == "triton" else "cpu"
    pool, batch, q, k, v = _case("decode" if mode == "decode" else "prefill", dtype, dev)
    pool.store(0, batch.out_cache_loc, k, v)  # the definition's pool holds this step's KV too
    wp = _in_window_pages(pool, batch, window)
    scale = 1.0 / math.sqrt(HEADS[2])
    if backend == "triton":
        from minisgl_cli.kernels.triton import attention as tk

        wp.store(0, wp.loc_of(0, batch.out_cache_loc), k, v)
        if mode == "decode":
            out = tk.decode_attention(q, wp.k[0], wp.v[0], wp.page_table, batch.req_rows, batch.seq_lens, scale, 3,
                                      window=window, slot_map=wp.slot_map_of(0))
        else:
            out = tk.extend_attention(q, wp.k[0], wp.v[0], wp.page_table, batch.req_rows, batch.seq_lens,
                                      batch.qo_indptr, max(batch.extend_lens_cpu), scale, window=window,
                                      slot_map=wp.slot_map_of(0))
    else:
        be = (TorchBackend if backend == "cpu" else OneCallBackend)(wp, *HEADS, scale)
        be.prepare(batch)
        out = be.forward(q, k, v, 0, batch, window=window)
    ref = naive(pool, batch, q, HEADS, window, None)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert ((out.float().cpu() - ref).norm() / ref.norm()).item() < tol


# Gemma 4's two kinds of layer as (query heads, KV heads, head dim): narrow sliding heads (window 8) and one wide KV
# head of the global layers' 512 (the full-size model's), each layer its own split count at a decode step.
MIXED = ((4, 2, 16), (4, 1, 512))
MIXED_WINDOWS = (8, 0)
MIXED_EXTEND = [(0, 21), (13, 9), (40, 2)]  # (cached prefix, new tokens), fewer than EXTEND's: wide heads cost more


def _mixed_case(mode: str, dtype: torch.dtype, device: str, seed: int = 8):
    """A two-layer pool of MIXED's shapes (random KV everywhere; an FP8 one calibrated to means far from zero, so a
    layer that read another's means would show), `_case`'s requests, and each layer's q / k / v of this step."""
    from minisgl_cli.kvcache.pool import KVShape

    if mode == "decode":
        one, batch, *_ = _case(mode, dtype, device)
    else:
        prefix, ext = zip(*MIXED_EXTEND)
        one, batch, *_ = make_case("prefill", list(prefix), list(ext), MIXED[0], 16, dtype, device, seed=9)
    shape = KVShape(2, MIXED[0][1], MIXED[0][2], dtype, per_layer=tuple((hkv, d) for _, hkv, d in MIXED))
    pool = KVPool(shape, one.num_pages, one.page_size, one.page_table.shape[0], one.max_context_len, device)
    pool.page_table.copy_(one.page_table)
    g = torch.Generator().manual_seed(seed)
    wide = torch.float32 if pool.quantized else dtype
    slots = torch.arange(pool.k[0].shape[0], device=device)
    for layer, (_, hkv, d) in enumerate(MIXED):
        kv = [torch.randn((len(slots), hkv, d), generator=g).to(device, wide) + 3 for _ in range(2)]
        if pool.quantized:
            pool.calibrate(layer, *kv)
        pool.store(layer, slots, *kv)
    T = batch.out_cache_loc.numel()
    qkv = [tuple(torch.randn((T, n, d), generator=g).to(device, wide) for n in (h, hkv, hkv)) for h, hkv, d in MIXED]
    return pool, batch, qkv


def _reference(pool: KVPool, batch, qkv) -> list[torch.Tensor]:
    """Each layer's attention through the torch backend (one call a request, as on the GPU) over a copy of the pool."""
    import copy

    ref_pool = copy.copy(pool)
    ref_pool.k, ref_pool.v = [t.clone() for t in pool.k], [t.clone() for t in pool.v]
    be = OneCallBackend(ref_pool, *MIXED[0], 1.0)
    ref_batch = copy.copy(batch)
    be.prepare(ref_batch)
    return [be.forward(*qkv[i], i, ref_batch, window=MIXED_WINDOWS[i]).float().cpu() for i in range(len(MIXED))]


# The interpreter runs the first four (its "16bit" is fp32); the GPU all: the fp32 and FP8 tiles of 512-wide heads too
MIXED_CASES = [("decode", "16bit"), ("graph", "16bit"), ("extend", "16bit"), ("decode", "fp8"), ("extend", "fp8"),
               ("decode", "fp32"), ("graph", "fp32"), ("extend", "fp32")]


@pytest.mark.gpu
@NEEDS_TRITON
@pytest.mark.parametrize("mode,kv", MIXED_CASES)
def test_triton_backend_runs_layers_of_different_head_shapes(mode, kv):
    """The Triton backend over a pool whose layers differ in head shape (Gemma 4): a decode step's split-K plan per
    shape (different split counts) over one shared scratch sized for the largest, the same through the CUDA-graph
    state (captured on a GPU with other context lengths, replayed with the real ones), and extend; a head dim of 512,
    windows on the narrow layer; an FP8 pool's per-layer means read where the kernels look. All as the torch
    backend."""
    if DEV != "cuda" and (mode, kv) not in MIXED_CASES[:4]:
        pytest.skip("the interpreter's tiles are correct at any size: the GPU runs the other tiles")
    patch_interpreter()
    from minisgl_cli.attention.triton_backend import TritonBackend
    from minisgl_cli.kernels.fp8 import FP8

    dtype = {"fp8": FP8, "fp32": torch.float32}.get(kv, torch.bfloat16 if DEV == "cuda" else torch.float32)
    pool, batch, qkv = _mixed_case("prefill" if mode == "extend" else "decode", dtype, DEV)
    ref = _reference(pool, batch, qkv)
    be = TritonBackend(pool, *MIXED[0], 1.0, layer_heads=tuple(h for h, _, _ in MIXED))
    if mode == "graph":
        be.init_cuda_graph_state(len(DECODE) + 2)  # the scratch sized for every graph's worst shape
        be.prepare_for_capture(len(DECODE), batch)
        for i, (_, k, v) in enumerate(qkv):
            be.store(i, batch.out_cache_loc, k, v)
        run = lambda: [be.attend(*qkv[i], i, batch, MIXED_WINDOWS[i]) for i in range(len(MIXED))]  # noqa: E731
        if DEV == "cuda":
            run()  # compiles outside the capture
            real = batch.seq_lens.clone()
            batch.seq_lens.fill_(1)  # captured at other lengths: the graph reads the real ones at replay
            be.prepare_for_replay(batch, len(DECODE))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = run()
            batch.seq_lens.copy_(real)
            be.prepare_for_replay(batch, len(DECODE))
            graph.replay()
            torch.cuda.synchronize()
        else:
            be.prepare_for_replay(batch, len(DECODE))
            outs = run()
    else:
        be.prepare(batch)
        if mode == "decode":  # each shape its own split count (its tiles: 16 or 32 positions at 512, 128 at 16)
            assert len({p.num_splits for p in batch.attn_meta.splits.values()}) == 2
        outs = [be.forward(*qkv[i], i, batch, window=MIXED_WINDOWS[i]) for i in range(len(MIXED))]
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for out, want in zip(outs, ref):
        assert ((out.float().cpu() - want).norm() / want.norm()).item() < tol
