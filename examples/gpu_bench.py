"""One-shot GPU benchmark: our engine vs HF transformers `generate` on the same dummy weights, in one run.

    PYTHONPATH=. python examples/gpu_bench.py [--only ops,gemv,qwen,llama,moe,mixtral] [--out DIR] [--profile] [--sweep]
    PYTHONPATH=. python examples/gpu_bench.py --only fp8ops   # activation quant, RoPE + KV store block shapes
    PYTHONPATH=. python examples/gpu_bench.py --fp8 --main-only --no-hf      # bf16 and FP8 side by side

Workloads:
  * nano-vllm preset: 256 requests, input and output lengths uniform in 100..1024 (random.seed(0), token
    ids uniform in 0..10000), EOS ignored; output tok/s = generated tokens / wall time from submit to
    the last token. The scheduler is driven in this thread (no HTTP, no asyncio) with
    max_running_requests=256 and a 16k-token prefill budget.
  * HF baseline for the preset: `generate` at batch 256, prompts left-padded to 1024, a fixed
    max_new_tokens=min_new_tokens=100 (HF cannot stop rows at different lengths; every preset request
    wants >= 100 tokens, so all 25,600 count). Short contexts flatter HF: it never reaches the long ones.
  * batch-1 decode: one 128-token prompt, 512 new tokens; tok/s over the decode part (first to last token).
  * sampled rows: every preset row (and the default batch-1 row) runs again with sampled requests
    (--temperature 0.7 --top-p 0.9 by default; --top-k, --min-p; --also-temperature 1.0 adds a row at that
    temperature alone; --greedy-only none), printed beside the greedy one with the ratio.
Variants switch CUDA graphs, overlap scheduling and the fused ops off one at a time to show what each buys;
`wait` is the time the scheduler spent blocked on the GPU (reading tokens), `cpu/step` the rest per step.

FP8: `--kv-cache-dtype` / `--quantization` set the engines' flags (EngineConfig's); `--fp8` runs each model
once per dtype setting in the same process -- Qwen3: bf16, then FP8 KV; Llama-8B: bf16, FP8 weights, FP8
weights + KV; Qwen3-30B-A3B (moe): bf16, FP8 weights; Mixtral-8x7B (mixtral, --fp8 or not): FP8 weights -- and
ends with a side-by-side table (the GEMV section adds FP8-weight rows).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import time
from dataclasses import dataclass

import torch
from timing import accumulate, graph_us  # examples/, beside this script

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.loader.configs import builtin_config
from minisgl_cli.messages import AddRequest
from minisgl_cli.scheduler import overlap as overlap_mod
from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig
from minisgl_cli.types import SamplingParams

ROWS: list[dict] = []
SAMPLED: list[dict] = []  # each sampled row's SamplingParams fields (from the flags); empty: greedy rows only


def row(**kw) -> None:
    ROWS.append(kw)
    print("RESULT " + json.dumps(kw), flush=True)


# --- driving the scheduler --------------------------------------------------------------------------
_wait = [0.0]
_orig_read = overlap_mod.Launched.read


def _timed_read(self):  # count the time the scheduler blocks on the device
    t0 = time.perf_counter()
    try:
        return _orig_read(self)
    finally:
        _wait[0] += time.perf_counter() - t0


overlap_mod.Launched.read = _timed_read
PHASES: dict[str, float] = {}


for _owner, _attr, _label in ((Scheduler, "_schedule", "schedule"),
                              (Scheduler, "_launch", "launch (build+forward+sample)"),
                              (Engine, "forward", "engine.forward"), (Scheduler, "_process", "process (incl. wait)")):
    accumulate(_owner, _attr, _label, PHASES)  # the host-side step split


@dataclass
class RunStats:
    tokens: int
    wall: float
    steps: int
    wait: float
    first_tok: float
    last_tok: float
    all_started: float  # when the last request got its first token (end of the prefill phase)


def sync() -> None:
    """Wait for the device (CUDA's queue; the CPU has none): run_requests also times a CPU engine."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def run_requests(engine: Engine, prompts: list[list[int]], out_lens: list[int], overlap: bool,
                 prefill_tokens: int = 16384, profile_steps: int = 0, sampling: dict | None = None) -> RunStats:
    got = [0]
    stamps: list[float] = []
    left = [len(prompts)]
    started: set[str] = set()
    all_started = [0.0]

    def sink(msg):
        for it in msg.outputs:
            if it.token_id is not None:
                got[0] += 1
                if it.rid not in started:
                    started.add(it.rid)
                    if len(started) == len(prompts):
                        all_started[0] = time.perf_counter()
            if it.finish_reason is not None or it.error:
                left[0] -= 1
        stamps.append(time.perf_counter())

    sched = Scheduler(engine, SchedulerConfig(max_prefill_tokens=prefill_tokens, disable_overlap=not overlap), sink)
    assert sched.overlap == overlap
    sync()
    _wait[0] = 0.0
    PHASES.clear()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, out_lens)):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, **(sampling or {}))
        sched.handle(AddRequest(f"r{i}", p, params))
    steps = 0
    prof = cprof = None
    while left[0] > 0:
        if profile_steps and steps == 100:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        if profile_steps and steps == 200:
            import cProfile

            cprof = cProfile.Profile()
            cprof.enable()
        sched.step()
        steps += 1
        if prof is not None and steps == 100 + profile_steps:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20), flush=True)
            prof = None
        if cprof is not None and steps == 400:
            import pstats

            cprof.disable()
            pstats.Stats(cprof).sort_stats("tottime").print_stats(22)
            cprof = None
    while sched._inflight is not None:
        sched.step()
    sync()
    wall = time.perf_counter() - t0
    sched.check_pages()
    # Hand the prefix cache's pages back to the pool: the next run builds a new scheduler on it.
    sched.cache.clear()
    return RunStats(got[0], wall, steps, _wait[0], stamps[0] - t0 if stamps else 0.0,
                    stamps[-1] - t0 if stamps else 0.0, all_started[0] - t0 if all_started[0] else 0.0)


