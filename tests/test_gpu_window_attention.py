"""Sliding-window and sink attention in every attention path against a naive fp32 definition: the Triton decode
(one split and several) and extend kernels, and the torch backend (the CPU's path, blocks and all).

The Triton cases run on CUDA, or without a GPU under Triton's interpreter on CPU tensors (fp32) where triton is
importable and TRITON_INTERPRET=1 was set before it was imported (as tests/test_gpu_moe.py):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_window_attention.py
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from test_attention_kernels import make_case

from minisgl_cli.attention.torch_backend import TorchBackend
from tests.triton_interp import INTERPRET, patch_interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = torch.cuda.is_available() or (INTERPRET and importlib.util.find_spec("triton") is not None)
needs_triton = pytest.mark.skipif(not TRITON, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton importable)")
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
@needs_triton
@pytest.mark.parametrize("mode,splits", [("decode", 1), ("decode", 3), ("extend", 0)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_triton_kernels_window_and_sinks_match_the_definition(mode, splits, window, with_sinks):
    patch_interpreter()
    from minisgl_cli.kernels.triton import attention as tk

    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    pool, batch, q, k, v = _case(mode, dtype, DEV)
    pool.store(0, batch.out_cache_loc, k, v)
    sinks = _sinks(DEV) if with_sinks else None
    scale = 1.0 / math.sqrt(HEADS[2])
    if mode == "decode":
        out = tk.decode_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens, scale,
                                  splits, window=window, sinks=sinks)
    else:
        out = tk.extend_attention(q, pool.k[0], pool.v[0], pool.page_table, batch.req_rows, batch.seq_lens,
                                  batch.qo_indptr, max(batch.extend_lens_cpu), scale, window=window, sinks=sinks)
    ref = naive(pool, batch, q, HEADS, window, sinks)
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
