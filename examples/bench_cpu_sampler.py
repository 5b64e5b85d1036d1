"""The CPU sampler alone (sampling/sampler.py's cpu_draw): µs a call for one row of SmolLM2's vocabulary, per setting.

    python examples/bench_cpu_sampler.py [--rows 1] [--iters 200]

bf16 logits randn * 4 (fixed seed), one seed per row; the best of 3 runs of --iters calls each.
"""

from __future__ import annotations

import argparse
import time

import torch

from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.sampling.sampler import cpu_draw
from minisgl_cli.sampling.state import SamplingState
from minisgl_cli.types import SamplingParams

VOCAB = 49152  # SmolLM2's
CASES = {"t0.7": SamplingParams(temperature=0.7), "t0.7 p0.9": SamplingParams(temperature=0.7, top_p=0.9),
         "t1.0 k50": SamplingParams(temperature=1.0, top_k=50), "t0.7 min_p0.05": SamplingParams(temperature=0.7,
                                                                                                min_p=0.05)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, VOCAB, generator=g) * 4).to(torch.bfloat16)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rows} row(s), vocabulary {VOCAB}")
    for name, params in CASES.items():
        state = SamplingState(args.rows, VOCAB, torch.device("cpu"), HostBuffers())
        for i in range(args.rows):
            state.set_row(i, params, [1], [])
        batch = state.batch(list(range(args.rows)), torch.arange(args.rows),
                            torch.full((args.rows,), 5, dtype=torch.int32), [True] * args.rows)
        rows = state.params(batch.req_rows)
        for _ in range(20):
            cpu_draw(logits, rows, batch)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(args.iters):
                cpu_draw(logits, rows, batch)
            best = min(best, (time.perf_counter() - t0) / args.iters)
        print(f"{name:16s} {best * 1e6:8.0f} µs a call")


if __name__ == "__main__":
    main()