def preset(seed: int = 0, n: int = 256, lo: int = 100, hi: int = 1024) -> tuple[list[list[int]], list[int]]:
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(lo, hi))] for _ in range(n)]
    outs = [random.randint(lo, hi) for _ in range(n)]
    return prompts, outs


BACKEND = ["auto"]  # --attention-backend
DTYPES: dict = {}  # --kv-cache-dtype / --quantization: EngineConfig fields for every engine of the run


def make_engine(name: str, **kw) -> Engine:
    kw = {"max_running_requests": 256, "cuda_graph_max_bs": 256, "max_total_tokens": 300_000, "load_format": "dummy",
          "attention_backend": BACKEND[0], **DTYPES, **kw}
    cfg = EngineConfig(model=name, **kw)
    t0 = time.perf_counter()
    e = Engine(cfg)
    print(
        f"[{name}] engine up in {time.perf_counter() - t0:.1f}s "
        f"(backend: {e.attn.name}, graphs: {e.graphs is not None}, weights: {e.quantization}, "
        f"kv: {str(e.kv_dtype).removeprefix('torch.')}, {kv_tokens(e):,} tokens)",
        flush=True,
    )
    return e


def kv_tokens(engine: Engine) -> int:
    return engine.pool.num_pages * engine.pool.page_size


def drop_engine(engine: Engine) -> None:
    """Give an engine's weights, KV pool and graphs back before the next one is built."""
    del engine.model
    drop_cache(engine)


def drop_cache(engine: Engine) -> None:
    """Give an engine's KV pool and graphs back (its weights stay)."""
    engine.graphs = engine.sampler_graphs = None
    engine.pool.k.clear()
    engine.pool.v.clear()
    gc.collect()
    torch.cuda.empty_cache()


def dtype_tag(engine: Engine) -> str:
    """bf16 / fp8-kv / fp8-w / fp8-w+kv: the column of the side-by-side table."""
    w, kv = engine.quantization == "fp8", engine.kv_dtype == torch.float8_e4m3fn
    return "fp8-w+kv" if w and kv else "fp8-w" if w else "fp8-kv" if kv else "bf16"


def with_graphs(engine: Engine, on: bool, saved: dict) -> None:
    if on:
        engine.graphs = saved.get("graphs", engine.graphs)
    else:
        saved["graphs"] = engine.graphs
        engine.graphs = None


def bench_engine(tag: str, engine: Engine, do_preset: bool, preset_variants: list[tuple[bool, bool]],
                 b1_variants: list[tuple[bool, bool]], profile: bool) -> None:
    # warm-up: compile prefill/extend kernels for a few shapes, exercise every path once
    g = random.Random(1)
    warm = [[g.randint(0, 10000) for _ in range(n)] for n in (100, 700, 1024, 37)]
    run_requests(engine, warm, [8, 8, 8, 8], overlap=True)
    if do_preset:  # every prefill shape of the preset once, so no first-use cost lands in a timed run
        prompts, _ = preset()
        run_requests(engine, prompts, [2] * len(prompts), overlap=True)
    saved: dict = {}
    for graphs, ovl in b1_variants:
        with_graphs(engine, graphs, saved)
        prompt = [[g.randint(0, 10000) for _ in range(128)]]
        run_requests(engine, prompt, [16], overlap=ovl)
        for sampling in [None, *SAMPLED] if graphs and ovl else [None]:
            st = run_requests(engine, prompt, [512], overlap=ovl, sampling=sampling)
            tps = (st.tokens - 1) / (st.last_tok - st.first_tok)
            row(
                model=tag,
                workload="batch-1 decode",
                **setting(engine, sampling, graphs, ovl),
                pdl=engine.kernels.pdl,
                tok_s=round(tps, 1),
                step_ms=round(1e3 / tps, 3),
                cpu_ms_per_step=round(1e3 * (st.wall - st.wait) / st.steps, 3),
                split_ms_per_step={k: round(1e3 * v / st.steps, 3) for k, v in PHASES.items()},
            )
        if profile and graphs and ovl:  # where a batch-1 step's GPU time goes
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                run_requests(engine, prompt, [9], overlap=ovl)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16), flush=True)
        with_graphs(engine, True, saved)
    if do_preset:
        prompts, outs = preset()
        for graphs, ovl in preset_variants:
            with_graphs(engine, graphs, saved)
            for sampling in (None, *SAMPLED):  # the sampled rows beside every greedy one
                st = run_requests(engine, prompts, outs, overlap=ovl,
                                  profile_steps=3 if (profile and graphs and ovl and sampling is None) else 0,
                                  sampling=sampling)
                assert st.tokens == sum(outs), (st.tokens, sum(outs))
                row(
                    model=tag,
                    workload="nano-vllm preset",
                    **setting(engine, sampling, graphs, ovl),
                    tok_s=round(st.tokens / st.wall, 1),
                    wall_s=round(st.wall, 2),
                    prefill_phase_s=round(st.all_started, 2),
                    steps=st.steps,
                    wait_s=round(st.wait, 2),
                    cpu_ms_per_step=round(1e3 * (st.wall - st.wait) / st.steps, 3),
                    split_ms_per_step={k: round(1e3 * v / st.steps, 3) for k, v in PHASES.items()},
                )
            with_graphs(engine, True, saved)


