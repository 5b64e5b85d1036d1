"""All-reduce micro-benchmark on two GPUs: NCCL against torch's one-shot kernel over symmetric memory (what
`--all-reduce auto` uses for small messages: minisgl_cli/distributed/one_shot.py), bf16, 4 KB to 4 MB, eager and
replayed in a CUDA graph.

    python examples/allreduce_bench.py [--json OUT.json]

Two processes (spawned, no torchrun) on GPUs 0 and 1 meet over tcp://127.0.0.1 (NCCL, NVLink multicast off).
Eager: `--iters` calls back to back between CUDA events, launches included (what an eager step pays). Graph:
`--ops` calls captured in one graph, replayed `--replays` times (what a decode step's graph pays per call).
Rank 0 prints microseconds per call; `same` says whether the one-shot sums equal NCCL's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import traceback
from collections.abc import Callable

SIZES = [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20]


def _rank(rank: int, addr: str, args: argparse.Namespace, out) -> None:
    import torch
    import torch.distributed as dist

    from minisgl_cli.distributed import DistConfig, comm
    from minisgl_cli.distributed.one_shot import OneShotAllReduce

    try:
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        comm.init_tp(rank, DistConfig(tp_size=2, init_addr=addr), device)
        one_shot = OneShotAllReduce(device, max(SIZES))  # past the engine's cap (one_shot.buffer_bytes): to compare
        one_shot.allocate()
        one_shot.rendezvous(dist.group.WORLD)
        one_shot.check(rank, 2, torch.bfloat16)

        def in_step() -> None:  # both ranks start each timing together
            dist.all_reduce(torch.ones(1, device=device))
            torch.cuda.synchronize()

        def eager(fn: Callable[[], object]) -> float:
            for _ in range(5):
                fn()
            in_step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1000 / args.iters

        def graphed(fn: Callable[[], object]) -> float:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(args.ops):
                    fn()
            for _ in range(2):
                graph.replay()
            in_step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1000 / (args.replays * args.ops)

        rows = []
        for n in SIZES:
            x = torch.randn(n // 2, device=device).to(torch.bfloat16)
            want = x.clone()
            dist.all_reduce(want)
            same = bool(torch.equal(one_shot(x), want))
            y = x.clone()
            rows.append(dict(bytes=n, same=same,
                             nccl_eager_us=eager(lambda: dist.all_reduce(y)),  # noqa: B023 - timed in this pass
                             one_shot_eager_us=eager(lambda: one_shot(x)),  # noqa: B023
                             nccl_graph_us=graphed(lambda: dist.all_reduce(y)),  # noqa: B023
                             one_shot_graph_us=graphed(lambda: one_shot(x))))  # noqa: B023
        torch.cuda.synchronize()
        out.put((rank, rows))
    except BaseException:  # noqa: BLE001 - the parent prints it
        out.put((rank, traceback.format_exc()))
    finally:
        comm.close_tp(30)


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200, help="eager calls per timing")
    parser.add_argument("--ops", type=int, default=20, help="calls captured in one graph")
    parser.add_argument("--replays", type=int, default=20, help="graph replays per timing")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before the ranks are killed")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()

    import torch

    from minisgl_cli.api.http_server import free_port
    from minisgl_cli.distributed import comm

    if torch.cuda.device_count() < 2:
        print("allreduce_bench: needs two CUDA GPUs", file=sys.stderr)
        return 1
    for name, value in comm.NO_MULTICAST.items():
        os.environ.setdefault(name, value)  # before any child starts (comm.init_tp sets them too, in each rank)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, addr, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in procs:
            rank, rows = out.get(timeout=args.timeout)
            results[rank] = rows
    except Exception as exc:  # noqa: BLE001 - a rank that hung or died: say so, kill the rest
        print(f"allreduce_bench: no result from every rank ({type(exc).__name__})", file=sys.stderr)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    failed = [f"rank {r}:\n{v}" for r, v in results.items() if isinstance(v, str)]
    if failed or 0 not in results:
        print("\n".join(failed) or "allreduce_bench: rank 0 gave nothing", file=sys.stderr)
        return 1
    rows = results[0]
    assert isinstance(rows, list)
    print(f"{'size':>6} {'NCCL eager':>11} {'one-shot eager':>15} {'NCCL graph':>11} {'one-shot graph':>15} "
          f"{'graph x':>8} {'same':>5}   (µs per all-reduce, bf16, 2 ranks)")
    for r in rows:
        print(f"{_size(r['bytes']):>6} {r['nccl_eager_us']:>11.1f} {r['one_shot_eager_us']:>15.1f} "
              f"{r['nccl_graph_us']:>11.1f} {r['one_shot_graph_us']:>15.1f} "
              f"{r['nccl_graph_us'] / r['one_shot_graph_us']:>7.2f}x {'yes' if r['same'] else 'NO':>5}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":  # spawn re-imports this file in each rank
    sys.exit(main())
