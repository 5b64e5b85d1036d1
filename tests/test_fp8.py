"""FP8 on the CPU: `--kv-cache-dtype fp8_e4m3` and `--quantization fp8` run here as quantize / dequantize (the
simulation the GPU kernels are checked against in tests/test_gpu_fp8.py), and on the real default model they
cost little perplexity on a fixed English text against bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.kernels import fp8
from minisgl_cli.kvcache.pool import KV_SCALE_HEADROOM, KVPool, KVShape


def test_quantize_is_e4m3_round_to_nearest_with_saturation():
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, -300.0, 500.0, -1e9, 2.0**-9, 2.0**-11])
    q = fp8.quantize(x, 1.0)
    assert q.dtype == torch.float8_e4m3fn
    # 1.0625 is halfway between 1 and 1.125 (ties to even: 1); 1.1875 between 1.125 and 1.25 (even: 1.25);
    # beyond +-448 saturates; 2^-9 is the smallest subnormal, 2^-11 rounds to zero
    assert fp8.dequantize(q, 1.0).tolist() == [0.0, 1.0, 1.0, 1.25, -288.0, 448.0, -448.0, 2.0**-9, 0.0]
    rows = torch.randn(6, 96) * torch.logspace(-3, 3, 6)[:, None]
    codes, scale = fp8.quantize_rows(rows)
    assert scale.shape == (6, 1) and (codes.float().abs().amax(-1) == 448).all()  # each row's amax on the top code
    torch.testing.assert_close(fp8.dequantize(codes, scale).abs().amax(-1), rows.abs().amax(-1))
    assert ((fp8.round_trip_rows(rows) - rows).abs() <= rows.abs() / 16 + scale * 2.0**-9).all()


def _pool(kv_scale: float | None = None) -> KVPool:
    return KVPool(KVShape(2, 3, 16, fp8.FP8), num_pages=32, page_size=1, max_reqs=2, max_context_len=32,
                  device="cpu", kv_scale=kv_scale)


def test_fp8_pool_calibrates_per_head_once_then_stores_codes():
    pool = _pool()
    assert pool.quantized and pool.k[0].dtype == fp8.FP8 and pool.needs_scales(0) and pool.needs_scales(1)
    assert pool.shape.bytes_per_token() == 2 * 2 * 3 * 16  # one byte per value: half of bf16
    # heads of different sizes, channels with a constant offset (as K's RoPE'd outlier channels have)
    k = torch.randn(5, 3, 16) * torch.tensor([0.1, 1.0, 10.0])[None, :, None] + torch.linspace(-20, 20, 16)
    v = torch.randn(5, 3, 16)
    pool.calibrate(0, k, v)
    assert not pool.needs_scales(0) and pool.needs_scales(1)
    mean = pool.k_mean[0]
    torch.testing.assert_close(mean, k.mean(0))
    torch.testing.assert_close(pool.k_scale[0], (k - mean).abs().amax(dim=(0, 2)) * KV_SCALE_HEADROOM / 448)
    loc = torch.tensor([3, 9, 4, 20, 7])
    pool.store(0, loc, k, v)
    k_back, v_back = pool.read(0, loc, torch.float32)
    scale = pool.k_scale[0][:, None]
    torch.testing.assert_close(k_back, fp8.dequantize(fp8.quantize(k - mean, scale), scale) + mean)
    # the rounding error scales with the residual after the mean, not with the offset
    assert ((k_back - k).abs() <= (k - mean).abs() / 16 + 1e-5).all()
    assert ((v_back - v).abs() <= (v - pool.v_mean[0]).abs() / 16 + 1e-5).all()
    # values far past the calibrated range saturate at 448 codes rather than overflow
    pool.store(0, loc[:1], mean + (k[:1] - mean) * 100, v[:1])
    torch.testing.assert_close((pool.read(0, loc[:1], torch.float32)[0] - mean).abs().amax(-1)[0], scale[:, 0] * 448)
    # a given scale: every head has it and nothing is calibrated
    fixed = _pool(kv_scale=0.05)
    assert not fixed.needs_scales(0) and (fixed.k_scale == 0.05).all() and (fixed.v_scale == 0.05).all()


def test_torch_backend_reads_fp8_kv_dequantized():
    """Prefill (which calibrates) then decode through the torch backend over an FP8 pool: the same as SDPA over
    the dequantized K/V, the prefill's own K/V included."""
    from minisgl_cli.attention import create_backend
    from minisgl_cli.engine.batch import ForwardBatch
    from minisgl_cli.engine.host import HostBuffers

    pool = _pool()
    be = create_backend("auto", pool, 6, 3, 16, 0.25, "cpu")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(9, n, 16, generator=g) for n in (6, 3, 3))
    row = pool.alloc_req_row()
    assert row is not None
    pool.page_table[row, :9] = torch.arange(1, 10, dtype=torch.int32)
    batch = ForwardBatch.build("prefill", [0] * 8, [row], [0], [8], list(range(1, 9)), "cpu", HostBuffers())
    be.prepare(batch)
    out = be.forward(q[:8], k[:8], v[:8], 0, batch)
    dec = ForwardBatch.build("decode", [0], [row], [8], [1], [9], "cpu", HostBuffers())
    be.prepare(dec)
    last = be.forward(q[8:], k[8:], v[8:], 0, dec)
    kd, vd = pool.read(0, torch.arange(1, 10), torch.float32)
    assert not pool.needs_scales(0)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kd.repeat_interleave(2, 1).transpose(0, 1),
                                         vd.repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.25)
    ref = ref.transpose(0, 1)
    torch.testing.assert_close(out, ref[:8], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, ref[8:], rtol=1e-5, atol=1e-5)


