"""minisgl::decode_attn (attention/torch_backend.py's CPU decode): attention as SDPA computes it, over the paged pool
in place, each row's bits whatever the rows beside it, the slots' padding or the thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl_cli.attention.torch_backend import TorchBackend, TorchDecodeMeta, decode_mask
from minisgl_cli.kernels.cpu import library as cpu_library
from minisgl_cli.kvcache.pool import FP8, KVPool, KVShape

needs_kernel = pytest.mark.skipif(cpu_library.missing("decode_attn") is not None,
                                  reason="minisgl's decode attention does not build here")

SLOTS, HKV, SCALE = 2048, 3, 0.125


def _case(dtype: torch.dtype, q_dtype: torch.dtype, group: int, dim: int, lens: list[int]):
    g = torch.Generator().manual_seed(len(lens) * dim + group)
    k, v = (torch.randn(SLOTS, HKV, dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), HKV * group, dim, generator=g).to(q_dtype)
    width = -(-max(lens) // 16) * 16
    slots = torch.randint(1, SLOTS, (len(lens), width), generator=g)
    return q, k, v, slots, torch.tensor(lens)


def _attn(q, k, v, slots, lens):
    return torch.ops.minisgl.decode_attn(q, k, v, slots, lens, SCALE)


@needs_kernel
@pytest.mark.parametrize("dtype,q_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("group,dim", [(3, 64), (4, 128), (1, 32)])
def test_it_computes_attention_as_sdpa_over_the_gathered_keys(dtype, q_dtype, group, dim):
    lens = [1, 15, 16, 17, 200, 333]
    q, k, v, slots, t = _case(dtype, q_dtype, group, dim, lens)
    got = _attn(q, k, v, slots, t)
    assert got.dtype == q_dtype and got.shape == q.shape
    for b, n in enumerate(lens):
        keys, values = (x[slots[b, :n]].double().transpose(0, 1) for x in (k, v))
        ref = F.scaled_dot_product_attention(q[b].double().view(HKV, group, dim), keys, values, scale=SCALE,
                                             enable_gqa=True)
        # fp32 sums; a bf16 output rounds to 8 bits
        tol = 1e-5 if q_dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got[b].double(), ref.reshape(HKV * group, dim), rtol=tol, atol=tol)


@needs_kernel
def test_a_row_has_the_same_bits_alone_among_others_with_more_padding_and_on_any_thread_count():
    lens = [7, 150, 151, 152, 153, 290, 64]
    q, k, v, slots, t = _case(torch.bfloat16, torch.bfloat16, 3, 64, lens)
    together = _attn(q, k, v, slots, t)
    padded = torch.cat([slots, torch.randint(1, SLOTS, (len(lens), 48))], dim=1)  # a longer row's padding
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(_attn(q, k, v, padded, t), together)
            for b in range(len(lens)):
                alone = _attn(q[b : b + 1].contiguous(), k, v, slots[b : b + 1, : -(-lens[b] // 16) * 16].contiguous(),
                              t[b : b + 1])
                assert torch.equal(alone, together[b : b + 1]), (n, b)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_bad_inputs_are_refused():
    q, k, v, slots, t = _case(torch.bfloat16, torch.bfloat16, 3, 64, [5, 9])
    with pytest.raises(RuntimeError, match="length"):
        _attn(q, k, v, slots, torch.tensor([5, slots.shape[1] + 1]))
    with pytest.raises(RuntimeError, match="length"):
        _attn(q, k, v, slots, torch.tensor([0, 3]))
    with pytest.raises(RuntimeError, match="int64"):
        _attn(q, k, v, slots.int(), t)
    with pytest.raises(RuntimeError, match="head_dim"):
        _attn(q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), slots, t)
    with pytest.raises(RuntimeError, match="bf16 or fp32"):
        _attn(q.half(), k.half(), v.half(), slots, t)
    with pytest.raises(RuntimeError, match="sinks"):
        torch.ops.minisgl.decode_attn(q, k, v, slots, t, SCALE, 0, torch.zeros(q.shape[1], dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="window"):
        torch.ops.minisgl.decode_attn(q, k, v, slots, t, SCALE, -1)


@needs_kernel
@pytest.mark.parametrize("window", [0, 1, 16, 100])
def test_a_window_keeps_a_row_s_last_keys_and_sinks_join_the_denominator(window):
    """gpt-oss's decode: the row's last `window` keys (all where it has fewer), exp(sink) added to the softmax's sum."""
    group, dim, lens = 4, 64, [1, 15, 16, 17, 200, 333]
    q, k, v, slots, t = _case(torch.float32, torch.float32, group, dim, lens)
    sinks = torch.randn(HKV * group, generator=torch.Generator().manual_seed(window)) * 2
    got = torch.ops.minisgl.decode_attn(q, k, v, slots, t, SCALE, window, sinks)
    for b, n in enumerate(lens):
        first = max(0, n - window) if window else 0
        keys, values = (x[slots[b, first:n]].double().transpose(0, 1) for x in (k, v))  # [Hkv, L, D]
        scores = (q[b].double().view(HKV, group, dim) @ keys.transpose(1, 2)) * SCALE  # [Hkv, G, L]
        scores = torch.cat([scores, sinks.double().view(HKV, group, 1)], dim=-1)
        ref = scores.softmax(-1)[..., :-1] @ values
        torch.testing.assert_close(got[b].double(), ref.reshape(HKV * group, dim), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_backend_attends_through_the_kernel_where_it_is_built_else_through_sdpa(monkeypatch):
    """A 16-bit CPU pool takes the kernel; an FP8 pool, or a process whose kernels did not build, SDPA over the
    gathered keys: the same attention within bf16 rounding."""
    def backend(dtype=torch.bfloat16) -> TorchBackend:
        pool = KVPool(KVShape(1, HKV, 64, dtype), num_pages=1024, page_size=1, max_reqs=4, max_context_len=512,
                      device="cpu")
        return TorchBackend(pool, HKV * 3, HKV, 64, SCALE)

    own = backend()
    assert own.own_decode and not backend(FP8).own_decode
    monkeypatch.setattr(cpu_library, "load", lambda: "no compiler")
    sdpa = backend()
    assert not sdpa.own_decode
    sdpa.pool = own.pool
    own.pool.k[0].normal_()
    own.pool.v[0].normal_()
    q = torch.randn(2, HKV * 3, 64).to(torch.bfloat16)
    lens = torch.tensor([40, 19])
    slots = torch.arange(1, 97).view(2, 48)
    got = own.decode(q, 0, TorchDecodeMeta(slots.reshape(-1), 48, lens, None))
    ref = sdpa.decode(q, 0, TorchDecodeMeta(slots.reshape(-1), 48, lens, decode_mask(lens, 48, torch.bfloat16)))
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