def setting(engine: Engine, sampling: dict | None, graphs: bool, overlap: bool) -> dict:
    """The fields naming what an engine row ran: dtypes, kernels, sampling, graphs, overlap."""
    label = " ".join(f"{k}={v:g}" for k, v in sampling.items()) if sampling else "greedy"
    return dict(engine="minisgl", dtypes=dtype_tag(engine), kv_tokens=kv_tokens(engine), backend=engine.attn.name,
                sampling=label, sampler=engine.sampler.name, graphs=graphs, overlap=overlap, fused=engine.kernels.fused)


def pdl_off(engine: Engine, tag: str) -> None:
    """Batch-1 decode with programmatic dependent launch off (graphs recaptured), then back on."""
    engine.kernels.pdl = False
    engine.capture_graphs()
    bench_engine(tag, engine, False, [], [(True, True)], False)
    engine.kernels.pdl = True
    engine.capture_graphs()


def hf_bench(tag: str, engine: Engine, name: str, do_preset: bool, b1_tokens: int) -> None:
    from minisgl_cli.models.hf_export import hf_twin

    drop_cache(engine)  # our engine is done: HF's cache gets the room (its twin needs the weights)
    hf = hf_twin(engine.model, builtin_config(name))
    dev = engine.device
    g = random.Random(2)
    ids = torch.tensor([[g.randint(0, 10000) for _ in range(128)]], device=dev)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=b1_tokens, min_new_tokens=b1_tokens, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    row(model=tag, workload="batch-1 decode", engine="hf generate", tok_s=round(b1_tokens / dt, 1))
    if do_preset:
        prompts, _ = preset()
        L = max(len(p) for p in prompts)
        inp = torch.zeros((len(prompts), L), dtype=torch.int64)
        mask = torch.zeros_like(inp)
        for i, p in enumerate(prompts):  # left padding
            inp[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        new = 100
        with torch.no_grad():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            hf.generate(inp.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, min_new_tokens=new, **kw)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
        row(model=tag, workload="nano-vllm preset (first 100 tokens/req)", engine="hf generate bs256",
            tok_s=round(len(prompts) * new / dt, 1), wall_s=round(dt, 2))
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def bench_ops() -> None:
    """Fused Triton ops vs the torch reference chains they replace (median of do_bench, microseconds)."""
    import triton

    from minisgl_cli.kernels.triton import ops as T
    from minisgl_cli.layers.activation import silu_and_mul
    from minisgl_cli.layers.norm import RMSNorm
    from minisgl_cli.layers.rotary import RotaryEmbedding

    dev, dt = torch.device("cuda"), torch.bfloat16
    for tokens in (1, 256, 8192):
        for hidden, inter, heads, kv, d in ((1024, 3072, 16, 8, 128), (4096, 14336, 32, 8, 128)):
            x = torch.randn(tokens, hidden, device=dev, dtype=dt)
            r = torch.randn_like(x)
            plain = Kernels(fused=False)  # the torch reference path of the layers
            norm = RMSNorm(hidden, 1e-6, plain).to(dev, dt)
            gu = torch.randn(tokens, 2 * inter, device=dev, dtype=dt)
            qkv = torch.randn(tokens, (heads + 2 * kv) * d, device=dev, dtype=dt)
            pos = torch.randint(0, 4000, (tokens,), device=dev)
            rope = RotaryEmbedding(d, 4096, 1e6).to(dev)
            qn = RMSNorm(d, 1e-6, plain).to(dev, dt)
            cases = {}

            def torch_qk():
                q, k, _ = qkv.split([heads * d, kv * d, kv * d], -1)
                q, k = qn(q.view(-1, heads, d)), qn(k.view(-1, kv, d))
                return rope(pos, q, k)

            r_t, qkv_t = r.clone(), qkv.clone()  # the fused kernels work in place: time them on copies
            cases["add+rmsnorm"] = (
                lambda: norm.forward_residual(x, r),
                lambda: T.rmsnorm(x, norm.weight, 1e-6, residual=r_t),
            )
            cases["silu_and_mul"] = (lambda: silu_and_mul(gu, plain), lambda: T.silu_and_mul(gu))
            cases["qk_norm+rope"] = (
                torch_qk,
                lambda: T.qk_norm_rope_(qkv_t, pos, rope.cos, rope.sin, heads, kv, d, qn.weight, qn.weight, 1e-6),
            )
            # correctness vs the torch path
            a = norm.forward_residual(x, r)[0]
            b = T.rmsnorm(x, norm.weight, 1e-6, residual=r.clone())
            err_norm = (a.float() - b.float()).abs().max().item()
            err_silu = (silu_and_mul(gu, plain).float() - T.silu_and_mul(gu).float()).abs().max().item()
            q_t, k_t = torch_qk()
            qkv2 = qkv.clone()
            T.qk_norm_rope_(qkv2, pos, rope.cos, rope.sin, heads, kv, d, qn.weight, qn.weight, 1e-6)
            err_qk = max(
                (q_t.reshape(tokens, -1).float() - qkv2[:, : heads * d].float()).abs().max().item(),
                (k_t.reshape(tokens, -1).float() - qkv2[:, heads * d : (heads + kv) * d].float()).abs().max().item(),
            )
            errs = {"add+rmsnorm": err_norm, "silu_and_mul": err_silu, "qk_norm+rope": err_qk}
            for op, (ref, fast) in cases.items():
                t_ref = triton.testing.do_bench(ref, warmup=10, rep=40, return_mode="median") * 1e3
                t_fast = triton.testing.do_bench(fast, warmup=10, rep=40, return_mode="median") * 1e3
                row(workload="op", op=op, tokens=tokens, hidden=hidden, torch_us=round(t_ref, 2),
                    triton_us=round(t_fast, 2), speedup=round(t_ref / t_fast, 2), max_abs_err=errs[op])


def bench_fp8_ops() -> None:
    """The per-token activation quantization (plain and with SiLU-and-mul; median us of do_bench, L2 flushed),
    the add + RMSNorm with and without writing the codes (in a CUDA graph), the q/k-norm + RoPE + FP8 KV store
    kernel over its block shapes (pick_rope_config's source), and use_fast_accum's error. (Splitting quant_rows'
    rows into chunks, two passes, was tried: no faster at 256 rows, slower at 8192.)"""
    import triton

    from minisgl_cli.kernels import fp8
    from minisgl_cli.kernels.triton import ops as T
    from minisgl_cli.layers.rotary import RotaryEmbedding

    dev, dt = torch.device("cuda"), torch.bfloat16
    bench = lambda f: round(triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median") * 1e3, 2)  # noqa: E731
    for tokens in (1, 16, 256, 8192):
        for model, (hidden, inter, hq, hkv, d) in (("qwen3-0.6b", (1024, 3072, 16, 8, 128)),
                                                   ("llama-3.1-8b", (4096, 14336, 32, 8, 128))):
            for op, k, act in (("quant", hidden, False), ("silu+quant", inter, True)):
                x = torch.randn(tokens, 2 * k if act else k, device=dev, dtype=dt)
                row(workload="fp8-op", model=model, op=op, tokens=tokens, K=k,
                    us={"picked": bench(lambda x=x, act=act: T.quant_rows(x, act="silu_mul" if act else "none"))})
            # The decoder's add + RMSNorm ahead of an FP8 linear: then quant_rows, or the codes from the norm.
            x, res = (torch.randn(tokens, hidden, device=dev, dtype=dt) for _ in range(2))
            w = torch.ones(hidden, device=dev, dtype=dt)
            # In a CUDA graph, as the decode step runs them (do_bench would time two launches' Python too).
            row(workload="fp8-op", model=model, op="add+norm(+quant)", tokens=tokens, K=hidden, us_in_graph={
                "norm": round(graph_us([lambda: T.rmsnorm(x, w, 1e-6, residual=res)]), 2),
                "norm,quant": round(graph_us([lambda: T.quant_rows(T.rmsnorm(x, w, 1e-6, residual=res))]), 2),
                "norm+quant": round(graph_us([lambda: T.rmsnorm(x, w, 1e-6, residual=res, quant=True)]), 2)})
            qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=dev, dtype=dt)
            pos = torch.randint(0, 4000, (tokens,), device=dev)
            rope = RotaryEmbedding(d, 4096, 1e6).to(dev)
            slots = max(tokens, 64)
            cache = [torch.zeros(slots, hkv, d, device=dev, dtype=fp8.FP8) for _ in range(2)]
            quant = fp8.KVQuant(torch.full((hkv,), 0.01, device=dev), torch.full((hkv,), 0.01, device=dev),
                                torch.zeros(hkv, d, device=dev), torch.zeros(hkv, d, device=dev))
            loc = torch.randperm(slots, device=dev)[:tokens]
            configs = [None, (1, 1), (8, 2), (16, 4), (32, 4), (64, 4), (64, 8)]
            us = {str(c): bench(lambda c=c: T.qk_norm_rope_(qkv, pos, rope.cos, rope.sin, hq, hkv, d, None, None,
                                                           1e-6, (*cache, loc, quant), config=c)) for c in configs}
            row(workload="fp8-op", model=model, op="rope+fp8-kv", tokens=tokens, K=(hq + 2 * hkv) * d, us=us)

    # torch._scaled_mm's use_fast_accum (~10% faster at 256 rows) skips the fp32 promotion of Hopper's FP8
    # sums: its error against the exact product of the same codes, on zero-mean and on same-sign operands.
    for m, n, k in ((256, 28672, 4096), (256, 4096, 14336)):
        for data, shift in (("zero-mean", 0.0), ("same-sign", 0.5)):
            g = torch.Generator(dev).manual_seed(k)
            a = torch.randn(m, k, device=dev, generator=g)
            a = (a + shift).abs() if shift else a
            (xq, xs), (wq, ws) = fp8.quantize_rows(a.to(dt)), fp8.quantize_rows(
                (torch.randn(n, k, device=dev, generator=g) + shift) * 0.02)
            ref = fp8.dequantize(xq, xs).double() @ fp8.dequantize(wq, ws).double().T
            err = {}
            for tag, fast in (("exact", False), ("fast_accum", True)):
                y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.reshape(1, -1), out_dtype=dt,
                                     use_fast_accum=fast).double()
                err[tag] = f"{((y - ref).norm() / ref.norm()).item():.2e}"
            row(workload="fp8-op", op="scaled_mm rel err", M=m, N=n, K=k, data=data, **err)

