"""What one decode graph's launch costs the host, and whether that is work or a wait for the device (issue 50).

Builds an engine (dummy weights, CUDA graphs), then times the batch-1 graph's `replay()` on the CPU: with the device
idle, and right behind a 10 ms sleep kernel (the device busy, as under the overlap loop). A launch whose CPU time is
the same both ways is the driver's own work; one that grows behind the sleep waits for room in the device's queue.
Also prints each replay's time to the device's end at --context positions, bare (`graph.replay()`) and as the
engine replays a step (`DecodeGraphs.replay`: the step's inputs copied in, the attention's metadata set, then the
graph), against the scheduler's step in decode_host.py: what is left is the step's work outside the graph. Run it
once with MINISGL_DISABLE_PDL=1 and once without: programmatic dependent launch changes how the graph's kernels are
linked (on an H200, 2026-12-01, it left the launch's CPU time as it was and took 18% off Qwen3-0.6B's graph).

    PYTHONPATH=. python examples/graph_launch.py [--model qwen3-0.6b] [--replays 50]
    MINISGL_DISABLE_PDL=1 PYTHONPATH=. python examples/graph_launch.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


@torch.inference_mode()  # (the engine's tensors are inference tensors)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--context", type=int, default=384, help="the row's positions (its page-table row: slot 0)")
    ap.add_argument("--sleep-ms", type=float, default=10.0, help="the kernel the busy launches queue behind")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch.py: needs a CUDA device (it times CUDA graph launches)")

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    engine = Engine(EngineConfig(model=args.model, load_format="dummy", device="cuda", max_running_requests=8,
                                 max_total_tokens=8192, cuda_graph_max_bs=8))
    assert engine.graphs is not None
    # one row at --context positions, every position's KV in the pool's scratch slot 0
    engine.write_page_table(0, slice(0, args.context), torch.zeros(args.context, dtype=torch.int32, device="cuda"))
    batch = engine.build_batch("decode", [0], [0], [args.context - 1], [1], [0])
    engine.graphs.replay(batch)
    graph = engine.graphs.graphs[1]  # its static inputs now hold that row
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    # the sleep kernel counts clock cycles: calibrate to milliseconds on this card
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles = int(1_000_000 * args.sleep_ms / start.elapsed_time(end))

    idle, busy, done, step = [], [], [], []
    for _ in range(args.replays):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        idle.append(t1 - t0)
        done.append(time.perf_counter() - t0)
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        graph.replay()
        busy.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        step_batch = engine.build_batch("decode", [0], [0], [args.context - 1], [1], [0])  # (its upload queued)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.graphs.replay(step_batch)
        torch.cuda.synchronize()
        step.append(time.perf_counter() - t0)
    us = {name: round(statistics.median(v) * 1e6, 1) for name, v in
          (("launch_idle_us", idle), ("launch_busy_us", busy), ("launch_to_done_us", done),
                                      ("inputs_and_launch_to_done_us", step))}
    row = {"model": args.model, "context": args.context, "pdl": not os.environ.get("MINISGL_DISABLE_PDL"), **us}
    print("RESULT " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
