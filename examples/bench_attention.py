"""Microbenchmark of paged decode attention (and a little prefill): triton vs torch (vs flashinfer) backends.

Decode is bound by reading the KV cache, so each case reports the achieved KV-read bandwidth
(sum of context lengths * Hkv * head_dim * 2 tensors * itemsize, over the median time) next to the
card's device-to-device copy bandwidth measured here (bytes read + written). Small cases fit in L2 and can
read faster than HBM; the large ones are the honest figures.

    PYTHONPATH=. python examples/bench_attention.py [--page-size 16] [--quick]
                                                    [--sweep-decode [--kv-fp8] | --sweep-extend] [--shape NAME]

--sweep-short: batch-1 decode at contexts 130..4096, each shape's split programs merging their own partials (the
engine's decode): split over num_kv_splits (as before SHORT_CONTEXT; the merge a head at a time, as before
2026-12-01, and a group at a time), in one split, and as shipped; µs a call over 16
pools in one CUDA graph (the KV from DRAM, as in a step).
--kv-fp8 runs the decode sweep over an FP8 pool (e4m3 codes, per-head scales): bytes counted at one per value.
--shape: the sweeps' heads (default llama8b; gemma4-global / gemma4-sliding: Gemma-4-31B's 4 KV heads of 512 and
16 of 256, 32 query heads).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math

import torch
import triton.testing

from minisgl_cli.attention import create_backend
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.kvcache.pool import KVPool, KVShape

SHAPES = {"llama8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}
SHORT_SHAPES = {**SHAPES, "qwen3-30b-a3b": (32, 4, 128), "gpt-oss-20b": (64, 8, 64)}
WIDE_SHAPES = {"gemma4-global": (32, 4, 512), "gemma4-sliding": (32, 16, 256)}  # for the sweeps (--shape)


def build(mode: str, prefix: list[int], ext: list[int], heads, page_size: int, dtype: torch.dtype):
    """Pool of exactly the pages needed, random KV, pages of each request in shuffled order."""
    h, hkv, d = heads
    seq = [p + e for p, e in zip(prefix, ext)]
    pages = sum(-(-s // page_size) for s in seq)
    pool = KVPool(KVShape(1, hkv, d, dtype), pages, page_size, len(seq), max(seq), "cuda")
    pool.k[0].normal_()
    pool.v[0].normal_()
    perm = (torch.randperm(pages) + 1).tolist()
    rows, locs, used = [], [], 0
    for p, s in zip(prefix, seq):
        n = -(-s // page_size)
        slots = pool.slots_of_pages(perm[used : used + n])[:s]
        used += n
        row = pool.alloc_req_row()
        pool.page_table[row, :s] = slots.cuda().int()
        rows.append(row)
        locs.append(slots[p:])
    T = sum(ext)
    batch = ForwardBatch.build(mode, [0] * T, rows, prefix, ext, torch.cat(locs), "cuda", HostBuffers())
    q = torch.randn(T, h, d, device="cuda", dtype=dtype)
    k = torch.randn(T, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(T, hkv, d, device="cuda", dtype=dtype)
    return pool, batch, q, k, v


def time_backend(name: str, pool, batch, q, k, v, heads, graph: bool) -> float:
    h, hkv, d = heads
    be = create_backend(name, pool, h, hkv, d, 1.0 / math.sqrt(d), "cuda")
    be.prepare(batch)
    fn = lambda: be.forward(q, k, v, 0, batch)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB, counting bytes read + written, GB/s."""
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() * src.element_size() / ms / 1e6


EXTEND_CASES = (([0], [4096]), ([2048] * 4, [1024] * 4), ([0] * 16, [512] * 16))
EXTEND_CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (64, 128, 8, 2)]
# heads wider than 128 (tiles that fit shared memory and registers)
WIDE_EXTEND_CONFIGS = [(32, 32, 4, 2), (32, 32, 8, 2), (32, 32, 8, 3), (64, 32, 8, 2), (32, 64, 8, 2), (16, 32, 4, 2),
                       (16, 64, 4, 2), (64, 16, 8, 2)]