GEMV_SHAPES = {  # (N, K) of each linear at batch 1
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
                   "lm_head": (151936, 1024)},
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                     "lm_head": (128256, 4096)},
}


def bench_gemv(do_sweep: bool = False, fp8: bool = False, sweep_fp8: bool = False,
               fp8_rows: tuple[int, ...] = (256, 8192)) -> None:
    """Triton GEMV (kernels/triton/gemv.py) vs cuBLAS (F.linear) at one row, weights cold in L2.

    Each timing runs the op over enough weight copies (>= 200 MB in all, twice the L2) inside one CUDA
    graph, as the decode step does; us = per call. `--sweep` also tries other block shapes (pick_config's source).
    `fp8`: the same layers with FP8 weights too (bench_fp8_linear at `fp8_rows`; `sweep_fp8` sweeps its block shapes).
    """
    from minisgl_cli.kernels.triton import gemv as G

    dev, dt = torch.device("cuda"), torch.bfloat16
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sweep = [(bn, bk, w) for bn in (1, 2, 4, 8, 16, 32) for bk in (256, 512, 1024) for w in (4, 8) if bn * bk <= 16384]
    if not do_sweep:
        sweep = []
    for model, shapes in GEMV_SHAPES.items():
        for name, (n, k) in shapes.items():
            act = name == "down"
            copies = max(2, min(16, -(-200_000_000 // (n * k * 2))))
            ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
            x = torch.randn(1, 2 * k if act else k, device=dev, dtype=dt)
            xin = torch.nn.functional.silu(x[:, :k]) * x[:, k:] if act else x
            ref = (xin.double() @ ws[0].double().T)
            mine = G.gemv(x, ws[0], act_mul=act).double()
            err = ((mine - ref).norm() / ref.norm()).item()
            cub = graph_us([lambda w=w: torch.nn.functional.linear(xin, w) for w in ws])
            if act:  # cuBLAS path also pays the separate SiLU-and-mul kernel
                from minisgl_cli.kernels.triton import ops as T

                cub = graph_us([lambda w=w: torch.nn.functional.linear(T.silu_and_mul(x), w) for w in ws])
            picked = G.pick_config(n, k, act)
            us_pick = graph_us([lambda w=w: G.gemv(x, w, act_mul=act) for w in ws])
            best = (picked, us_pick)
            for cfg in sweep:
                if cfg[0] > 1 and -(-n // cfg[0]) < sms // 2:
                    continue
                us = graph_us([lambda w=w: G.gemv(x, w, act_mul=act, config=cfg) for w in ws])
                if best is None or us < best[1]:
                    best = (cfg, us)
            gb = n * k * 2 / 1e9
            row(workload="gemv", model=model, op=name, N=n, K=k, cublas_us=round(cub, 2),
                triton_us=round(us_pick, 2), picked=list(picked), best_cfg=list(best[0]), best_us=round(best[1], 2),
                cublas_tbs=round(gb / cub * 1e3, 2), triton_tbs=round(gb / us_pick * 1e3, 2), rel_err=f"{err:.2e}")
            if fp8:
                bench_fp8_linear(model, name, ws, x, act, sweep_fp8, fp8_rows)
            del ws
            torch.cuda.empty_cache()


def bench_fp8_linear(model: str, name: str, ws: list[torch.Tensor], x: torch.Tensor, act: bool, do_sweep: bool,
                     rows: tuple[int, ...] = (256, 8192)) -> None:
    """FP8 weights of the same layer: the batch-1 GEMV (vs bf16's bytes) and, at each of `rows` (1: batch-1 decode
    as W8A8, the way the batched steps run), per-token quant + torch._scaled_mm against bf16 cuBLAS; errors against
    the fp32 quantize / dequantize reference."""
    from minisgl_cli.kernels import fp8
    from minisgl_cli.kernels.triton import gemv as G
    from minisgl_cli.kernels.triton import ops as T

    n, k = ws[0].shape
    qs = [fp8.quantize_rows(w) for w in ws]
    qs = [(q, s[:, 0].contiguous()) for q, s in qs]
    xin = T.silu_and_mul(x) if act else x
    ref = xin.double() @ fp8.dequantize(*qs[0][:1], qs[0][1][:, None]).double().T
    mine = G.gemv(x, qs[0][0], act_mul=act, scale=qs[0][1]).double()
    err = ((mine - ref).norm() / ref.norm()).item()
    picked = G.pick_config(n, k, act, 1)
    us = graph_us([lambda q=q: G.gemv(x, q[0], act_mul=act, scale=q[1]) for q in qs])
    best = (picked, us)
    if do_sweep:  # both kernels' shapes (pick_config's source)
        mma = [(bn, bk, w, st, pf) for bn in (4, 8, 16, 32) for bk in (32, 64, 128) for w, st, pf in
               ((4, 2, 0), (4, 3, 0), (4, 4, 0), (4, 1, 1), (4, 3, 2), (4, 3, 3), (8, 3, 0), (8, 3, 2))
               if bn * bk <= 2048]
        for cfg in [(4, 512, 4), (8, 512, 4), (8, 1024, 8)] + [c for c in mma if G.mma_fits(k, c)]:
            t = graph_us([lambda q=q, cfg=cfg: G.gemv(x, q[0], act_mul=act, scale=q[1], config=cfg) for q in qs])
            if t < best[1]:
                best = (cfg, t)
    # 256 rows (a full decode batch) and 8192 (a prefill chunk): bf16 cuBLAS vs FP8 (activation quant + row-wise
    # scaled GEMM; also with use_fast_accum, which skips the fp32 promotion of Hopper's FP8 accumulators)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    cells: dict = {}
    for m in [r for r in rows if r <= 256 or name != "lm_head"]:  # 8192 rows of logits: no LM head does that
        xm = torch.randn((m, 2 * k if act else k), device="cuda", dtype=torch.bfloat16, generator=g)
        xm_in = T.silu_and_mul(xm) if act else xm

        def fp8_mm(q, xm=xm, fast=False):
            xq, xs = T.quant_rows(xm, act="silu_mul" if act else "none")
            return torch._scaled_mm(xq, q[0].t(), scale_a=xs, scale_b=q[1][None, :], out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)

        ref_m = (fp8.round_trip_rows(xm_in).double() @ fp8.dequantize(qs[0][0], qs[0][1][:, None]).double().T)
        cells[f"m{m}_rel_err"] = f"{((fp8_mm(qs[0]).double() - ref_m).norm() / ref_m.norm()).item():.2e}"
        reps = 20 if m <= 256 else 3
        cells[f"m{m}_bf16_us"] = round(graph_us([lambda w=w, xm=xm: torch.nn.functional.linear(
            T.silu_and_mul(xm) if act else xm, w) for w in ws], reps), 2)
        cells[f"m{m}_fp8_us"] = round(graph_us([lambda q=q, xm=xm: fp8_mm(q, xm) for q in qs], reps), 2)
        cells[f"m{m}_fp8_fast_us"] = round(graph_us([lambda q=q, xm=xm: fp8_mm(q, xm, True) for q in qs], reps), 2)
        del xm, xm_in, ref_m
    # bytes read: the e4m3 codes (1 per weight) and the fp32 scales; x and y are noise next to them
    tbs = lambda t: round((n * k + 4 * n) / t / 1e6, 2)  # noqa: E731  (bytes / us / 1e6 = TB/s)
    row(workload="gemv-fp8", model=model, op=name, N=n, K=k, fp8_us=round(us, 2), fp8_tbs=tbs(us),
        picked=list(picked), best_cfg=list(best[0]), best_us=round(best[1], 2), best_tbs=tbs(best[1]),
        rel_err=f"{err:.2e}", **cells)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="ops,gemv,qwen,llama")
    ap.add_argument("--sweep", action="store_true", help="GEMV section: also sweep block shapes")
    ap.add_argument("--sweep-fp8", action="store_true", help="GEMV section: sweep the FP8 GEMV's block shapes")
    ap.add_argument("--fp8-rows", default="256,8192",
                    help="GEMV section with --fp8: the row counts of quant + torch._scaled_mm (1: batch 1 as W8A8)")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "flashinfer"])
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate baselines")
    ap.add_argument("--main-only", action="store_true", help="only the default variant (graphs, overlap, fused)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "bf16", "fp8_e4m3"], help="every engine's KV cache dtype")
    ap.add_argument("--quantization", choices=["auto", "none", "fp8"], help="every engine's linear weights")
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled rows' temperature")
    ap.add_argument("--top-p", type=float, default=0.9, help="the sampled rows' top-p")
    ap.add_argument("--top-k", type=int, default=-1, help="the sampled rows' top-k (-1: off)")
    ap.add_argument("--min-p", type=float, default=0.0, help="the sampled rows' min-p (0: off)")
    ap.add_argument("--also-temperature", type=float, action="append", default=[],
                    help="one more sampled row at this temperature alone (1.0: the OpenAI default); repeatable")
    ap.add_argument("--greedy-only", action="store_true", help="no sampled rows")
    ap.add_argument("--fp8", action="store_true",
                    help="each model in bf16 and its FP8 settings, side by side (implies --main-only)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    only = set(args.only.split(","))
    BACKEND[0] = args.attention_backend
    if not args.greedy_only:
        SAMPLED.append(dict(temperature=args.temperature, top_p=args.top_p, **{
            k: v for k, v, off in (("top_k", args.top_k, -1), ("min_p", args.min_p, 0.0)) if v != off}))
        SAMPLED.extend(dict(temperature=t) for t in args.also_temperature)
    DTYPES.update({k: v for k, v in (("kv_cache_dtype", args.kv_cache_dtype), ("quantization", args.quantization))
                   if v is not None})
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    sections = []
    if "ops" in only:
        sections.append(("ops", bench_ops))
    if "fp8ops" in only:
        sections.append(("fp8ops", bench_fp8_ops))
    if "gemv" in only:
        fp8_rows = tuple(int(r) for r in args.fp8_rows.split(","))
        sections.append(("gemv", lambda: bench_gemv(args.sweep, args.fp8 or args.sweep_fp8, args.sweep_fp8, fp8_rows)))

    def side_by_side(name: str, tag: str, settings: list[dict]) -> None:
        for kw in settings:  # one engine at a time: each needs the memory the last one held
            e = make_engine(name, **kw)
            bench_engine(tag, e, True, [(True, True)], [(True, True)], args.profile)
            drop_engine(e)
            del e

    if "qwen" in only and args.fp8:
        sections.append(("qwen", lambda: side_by_side("qwen3-0.6b", "Qwen3-0.6B", [
            dict(kv_cache_dtype="auto", quantization="none"), dict(kv_cache_dtype="fp8_e4m3", quantization="none")])))
    if "llama" in only and args.fp8:
        sections.append(("llama", lambda: side_by_side("llama-3.1-8b", "Llama-3.1-8B", [
            dict(kv_cache_dtype="auto", quantization="none"), dict(kv_cache_dtype="auto", quantization="fp8"),
            dict(kv_cache_dtype="fp8_e4m3", quantization="fp8")])))
    if "qwen" in only and not args.fp8:
        def qwen():
            e = make_engine("qwen3-0.6b")
            if args.main_only:
                bench_engine("Qwen3-0.6B", e, True, [(True, True)], [(True, True)], args.profile)
                return
            full = [(True, True), (True, False), (False, True), (False, False)]
            bench_engine("Qwen3-0.6B", e, True, [(True, True), (True, False)], full, args.profile)
            # what the fused ops buy once the launches are gone: recapture the graphs with torch ops
            e.kernels.fused = False
            e.capture_graphs()
            bench_engine("Qwen3-0.6B", e, False, [], [(True, True)], False)
            e.kernels.fused = True
            pdl_off(e, "Qwen3-0.6B")
            if not args.no_hf:
                hf_bench("Qwen3-0.6B", e, "qwen3-0.6b", True, 128)
        sections.append(("qwen", qwen))
    # Qwen3-30B-A3B in bf16: its KV pool as large as memory allows (None), the others' 300k tokens where that fits
    # (an H200: the preset's ~290k tokens all held at once), ~120k on an H100 beside 61 GB of weights.
    if "moe" in only and args.fp8:
        sections.append(("moe", lambda: side_by_side("qwen3-30b-a3b", "Qwen3-30B-A3B", [
            dict(quantization="none", max_total_tokens=None), dict(quantization="fp8"),
            dict(quantization="fp8", kv_cache_dtype="fp8_e4m3")])))
    if "moe" in only and not args.fp8:
        def moe():
            e = make_engine("qwen3-30b-a3b", max_total_tokens=None)
            bench_engine("Qwen3-30B-A3B", e, True, [(True, True)], [(True, True)], args.profile)
        sections.append(("moe", moe))
    if "mixtral" in only:  # 93 GB in bf16: FP8 weights only (47 GB), so one H100 holds it; its KV pool by memory
        # (300k tokens would take 39 GB, more than an H100 leaves beside the weights)
        sections.append(("mixtral", lambda: side_by_side("mixtral-8x7b", "Mixtral-8x7B", [
            dict(quantization="fp8", max_total_tokens=None)])))
    if "llama" in only and not args.fp8:
        def llama():
            e = make_engine("llama-3.1-8b")
            if args.main_only:
                bench_engine("Llama-3.1-8B", e, True, [(True, True)], [(True, True)], args.profile)
                return
            bench_engine("Llama-3.1-8B", e, True, [(True, True), (True, False)],
                         [(True, True), (True, False), (False, True)], args.profile)
            pdl_off(e, "Llama-3.1-8B")
            if not args.no_hf:
                hf_bench("Llama-3.1-8B", e, "llama-3.1-8b", False, 64)
        sections.append(("llama", llama))
    for name, fn in sections:
        try:
            fn()
        except Exception as exc:  # one broken section must not cost the others' numbers
            import traceback

            traceback.print_exc()
            row(section=name, error=f"{type(exc).__name__}: {exc}")
        gc.collect()
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)  # a folder of its own per run (flashinfer_gpu.sh: one a backend)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(ROWS, f, indent=1)
    print("\n==== summary (" + torch.cuda.get_device_name() + ") ====")
    for r in ROWS:
        if r.get("workload") == "gemv":
            print(
                f"gemv {r['model']:<13} {r['op']:<8} cublas {r['cublas_us']:>8.1f}us {r['cublas_tbs']:.2f}TB/s  "
                f"triton {r['triton_us']:>8.1f}us {r['triton_tbs']:.2f}TB/s {r['picked']}  "
                f"best {r['best_us']} {r['best_cfg']}"
            )
        elif r.get("workload") == "gemv-fp8":
            print(f"gemv-fp8 {r['model']:<13} {r['op']:<8} fp8 {r['fp8_us']:>8.1f}us {r['fp8_tbs']:.2f}TB/s "
                  f"{r['picked']} best {r['best_us']}us {r['best_tbs']:.2f}TB/s {r['best_cfg']} err {r['rel_err']}  |  "
                  + "  ".join(f"M={m}: bf16 {r[f'm{m}_bf16_us']}us fp8 {r[f'm{m}_fp8_us']}us "
                              f"(fast {r[f'm{m}_fp8_fast_us']}) err {r[f'm{m}_rel_err']}"
                              for m in (256, 8192) if f"m{m}_fp8_us" in r))
        elif r.get("workload") == "fp8-op" and "tokens" in r:
            times = r.get("us") or r["us_in_graph"]
            print(f"fp8-op {r['model']:<13} {r['op']:<11} T={r['tokens']:<5} K={r['K']:<6} "
                  + "  ".join(f"{c}: {t}" for c, t in times.items()) + ("  (in a graph)" if "us" not in r else ""))
        elif r.get("workload") == "op":
            print(f"op {r['op']:<13} T={r['tokens']:<5} h={r['hidden']:<5} torch {r['torch_us']:>8.1f}us "
                  f"triton {r['triton_us']:>8.1f}us x{r['speedup']:<5} err {r['max_abs_err']:.3g}")
        else:
            print("  ".join(f"{k}={v}" for k, v in r.items()))
    table = {}  # (model, workload) -> {dtypes: tok/s}, the engine rows of the default variant
    for r in ROWS:
        if r.get("engine") == "minisgl" and r.get("graphs") and r.get("overlap") and r.get("fused", True) \
                and r.get("sampling", "greedy") == "greedy":
            table.setdefault((r["model"], r["workload"]), {})[r["dtypes"]] = r["tok_s"]
    greedy: dict = {}  # sampled rows next to the greedy row of the same setting: their ratio
    for r in ROWS:
        if r.get("engine") == "minisgl" and "sampling" in r:
            key = tuple(r.get(k) for k in ("model", "workload", "dtypes", "graphs", "overlap", "fused", "pdl"))
            if r["sampling"] == "greedy":
                greedy[key] = r["tok_s"]
            elif key in greedy:
                print(f"sampled {r['model']:<13} {r['workload']:<17} {r['dtypes']:<9} graphs={r['graphs']} "
                      f"overlap={r['overlap']} {r['sampling']} ({r['sampler']}): {r['tok_s']:,.1f} tok/s = "
                      f"{r['tok_s'] / greedy[key]:.2f} x greedy ({greedy[key]:,.1f})")
    cols = ["bf16", "fp8-kv", "fp8-w", "fp8-w+kv"]
    if any(len(v) > 1 for v in table.values()):
        print("\n==== output tok/s by dtypes (" + torch.cuda.get_device_name() + ") ====")
        print(f"{'model':<14}{'workload':<18}" + "".join(f"{c:>11}" for c in cols))
        for (model, workload), v in table.items():
            print(f"{model:<14}{workload:<18}" + "".join(f"{v[c]:>11,.1f}" if c in v else f"{'-':>11}" for c in cols))


if __name__ == "__main__":
    main()