def test_fp8_linear_holds_e4m3_weights_and_quantizes_activations_per_token():
    from minisgl_cli.layers.linear import ColumnParallelLinear, RowParallelLinear
    from minisgl_cli.layers.quant import Fp8Method

    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g) * torch.logspace(-2, 1, 48, )[:, None]
    col = ColumnParallelLinear(64, [32, 16], bias=True, method=Fp8Method())
    col.load_shard("weight", w[:32], 0)
    col.load_shard("weight", w[32:], 1)
    col.load_shard("bias", torch.ones(32), 0)
    col.load_shard("bias", torch.ones(16), 1)
    col.finish_loading()
    assert col.weight.dtype == fp8.FP8 and col.weight_scale.shape == (48,)
    w_q = fp8.dequantize(col.weight, col.weight_scale[:, None])
    torch.testing.assert_close(col.weight_scale, w.abs().amax(-1) / 448)  # per output channel
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(col(x), F.linear(fp8.round_trip_rows(x), w_q) + 1)  # per-token activations
    torch.testing.assert_close(col(x[:1]), F.linear(x[:1], w_q) + 1)  # one row: weight-only (as the GEMV)
    assert (col(x) - F.linear(x, w) - 1).norm() / F.linear(x, w).norm() < 0.05
    # row-parallel down projection with SiLU-and-mul: the same path on the activation
    down = RowParallelLinear(64, 48, method=Fp8Method())
    down.load_shard("weight", w)
    down.finish_loading()
    gu = torch.randn(3, 128, generator=g)
    act = F.silu(gu[:, :64]) * gu[:, 64:]
    torch.testing.assert_close(down.forward_silu_mul(gu), F.linear(fp8.round_trip_rows(act), w_q))


def test_fp8_flags_resolve_per_device(monkeypatch):
    """(The flags' one-line CLI errors: tests/test_quant.py.)"""
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        EngineConfig(quantization="int3").resolved_quantization()  # type: ignore[arg-type]
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").resolved_kv_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert EngineConfig(device="cpu").resolved_kv_dtype(torch.float32) == torch.float32  # auto: the engine dtype
    assert EngineConfig(device="cpu", quantization="fp8").resolved_quantization() == "fp8"  # the CPU simulates it
    # a GPU without e4m3 (before Ada / Hopper): one clear error per flag, before any weight is loaded
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"--quantization fp8 needs a GPU of compute capability 8\.9\+ \(Ada, "
                                         r"Hopper\); NVIDIA A100-SXM4-80GB is not one"):
        EngineConfig(device="cuda", quantization="fp8").resolved_quantization()
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9"):
        EngineConfig(device="cuda", kv_cache_dtype="fp8_e4m3").resolved_kv_dtype(torch.bfloat16)
    with pytest.raises(ValueError, match="--quantization int4 does not run on cuda"):
        EngineConfig(device="cuda", quantization="int4").resolved_quantization()


_PPL: dict[tuple, float] = {}  # the text's perplexity per engine setting, shared by the tests below