def sweep_extend(page_size: int, shape: str = "llama8b") -> None:
    """Median ms of the Triton extend kernel per (BLOCK_M, BLOCK_N, warps, stages), `shape`'s heads, bf16."""
    from minisgl_cli.kernels.triton import attention as tk

    heads = (SHAPES | WIDE_SHAPES)[shape]
    configs = EXTEND_CONFIGS if heads[2] <= 128 else WIDE_EXTEND_CONFIGS
    print(f"# {torch.cuda.get_device_name()}: extend sweep, {shape} heads, bf16, page_size {page_size}; "
          f"default {tk.extend_config(heads[2])}")
    for prefix, ext in EXTEND_CASES:
        pool, batch, q, k, v = build("prefill", prefix, ext, heads, page_size, torch.bfloat16)
        pool.store(0, batch.out_cache_loc, k, v)
        flops = sum(4 * heads[0] * heads[2] * (e * p + e * (e + 1) / 2) for p, e in zip(prefix, ext))
        ms_torch = time_backend("torch", pool, batch, q, k, v, heads, graph=False)
        cells = [f"torch {ms_torch:.3f} ({flops / ms_torch / 1e9:.0f})"]
        for cfg in configs:
            fn = functools.partial(
                tk.extend_attention, q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                batch.qo_indptr, max(ext), 1.0 / math.sqrt(heads[2]), config=cfg,
            )
            try:
                fn()
                ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                cells.append(f"{cfg} {ms:.3f} ({flops / ms / 1e9:.0f})")
            except Exception as exc:  # e.g. out of shared memory for a config
                cells.append(f"{cfg} failed: {type(exc).__name__}")
        print(f"prefix {prefix[0]} x{len(ext)} ext {ext[0]}:\n  " + "\n  ".join(cells))


DECODE_CONFIGS = [(bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8) for st in (1, 2, 3, 4)]
DECODE_CONFIGS_FP8 = [(bn, w, st) for bn in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]


def fp8_pool(pool: KVPool) -> KVPool:
    """An FP8 copy of a one-layer bf16 pool (same pages and table; scales set from its contents)."""
    from minisgl_cli.kernels.fp8 import FP8

    s = pool.shape
    out = KVPool(KVShape(1, s.num_kv_heads, s.head_dim, FP8), pool.num_pages, pool.page_size,
                 pool.page_table.shape[0], pool.max_context_len, "cuda")
    out.page_table.copy_(pool.page_table)
    out.calibrate(0, pool.k[0], pool.v[0])
    out.store(0, torch.arange(pool.k[0].shape[0], device="cuda"), pool.k[0], pool.v[0])
    return out


