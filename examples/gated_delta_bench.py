"""Microbenchmark of a Gated DeltaNet layer's prefill (attention/gated_delta.py): each request alone vs all at once.

One extend step's causal conv (`conv_prefill`) and chunked gated delta rule (`prefill`) over a batch of requests,
timed two ways: a call per request (a Python loop over the batch, as the engine ran them before) and one call for
the whole batch (the engine's path now: every chunk's intra-chunk work in one batched call, the state carried over
all requests together). Shapes are one linear layer of Qwen3.5-9B (16 key heads, 32 value heads of 128 x 128) unless
--heads says otherwise; the table gives the median milliseconds and tokens per second of each.

    PYTHONPATH=. python examples/gated_delta_bench.py [--device cuda] [--dtype bfloat16] [--heads 4,8,64,64]
                                                      [--cases 1x1024,8x256,32x100-1024,128x64] [--reps 5]

A case is BxN (B requests of N tokens) or BxLO-HI (B lengths drawn uniformly in LO..HI, the nano-vllm workload's).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minisgl_cli.attention import gated_delta


def lengths(case: str, gen: torch.Generator) -> list[int]:
    b, n = case.split("x")
    if "-" in n:
        lo, hi = (int(s) for s in n.split("-"))
        return torch.randint(lo, hi + 1, (int(b),), generator=gen).tolist()
    return [int(n)] * int(b)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Step:
    """One extend step's inputs to a linear layer: the conv's rows and the delta rule's, each request's slot."""

    lens: list[int]
    x: torch.Tensor
    weight: torch.Tensor
    conv: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    ssm: torch.Tensor
    slots: torch.Tensor

    @staticmethod
    def random(lens: list[int], heads: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device) -> Step:
        hk, hv, dk, dv = heads
        T, B, channels, width = sum(lens), len(lens), 2 * hk * dk + hv * dv, 3  # conv kernel 4
        def rand(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.randn(*shape, dtype=dt, device=device)

        return Step(lens, rand(T, channels), rand(channels, width + 1) * 0.5, rand(B, channels, width),
                    rand(T, hk, dk), rand(T, hk, dk), rand(T, hv, dv), -rand(T, hv, dt=torch.float32).abs(),
                    rand(T, hv).sigmoid(), rand(B, hv, dk, dv, dt=torch.float32) * 0.1, torch.arange(B, device=device))


def batched(s: Step) -> None:
    """The engine's path: every request of the step in one call of each."""
    gated_delta.conv_prefill(s.x, s.weight, s.conv, s.slots, s.lens)
    gated_delta.prefill(s.q, s.k, s.v, s.g, s.beta, s.ssm, s.slots, s.lens)


def per_request(s: Step) -> None:
    """A call of each per request, in turn (as the engine ran them before)."""
    at = 0
    for i, n in enumerate(s.lens):
        rows, slot = slice(at, at + n), s.slots[i : i + 1]
        gated_delta.conv_prefill(s.x[rows], s.weight, s.conv, slot, [n])
        gated_delta.prefill(s.q[rows], s.k[rows], s.v[rows], s.g[rows], s.beta[rows], s.ssm, slot, [n])
        at += n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="the model dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--heads", default="16,32,128,128", help="key heads, value heads, k_dim, v_dim")
    ap.add_argument("--cases", default="1x1024,8x256,32x100-1024,128x64")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    hk, hv, dk, dv = heads = tuple(int(h) for h in args.heads.split(","))
    gen = torch.Generator().manual_seed(0)
    print(f"device={device} dtype={dtype} key/value heads={hk}/{hv} k/v dims={dk}/{dv} "
          f"conv channels={2 * hk * dk + hv * dv} chunk={gated_delta.CHUNK}")
    print(f"{'case':>14} {'tokens':>7} {'per-request ms':>15} {'batched ms':>11} {'speed-up':>9} "
          f"{'per-request tok/s':>18} {'batched tok/s':>14}")
    for case in args.cases.split(","):
        step = Step.random(lengths(case, gen), heads, dtype, device)  # type: ignore[arg-type]
        T = sum(step.lens)
        alone = timed(functools.partial(per_request, step), device, args.reps)
        together = timed(functools.partial(batched, step), device, args.reps)
        print(f"{case:>14} {T:>7} {alone * 1e3:>15.2f} {together * 1e3:>11.2f} {alone / together:>8.2f}x "
              f"{T / alone:>18.0f} {T / together:>14.0f}")


if __name__ == "__main__":
    main()
