"""Issue 50's decode kernels, each timed alone with the decode fusions on and off, against its bytes; and the engine's
decode steps with the fusions on and off (Kernels.fused_decode, env MINISGL_FUSED_DECODE).

    PYTHONPATH=.:examples python examples/decode_kernels_gpu.py [--models llama-3.1-8b,qwen3-0.6b] [--tokens 1,2,4]
        [--fp8] [--sweep] [--e2e-model llama-3.1-8b] [--e2e-tokens 1] [--no-e2e]

Kernels, at each model's widths and each token count (rows of a decode step), over enough copies of the weights to
miss L2 (>= 200 MB a graph), captured back to back in one CUDA graph and replayed between CUDA events (us a call):
  qkv, o, lm_head   one linear: before, the batch-1 GEMV at 1 row and cuBLAS at 2-4; fused, the GEMV at every count
  qkv+rope          (no q/k norm: Llama) the qkv linear as above, then ops.qk_norm_rope_ (RoPE, K/V to the pool);
                    fused, one GEMV with both in its epilogue
  mlp               gate-up, SiLU-and-mul, down: before, at 1 row the gate-up GEMV then the down GEMV with the
                    SiLU-and-mul on its input, at 2-4 cuBLAS, silu_and_mul, cuBLAS; fused, the gate-up GEMV with
                    the SiLU-and-mul in its epilogue, then the down GEMV (--fp8: the same with FP8 weights, 1 row)
floor_us is the op's bytes (weights + activations) at the device-to-device copy bandwidth measured first;
of_floor = floor_us / us (1.0: the op reads at the copy's speed). --sweep also tries block shapes of the 2-4 row
kernel (gemv.pick_rows_config's source).

End to end: --e2e-tokens requests of a 128-token prompt decoding 512 tokens together (greedy, CUDA graphs and overlap
on, dummy weights), with the fusions off then on: ms a step, tok/s, and the device ops a decode step launches
(counted by torch.profiler with the graphs off).

Without CUDA (a smoke test of this script) it runs each op once at small widths under Triton's interpreter
(TRITON_INTERPRET=1, triton on PYTHONPATH; see tests/test_gpu_decode_fusions.py) and checks fused against unfused,
no timing; without the interpreter either it says so and exits.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from timing import graph_us  # examples/, beside this script

CUDA = torch.cuda.is_available()
WIDTHS = {  # hidden, q heads, kv heads, head dim, intermediate, vocab, q/k norm
    "llama-3.1-8b": (4096, 32, 8, 128, 14336, 128256, False),
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 151936, True),
    "tiny": (64, 4, 2, 16, 96, 200, False),  # the CPU smoke test's
}
Op = Callable[[int], torch.Tensor]  # copy index -> the op's output


def linear_before(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A linear as a decode step ran it before the fusions: the GEMV at one row, else torch's GEMM."""
    from minisgl_cli.kernels.triton.gemv import gemv

    return gemv(x, w) if x.shape[0] == 1 else F.linear(x, w)


def mlp_before(x: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, sgu=None, sd=None) -> torch.Tensor:
    from minisgl_cli.kernels.triton import ops as T

    if x.shape[0] == 1:
        return T.gemv(T.gemv(x, wgu, scale=sgu), wd, act_mul=True, scale=sd)
    return F.linear(T.silu_and_mul(F.linear(x, wgu)), wd)


def mlp_fused(x: torch.Tensor, wgu: torch.Tensor, wd: torch.Tensor, sgu=None, sd=None) -> torch.Tensor:
    from minisgl_cli.kernels.triton import ops as T

    return T.gemv(T.gemv(x, wgu, scale=sgu, gate_up=True), wd, scale=sd)


