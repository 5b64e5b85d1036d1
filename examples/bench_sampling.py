"""The CUDA sampler's kernels alone: µs per call of the single-program path (one program per row) and the split path
(each row over cdiv(V, 2048) programs), beside the greedy argmax, at batch 1 / 8 / 64 / 256 on Qwen3's and Llama-3's
vocabularies.

    PYTHONPATH=. python examples/bench_sampling.py [--out DIR] [--iters 50]

bf16 logits randn * 4 (fixed seed), a seed per row, positions 0..B-1. `graph µs`: replays of a CUDA graph holding
the call (the GPU's time); `eager µs`: calls in a loop (the larger of the GPU's and the CPU's launch time). `same`:
the fraction of rows where split and single draw the same token (they differ only by fp32 summation order). Writes
sampling_bench.json and the table under --out (default $OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.kernels.triton.sampling import SPLIT_MAX_ROWS, warm
from minisgl_cli.sampling.sampler import triton_draw
from minisgl_cli.sampling.state import SamplingState
from minisgl_cli.types import SamplingParams

CASES = {
    "t0.7 p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t1.0": SamplingParams(temperature=1.0),
    "t0.7 k50": SamplingParams(temperature=0.7, top_k=50),
}


def _time(fn, iters: int) -> tuple[float, float]:
    """(graph µs, eager µs) per call."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / iters * 1e6
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # allocations of the call happen before capture too
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6, eager


def _case(vocab: int, name: str, p: SamplingParams, b: int, g: torch.Generator, iters: int) -> dict:
    """One row of the table: b rows of p (a seed each) on random bf16 logits."""
    dev = g.device
    logits = (torch.randn(b, vocab, device=dev, generator=g) * 4).to(torch.bfloat16)
    state = SamplingState(b, vocab, dev, HostBuffers())
    for i in range(b):
        state.set_row(i, dataclasses.replace(p, seed=1000 + i), [1], [])
    batch = state.batch(list(range(b)), torch.arange(b, device=dev),
                        torch.arange(b, dtype=torch.int32, device=dev), [True] * b)
    rp = state.params(batch.req_rows)
    am = _time(lambda: logits.argmax(dim=-1), iters)
    single = _time(lambda: triton_draw(logits, rp, batch, split=False), iters)
    split = _time(lambda: triton_draw(logits, rp, batch, split=True), iters)
    same = float((triton_draw(logits, rp, batch, split=False)
                  == triton_draw(logits, rp, batch, split=True)).double().mean())
    return dict(vocab=vocab, case=name, batch=b, argmax_us=am[0], single_graph_us=single[0],
                single_eager_us=single[1], split_graph_us=split[0], split_eager_us=split[1], same=same)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--batches", default="1,8,64,256")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    lines = [f"{torch.cuda.get_device_name()}; split path by default up to {SPLIT_MAX_ROWS} rows",
             f"{'vocab':>7} {'case':>10} {'B':>4} | {'argmax':>7} | {'single graph/eager':>19} | "
             f"{'split graph/eager':>18} | {'speedup':>7} | same"]
    print(lines[0], "\n" + lines[1], flush=True)
    for vocab in (151936, 128256):
        warm(vocab, dev)
        g = torch.Generator(dev).manual_seed(0)
        for name, p in CASES.items():
            for b in (int(x) for x in args.batches.split(",")):
                r = _case(vocab, name, p, b, g, args.iters)
                rows.append(r)
                line = (f"{vocab:>7} {name:>10} {b:>4} | {r['argmax_us']:>7.1f} | {r['single_graph_us']:>8.1f} / "
                        f"{r['single_eager_us']:>8.1f} | {r['split_graph_us']:>7.1f} / {r['split_eager_us']:>8.1f} | "
                        f"{r['single_graph_us'] / r['split_graph_us']:>6.1f}x | {r['same']:.3f}")
                lines.append(line)
                print(line, flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sampling_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(args.out, "sampling_bench.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