def _ppl(default_model_dir, docs: list[list[int]], **kw) -> float:
    """The documents' perplexity in bf16 but for `kw` (dense weights unless kw says: not the GGUF's int4 blocks)."""
    from perplexity import perplexity

    from minisgl_cli.engine.engine import Engine

    kw = {"quantization": "none", **kw}
    key = (str(default_model_dir), tuple(len(d) for d in docs), tuple(sorted(kw.items())))
    if key not in _PPL:
        tokens = max(len(d) for d in docs) + 8
        engine = Engine(EngineConfig(model=str(default_model_dir), dtype="bfloat16", max_total_tokens=tokens, **kw))
        _PPL[key] = perplexity(engine, docs)
    return _PPL[key]


@pytest.mark.slow
def test_fp8_costs_little_perplexity_on_real_weights(default_model_dir, text_docs):
    """SmolLM2-135M on conftest's PERPLEXITY_TEXT (each story chunked through the paged pool), all in bf16 but
    for the FP8 parts: FP8 KV within 1% of bf16's perplexity, FP8 weights + KV within 2%.
    (Read as one 6,000-token sequence the same text costs more -- docs/gpu.md: FP8 KV's cost grows with the
    context.)"""
    assert sum(len(d) for d in text_docs) > 5000
    base = _ppl(default_model_dir, text_docs)
    kv = _ppl(default_model_dir, text_docs, kv_cache_dtype="fp8_e4m3")
    both = _ppl(default_model_dir, text_docs, kv_cache_dtype="fp8_e4m3", quantization="fp8")
    print(f"\nperplexity bf16 {base:.4f}, fp8 KV {kv:.4f} ({kv / base - 1:+.2%}), "
          f"fp8 weights + KV {both:.4f} ({both / base - 1:+.2%})")
    assert 3 < base < 30  # the model reads English
    assert kv != base and both != kv  # the flags change the numbers
    assert abs(kv / base - 1) <= 0.01 and abs(both / base - 1) <= 0.02


def _tp_perplexity(rank: int, size: int, addr: str, model_dir: str, docs: list[list[int]], out) -> None:
    """One TP rank (a spawned process, gloo): its FP8 engine's perplexity on `docs`; rank 0 puts it in `out`."""
    from perplexity import perplexity

    from minisgl_cli.distributed import DistConfig
    from minisgl_cli.distributed.comm import init_tp
    from minisgl_cli.engine.engine import Engine

    tp = init_tp(rank, DistConfig(tp_size=size, init_addr=addr), torch.device("cpu"))
    engine = Engine(EngineConfig(model=model_dir, dtype="bfloat16", max_total_tokens=max(map(len, docs)) + 8,
                                 kv_cache_dtype="fp8_e4m3", quantization="fp8"), tp)
    ppl = perplexity(engine, docs)
    if rank == 0:
        out.put(ppl)


@pytest.mark.slow
def test_fp8_composes_with_tensor_parallel_ranks(default_model_dir, text_docs):
    """FP8 weights + FP8 KV at TP 2 (two gloo ranks): every rank quantizes its own shards (column-split rows keep
    their per-channel scales; a row-split layer's scales cover its rank's columns, and its activations are
    quantized per token over the rank's half) and calibrates its own KV heads. Not the same rounding as one
    rank, so not the same numbers, but the same quality: perplexity on the whole text within 1% of one rank's
    FP8. (FP8's rounding moves a 3,000-token story's perplexity by about a percent either way: TP 2 against
    TP 1 measured +1.4% on the first story, -0.3% on the second and +0.7% on both; bf16 TP 2 against TP 1
    +0.2%.)"""
    import multiprocessing as mp

    from minisgl_cli.api.http_server import free_port

    base = _ppl(default_model_dir, text_docs)
    one = _ppl(default_model_dir, text_docs, kv_cache_dtype="fp8_e4m3", quantization="fp8")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_tp_perplexity, args=(r, 2, addr, str(default_model_dir), text_docs, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        two = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    print(f"\nperplexity on {sum(map(len, text_docs))} tokens: bf16 {base:.4f}, FP8 TP 1 {one:.4f} "
          f"({one / base - 1:+.2%}), FP8 TP 2 {two:.4f} ({two / base - 1:+.2%}; {two / one - 1:+.2%} of TP 1)")
    assert two != one  # the ranks did quantize their own shards
    assert abs(two / one - 1) <= 0.01