def sweep_decode(page_size: int, fp8: bool = False, shape: str = "llama8b") -> None:
    """Decode kernel per (BLOCK_N, warps, stages), `shape`'s heads (llama8b: and qwen3's at 256 requests), bf16 or
    FP8 KV, programs started longest context first (as the backend does), inside a CUDA graph: KV-read GB/s.

    Cases: 256 requests of mixed contexts (the nano-vllm preset's steady state; one split, no reduce)
    and one request of 640 / 4096 tokens (batch-1 decode; split-K + reduce).
    """
    import random

    from minisgl_cli.kernels.triton import attention as tk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rnd = random.Random(0)
    bs256 = [rnd.randint(200, 1600) for _ in range(256)]
    cases = {"bs256 ctx U[200,1600]": (shape, bs256), "bs1 ctx 640": (shape, [640]),
             "bs1 ctx 4096": (shape, [4096]),
             "bs32 ctx U[200,1600]": (shape, [rnd.randint(200, 1600) for _ in range(32)])}
    if fp8 and shape == "llama8b":
        cases["qwen3 bs256 ctx U[200,1600]"] = ("qwen3-0.6b", bs256)
    kind = "fp8 e4m3" if fp8 else "bf16"
    print(f"# {torch.cuda.get_device_name()}: decode sweep, {shape} heads, {kind} KV, page_size {page_size}")
    for label, (name, ctxs) in cases.items():
        heads = (SHAPES | WIDE_SHAPES)[name]
        h, hkv, d = heads
        pool, batch, q, k, v = build("decode", [c - 1 for c in ctxs], [1] * len(ctxs), heads, page_size, torch.bfloat16)
        quant = None
        if fp8:
            pool = fp8_pool(pool)
            quant = pool.layer_quant(0)
        B = len(ctxs)
        splits = tk.num_kv_splits(B, hkv, sms)
        kv_bytes = sum(ctxs) * hkv * d * 2 * pool.k[0].element_size()
        mid_o = torch.empty((B, h, splits, d), dtype=torch.float32, device="cuda")
        mid_lse = torch.empty((B, h, splits), dtype=torch.float32, device="cuda")
        out = torch.empty_like(q)
        order = torch.argsort(batch.seq_lens, descending=True).to(torch.int32)
        cells = []
        default_cfg = tk.decode_config(d, pool.k[0].element_size())
        configs = DECODE_CONFIGS_FP8 if fp8 else DECODE_CONFIGS
        for cfg in configs + ([default_cfg] if default_cfg not in configs else []):
            fn = functools.partial(
                tk.decode_attention, q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                1.0 / math.sqrt(d), splits, mid_o, mid_lse, out, config=cfg, quant=quant, order=order,
            )
            try:
                fn()
                ms = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
                cells.append((kv_bytes / ms / 1e6, cfg, ms))
            except Exception as exc:  # e.g. out of shared memory for a config
                print(f"  {cfg} failed: {type(exc).__name__}")
        cells.sort(reverse=True)
        default = next((c for c in cells if c[1] == default_cfg), None)
        assert default is not None, "the default config is in the sweep"
        print(
            f"{label} (splits {splits}, KV {kv_bytes / 1e6:.0f} MB): "
            f"default {default[1]} {default[0]:.0f} GB/s {default[2] * 1e3:.1f} us; best: "
            + ", ".join(f"{c[1]} {c[0]:.0f} GB/s {c[2] * 1e3:.1f} us" for c in cells[:5])
        )
        del pool, batch, q, k, v
        torch.cuda.empty_cache()