def weight_copies(shapes: tuple[tuple[int, int], ...], dev: str, dt: torch.dtype, budget: int = 200_000_000,
                  itemsize: int = 2) -> tuple[list[list[torch.Tensor]], int]:
    """Copies of random [N, K] weights of `shapes` (one list a copy), enough of them for `budget` bytes in all (2-16):
    a graph over them reads its weights from DRAM, not L2. And one copy's bytes (at `itemsize` bytes a weight)."""
    nbytes = sum(n * k * itemsize for n, k in shapes)
    copies = max(2, min(16, -(-budget // nbytes)))
    return [[torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for n, k in shapes] for _ in range(copies)], nbytes


def cases(model: str, rows: int, fp8: bool, dev: str, dt: torch.dtype, budget: int):
    """(op, bytes, copies, before, fused) at `model`'s widths; each op takes the index of a weight copy (enough copies
    for `budget` bytes in all, so the timed graph reads them from DRAM, not L2)."""
    from minisgl_cli.kernels import fp8 as F8
    from minisgl_cli.kernels.triton.gemv import gemv

    h, nq, nkv, d, inter, vocab, qk_norm = WIDTHS[model]
    qkv, q = (nq + 2 * nkv) * d, nq * d
    x = torch.randn(rows, h, device=dev, dtype=dt)
    act_bytes = lambda *widths: sum(rows * w * x.element_size() for w in widths)  # noqa: E731

    def weights(*shapes: tuple[int, int], itemsize: int = 2) -> tuple[list[list[torch.Tensor]], int]:
        return weight_copies(shapes, dev, dt, budget, itemsize)

    for name, (n, k) in {"qkv": (qkv, h), "o": (h, q), "lm_head": (vocab, h)}.items():
        ws, nbytes = weights((n, k))
        xi = x if k == h else torch.randn(rows, k, device=dev, dtype=dt)
        yield (name, nbytes + act_bytes(k, n), len(ws), lambda i, ws=ws, xi=xi: linear_before(xi, ws[i][0]),
               lambda i, ws=ws, xi=xi: gemv(xi, ws[i][0]))
    if not qk_norm:  # the engine's qkv + RoPE + K/V store (a q/k norm keeps ops.qk_norm_rope_ after the GEMV)
        kv_bytes = act_bytes(2 * nkv * d)  # the new K and V rows in the pool
        yield rope_case(x, *weights((qkv, h)), nq, nkv, d, act_bytes(h, qkv) + kv_bytes)
    ws, nbytes = weights((2 * inter, h), (h, inter))
    # activations: x in, gate-up out (before: 2I, read again by the next kernel; fused: I), down out
    yield ("mlp", nbytes + act_bytes(h, inter, h), len(ws), lambda i: mlp_before(x, *ws[i]),
           lambda i: mlp_fused(x, *ws[i]))
    if fp8 and rows == 1:
        ws8, nbytes = weights((2 * inter, h), (h, inter), itemsize=1)
        q8 = []
        for wgu, wd in ws8:
            (cgu, sgu), (cd, sd) = F8.quantize_rows(wgu.float()), F8.quantize_rows(wd.float())
            q8.append((cgu, cd, sgu[:, 0].contiguous(), sd[:, 0].contiguous()))
        del ws8
        yield ("mlp fp8", nbytes + act_bytes(h, inter, h), len(q8), lambda i: mlp_before(x, *q8[i]),
               lambda i: mlp_fused(x, *q8[i]))


def rope_case(x: torch.Tensor, ws: list[list[torch.Tensor]], nbytes: int, nq: int, nkv: int, d: int, act: int,
              config: tuple[int, ...] | None = None):
    """("qkv+rope", ...): before, the qkv linear then ops.qk_norm_rope_ storing K/V; fused, gemv_rope_kv (at `config`:
    its block shape, default the pick)."""
    from minisgl_cli.kernels.triton import ops as T
    from minisgl_cli.layers.rotary import RotaryEmbedding

    rows, dev = x.shape[0], x.device
    rope = RotaryEmbedding(d, 8192, 500000.0).to(dev)
    pos = torch.arange(4000, 4000 + rows, device=dev)
    kv = (torch.zeros(64, nkv, d, device=dev, dtype=x.dtype), torch.zeros(64, nkv, d, device=dev, dtype=x.dtype),
          torch.arange(rows, device=dev), None)

    def before(i: int) -> torch.Tensor:
        qkv = linear_before(x, ws[i][0])
        T.qk_norm_rope_(qkv, pos, rope.cos, rope.sin, nq, nkv, d, None, None, 0.0, kv)
        return qkv

    return ("qkv+rope", nbytes + act, len(ws), before,
            lambda i: T.gemv_rope_kv(x, ws[i][0], None, pos, rope.cos, rope.sin, nq, nkv, d, kv, config=config))


def copies_us(fn: Op, copies: int, reps: int = 20) -> float:
    """Median us a call of fn over each weight copy, captured back to back in one CUDA graph (as a decode step runs)."""
    return graph_us([lambda i=i: fn(i) for i in range(copies)], reps, draws=7)


def kernels(models: list[str], tokens: list[int], fp8: bool, sweep: bool) -> None:
    from families_gpu import copy_bandwidth

    bw = copy_bandwidth()
    fp8 = fp8 and torch.cuda.get_device_capability() >= (8, 9)
    print(f"{torch.cuda.get_device_name()}: device copy {bw / 1e12:.2f} TB/s\n")
    print(f"{'model':<14}{'op':<9}{'rows':>5}{'floor_us':>10}{'before_us':>11}{'fused_us':>10}{'of_floor':>10}"
          f"{'speed-up':>10}")
    for model in models:
        for rows in tokens:
            for name, nbytes, copies, before, fused in cases(model, rows, fp8, "cuda", torch.bfloat16, 200_000_000):
                ref, got = before(0).float(), fused(0).float()
                err = ((got - ref).norm() / ref.norm()).item()
                b_us, f_us = copies_us(before, copies), copies_us(fused, copies)
                floor = nbytes / bw * 1e6
                print(f"{model:<14}{name:<9}{rows:>5}{floor:>10.2f}{b_us:>11.2f}{f_us:>10.2f}{floor / f_us:>10.2f}"
                      f"{b_us / f_us:>9.2f}x" + (f"  (rel. diff {err:.1e})" if err > 1e-2 else ""), flush=True)
            torch.cuda.empty_cache()
        if sweep:
            sweep_rows(model, tokens)
            if 1 in tokens and not WIDTHS[model][6]:
                sweep_rope(model)


def sweep_rows(model: str, tokens: list[int]) -> None:
    """Block shapes of the 1-4 row kernel on the gate-up (SiLU epilogue) and, from 2 rows, down projections (one row's
    down projection is the one-row kernel's, swept by gpu_bench.py --only gemv --sweep)."""
    from minisgl_cli.kernels.triton.gemv import pick_rows_config

    h, _, _, _, inter, _, _ = WIDTHS[model]
    for rows in tokens:
        for name, (n, k), gate_up in (("gate_up", (2 * inter, h), True), ("down", (h, inter), False)):
            if rows == 1 and not gate_up:
                continue
            ws = [c[0] for c in weight_copies(((n, k),), "cuda", torch.bfloat16)[0]]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            picked = pick_rows_config(n // 2 if gate_up else n, k, rows, gate_up)
            shapes = [(bn, bk, w) for bn in ((2, 4, 8) if gate_up else (1, 2, 4)) for bk in (128, 256, 512, 1024)
                      for w in (2, 4, 8)]
            timed = {cfg: _gemv_us(x, ws, gate_up, cfg) for cfg in [None, *shapes]}
            best = min((c for c in timed if c is not None), key=lambda c: timed[c])
            print(f"  sweep {model} {name} rows {rows}: picked {picked} {timed[None]:.2f} us, "
                  f"best {best} {timed[best]:.2f} us", flush=True)
            torch.cuda.empty_cache()


def sweep_rope(model: str) -> None:
    """Block shapes of the qkv GEMV with RoPE and the K/V store in its epilogue at one row (`gemv_rope_kv`), against
    the one-row GEMV then ops.qk_norm_rope_ (what a step runs without the fused decode)."""
    h, nq, nkv, d, _, _, _ = WIDTHS[model]
    ws, _ = weight_copies((((nq + 2 * nkv) * d, h),), "cuda", torch.bfloat16)
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    timed = {}
    for cfg in [None, *((bn, bk, w) for bn in (2, 4, 8, 16) for bk in (256, 512, 1024) for w in (2, 4, 8))]:
        _, _, copies, unfused, fused = rope_case(x, ws, 0, nq, nkv, d, 0, config=cfg)
        timed[cfg] = copies_us(fused, copies)
    best = min((c for c in timed if c is not None), key=lambda c: timed[c])
    print(f"  sweep {model} qkv+rope rows 1: gemv then qk_norm_rope_ {copies_us(unfused, copies):.2f} us, fused "
          f"picked {timed[None]:.2f} us, best {best} {timed[best]:.2f} us", flush=True)
    torch.cuda.empty_cache()


def _gemv_us(x: torch.Tensor, ws: list[torch.Tensor], gate_up: bool, config: tuple[int, ...] | None) -> float:
    from minisgl_cli.kernels.triton.gemv import gemv

    return copies_us(lambda i: gemv(x, ws[i], gate_up=gate_up, config=config), len(ws))


def end_to_end(model: str, tokens: list[int]) -> None:
    import random

    from gpu_bench import make_engine, run_requests

    top = max(tokens)
    e = make_engine(model, max_running_requests=max(8, top), cuda_graph_max_bs=max(8, top), max_total_tokens=32_768)
    g = random.Random(0)
    print(f"\n{'model':<14}{'rows':>5}{'fusions':>9}{'step_ms':>9}{'tok/s':>9}{'kernels/step':>14}")
    for rows in tokens:
        prompts = [[g.randint(0, 10000) for _ in range(128)] for _ in range(rows)]
        for on in (False, True):
            e.kernels.fused_decode = on
            e.capture_graphs()
            run_requests(e, prompts, [16] * rows, overlap=True)  # warm
            st = run_requests(e, prompts, [512] * rows, overlap=True)
            step = (st.last_tok - st.first_tok) / (st.tokens / rows - 1)
            print(f"{model:<14}{rows:>5}{'on' if on else 'off':>9}{step * 1e3:>9.3f}{rows / step:>9.1f}"
                  f"{kernels_per_step(e, prompts):>14.1f}", flush=True)
    e.kernels.fused_decode = True


def kernels_per_step(e, prompts: list[list[int]]) -> float:
    """Device ops (kernels, copies) a decode step launches, graphs off so the profiler sees each: two runs of 9 and
    25 new tokens, the difference over the 16 extra steps (the prefill and the first token cancel out)."""
    from gpu_bench import run_requests, with_graphs

    saved: dict = {}
    with_graphs(e, False, saved)
    counts = []
    for new in (9, 25):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run_requests(e, prompts, [new] * len(prompts), overlap=False)
            torch.cuda.synchronize()
        counts.append(sum(ev.count for ev in prof.key_averages() if ev.device_type == torch.autograd.DeviceType.CUDA))
    with_graphs(e, True, saved)
    return (counts[1] - counts[0]) / 16


def smoke() -> None:
    """No GPU: each op once under Triton's interpreter at tiny widths, fused against unfused (no timing)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("decode_kernels_gpu.py times CUDA kernels and this machine has no CUDA device; for a smoke test of "
                 "the script run it with TRITON_INTERPRET=1 and triton on PYTHONPATH")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.triton_interp import patch_interpreter

    patch_interpreter()
    for rows in (1, 2):
        for name, _, _, before, fused in cases("tiny", rows, False, "cpu", torch.float16, 0):
            ref, got = before(0).float(), fused(0).float()
            err = ((got - ref).norm() / ref.norm()).item()
            print(f"tiny {name} rows {rows}: fused vs before rel. diff {err:.1e}")
            assert err < 2e-2, (name, rows, err)
    print("smoke test passed (no CUDA: nothing timed)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3.1-8b,qwen3-0.6b")
    ap.add_argument("--tokens", default="1,2,4", help="rows of a decode step (1-4: the fused kernels' range)")
    ap.add_argument("--fp8", action="store_true", help="also the MLP with FP8 weights (1 row; Ada / Hopper)")
    ap.add_argument("--sweep", action="store_true", help="block shapes of the 2-4 row kernel")
    ap.add_argument("--e2e-model", default="llama-3.1-8b")
    ap.add_argument("--e2e-tokens", default="1", help="requests decoding together in the end-to-end rows")
    ap.add_argument("--no-e2e", action="store_true")
    args = ap.parse_args()
    if not CUDA:
        return smoke()
    tokens = [int(t) for t in args.tokens.split(",")]
    assert all(1 <= t <= 4 for t in tokens), "--tokens: 1 to 4"
    with torch.no_grad():
        kernels(args.models.split(","), tokens, args.fp8, args.sweep)
        if not args.no_e2e:
            end_to_end(args.e2e_model, [int(t) for t in args.e2e_tokens.split(",")])


if __name__ == "__main__":
    main()