def sweep_short(page_size: int) -> None:
    """Batch-1 decode as the engine runs it (splits by num_kv_splits, counters: one launch) for each `short`."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from timing import graph_us

    from minisgl_cli.kernels.triton import attention as tk

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # (short, group merge): split with the merge a head at a time (before 2026-12-01) and a group at a time, in one
    # split, and as shipped (one split up to SHORT_CONTEXT)
    shorts = {"split/h": (0, False), "split": (0, True), "one": (1 << 30, True), "default": (None, True)}
    print(f"# {torch.cuda.get_device_name()}: batch-1 decode, µs a call: split over num_kv_splits (merging a head at a "
          f"time, then a group), in one split, and as shipped (one split up to {tk.SHORT_CONTEXT}); page_size "
          f"{page_size}, 16 pools in one graph")
    print(f"{'shape':<14} {'ctx':>5} " + " ".join(f"{c:>7}" for c in shorts))
    for name, heads in SHORT_SHAPES.items():
        h, hkv, d = heads
        splits = tk.num_kv_splits(1, hkv, sms)
        for ctx in (130, 192, 256, 320, 384, 640, 1024, 4096):
            cases = [build("decode", [ctx - 1], [1], heads, page_size, torch.bfloat16) for _ in range(16)]
            mid_o = torch.empty((1, h, splits, d), dtype=torch.float32, device="cuda")
            mid_lse = torch.empty((1, h, splits), dtype=torch.float32, device="cuda")
            counters = torch.zeros(hkv, dtype=torch.int32, device="cuda")
            out = torch.empty_like(cases[0][2])
            row = []
            for short, group_merge in shorts.values():
                fns = [functools.partial(tk.decode_attention, q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows,
                                         batch.seq_lens, 1.0 / math.sqrt(d), splits, mid_o, mid_lse, out,
                                         counters=counters, short=short, group_merge=group_merge)
                       for pool, batch, q, _, _ in cases]
                row.append(graph_us(fns))
            print(f"{name:<14} {ctx:>5} " + " ".join(f"{t:7.2f}" for t in row), flush=True)
            del cases
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--sweep-extend", action="store_true", help="only time extend tile configs")
    ap.add_argument("--sweep-decode", action="store_true", help="only time decode kernel configs")
    ap.add_argument("--kv-fp8", action="store_true", help="--sweep-decode over an FP8 KV pool")
    ap.add_argument("--sweep-short", action="store_true", help="batch-1 decode split or not (SHORT_CONTEXT's source)")
    ap.add_argument("--shape", default="llama8b", choices=[*SHAPES, *WIDE_SHAPES], help="the sweeps' heads")
    args = ap.parse_args()
    if args.sweep_short:
        sweep_short(args.page_size)
        return
    if args.sweep_decode:
        sweep_decode(args.page_size, args.kv_fp8, args.shape)
        return
    if args.sweep_extend:
        sweep_extend(args.page_size, args.shape)
        return
    dtype = torch.bfloat16
    have_fi = importlib.util.find_spec("flashinfer") is not None
    names = ["triton", "torch"] + (["flashinfer"] if have_fi else [])
    bw = copy_bandwidth()
    card = torch.cuda.get_device_name()
    print(f"# {card}: d2d copy {bw:.0f} GB/s (read+write); bf16, page_size {args.page_size}")
    batches = [1, 64] if args.quick else [1, 64, 256]
    ctxs = [512, 8192] if args.quick else [512, 2048, 8192]

    rows = []
    for shape, heads in SHAPES.items():
        h, hkv, d = heads
        for B in batches:
            for ctx in ctxs:
                case = build("decode", [ctx - 1] * B, [1] * B, heads, args.page_size, dtype)
                kv_bytes = B * ctx * hkv * d * 2 * dtype.itemsize
                res = {}
                for n in names:
                    try:
                        res[n] = time_backend(n, *case, heads, graph=False)
                    except torch.OutOfMemoryError:
                        res[n] = float("nan")
                res["triton+graph"] = time_backend("triton", *case, heads, graph=True)
                rows.append((shape, B, ctx, kv_bytes, res))
                del case
                torch.cuda.empty_cache()

    cols = ["triton", "triton+graph", "torch"] + (["flashinfer"] if have_fi else [])
    print("\n## decode: median us (KV-read GB/s)")
    print(f"{'shape':<11} {'B':>4} {'ctx':>5} {'KV MB':>7} " + " ".join(f"{c:>20}" for c in cols))
    for shape, B, ctx, kv_bytes, res in rows:
        cells = []
        for c in cols:
            ms = res.get(c, float("nan"))
            cells.append(f"{ms * 1e3:9.1f} ({kv_bytes / ms / 1e6:6.0f})")
        print(f"{shape:<11} {B:>4} {ctx:>5} {kv_bytes / 1e6:7.1f} " + " ".join(f"{x:>20}" for x in cells))

    # A little prefill: causal attention FLOPs = 4 * H * D * sum over new tokens of keys seen.
    print("\n## extend (llama8b shape): median ms (TFLOP/s)")
    heads = SHAPES["llama8b"]
    for prefix, ext in EXTEND_CASES:
        case = build("prefill", prefix, ext, heads, args.page_size, dtype)
        flops = sum(4 * heads[0] * heads[2] * (e * p + e * (e + 1) / 2) for p, e in zip(prefix, ext))
        cells = []
        for n in names:
            ms = time_backend(n, *case, heads, graph=False)
            cells.append(f"{n} {ms:.3f} ({flops / ms / 1e9:.0f})")
        print(f"prefix {prefix[0]} x{len(ext)} ext {ext[0]}: " + "  ".join(cells))
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
