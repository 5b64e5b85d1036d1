"""Batch-1 decode's host work per step: where the scheduler process's CPU goes between two device steps (issue 50).

One request (a 128-token prompt, --tokens new tokens, greedy or sampled) runs through the scheduler driven in this
thread, as `minisgl chat` runs one user. Printed per step: wall time, the thread's CPU time, and the split of that
CPU over the scheduler's phases (schedule / build and launch / read and process). On CUDA that CPU time includes
spinning: on a read that waits for the device, and in a graph launch that waits for room in a queue the step before
still fills. "host own" is the host's work alone: steps that each start with the device drained. Then, over
--profile-steps steps of a second request: the device's kernels a step (count, µs each), the torch ops each step
launches (CPU µs by op, torch.profiler) and the Python functions by own time (cProfile). `--old DIR` runs the same
in a child on another tree first (before / after in one call).

    PYTHONPATH=. python examples/decode_host.py [--model qwen3-0.6b] [--tokens 512] [--sampled] [--old /tmp/base]
    PYTHONPATH=. python examples/decode_host.py --model smollm2-135m --device cpu --tokens 64   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import time
from pathlib import Path

import torch


def kernel_table(prof, steps: int) -> str:
    """The device's kernels per step (count, µs each, µs a step) and its busy time a step, from a CUDA trace."""
    rows = []
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", 0.0) or 0.0
        if dev <= 0 or e.key.startswith(("cuda", "aten::")):  # runtime calls and ops: their kernels count
            continue
        rows.append((dev / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    busy = sum(r[0] for r in rows)
    lines = [f"device busy {busy:.1f} µs/step, {sum(r[1] for r in rows):.1f} kernels/step",
             f"{'µs/step':>8} {'n/step':>7} {'µs each':>8}  kernel"]
    lines += [f"{t:8.1f} {n:7.1f} {t / n:8.2f}  {k[:90]}" for t, n, k in rows[:40]]
    return "\n".join(lines)


def timeline_table(prof, model: str) -> str:
    """The device's timeline over the profiled steps: each decode graph's span (first kernel's start to last's end),
    the idle time inside it (no kernel running), and what runs between two decode graphs (the step's work outside
    its graph: input copies, page-table writes, the read-back), from the CUDA trace's kernel and copy records."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())["traceEvents"]
    api = {e["args"]["correlation"]: e["name"] for e in trace
           if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"], api.get(e.get("args", {}).get("correlation"), "?"),
                  e.get("args", {}).get("correlation")) for e in trace
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("ph") == "X")
    graphs: dict[int, list[tuple]] = {}
    for op in ops:
        if op[3] == "cudaGraphLaunch":
            graphs.setdefault(op[4], []).append(op)
    decode = sorted((g for g in graphs.values() if len(g) >= 20), key=lambda g: g[0][0])  # the model's graphs

    def busy(run: list[tuple], lo: float, hi: float) -> float:
        """µs in [lo, hi] with at least one of run's records on the device."""
        total, end = 0.0, lo
        for s0, s1, *_ in sorted(run):
            s0, s1 = max(s0, end), min(s1, hi)
            if s1 > s0:
                total += s1 - s0
                end = s1
        return total

    spans, idle_in, gaps, idle_gap = [], [], [], []
    between: dict[str, list[float]] = {}
    bubbles: dict[str, float] = {}  # idle µs inside the graphs, by the kernel that ends it
    for a, b in zip(decode, decode[1:]):
        lo, hi = a[0][0], max(o[1] for o in a)
        spans.append(hi - lo)
        idle_in.append(hi - lo - busy(a, lo, hi))
        end = lo
        for o in sorted(a):
            if o[0] > end:
                bubbles[o[2][:60]] = bubbles.get(o[2][:60], 0.0) + o[0] - end
            end = max(end, o[1])
        nxt = b[0][0]
        gaps.append(nxt - hi)
        mid = [o for o in ops if hi <= o[0] < nxt]
        idle_gap.append(nxt - hi - busy(mid, hi, nxt))
        for o in mid:
            between.setdefault(f"{o[2][:60]} ({o[3]})", []).append(o[1] - o[0])
    n = max(1, len(gaps))
    mean = lambda v: sum(v) / max(1, len(v))  # noqa: E731
    lines = [f"timeline {model}: {len(gaps)} steps; decode graph span {mean(spans):.1f} µs "
             f"({mean([len(g) for g in decode]):.0f} records), idle inside it {mean(idle_in):.1f} µs; "
             f"between graphs {mean(gaps):.1f} µs, idle there {mean(idle_gap):.1f} µs",
             f"{'n/step':>7} {'µs each':>8}  between two decode graphs"]
    lines += [f"{len(v) / n:7.2f} {mean(v):8.2f}  {k}" for k, v in sorted(between.items(), key=lambda kv: -sum(kv[1]))]
    lines += [f"{'µs/step':>7}  idle inside the graph before (by kernel)"]
    lines += [f"{v / n:7.2f}  {k}" for k, v in sorted(bubbles.items(), key=lambda kv: -kv[1])[:12]]
    print("TIMELINE " + json.dumps({"model": model, "span_us": round(mean(spans), 1),
                                    "idle_in_graph_us": round(mean(idle_in), 1), "between_us": round(mean(gaps), 1),
                                    "idle_between_us": round(mean(idle_gap), 1)}), flush=True)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    from timing import accumulate  # examples/, beside this script

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.messages import AddRequest
    from minisgl_cli.scheduler import overlap as overlap_mod
    from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig
    from minisgl_cli.types import SamplingParams

    kw = {"cuda_graph_max_bs": 8} if args.device != "cpu" else {}
    engine = Engine(EngineConfig(model=args.model, load_format="dummy", device=args.device, max_running_requests=8,
                                 max_total_tokens=8192, quantization=args.quantization, **kw))
    phases: dict[str, float] = {}
    clock = time.thread_time
    for owner, attr, label in ((Scheduler, "_schedule", "schedule"), (Scheduler, "_run", "build + launch"),
                               (overlap_mod.Launched, "start", "read-back start"),
                               (overlap_mod.Launched, "read", "read (wait)"), (Scheduler, "_process", "process")):
        accumulate(owner, attr, label, phases, clock)
    sampling = {"temperature": 0.7, "top_p": 0.9} if args.sampled else {}
    done = [False]

    def emit(msg) -> None:
        done[0] = done[0] or any(o.finish_reason is not None for o in msg.outputs)

    sched = Scheduler(engine, SchedulerConfig(), emit)
    prompt = [(7 * i + 3) % 5000 + 10 for i in range(128)]

    def drained(rid: str, tokens: int) -> tuple[float, dict[str, float]]:
        """The host's own work a step: each step starts with the device idle, so no launch waits on a queue that
        is full and the read finds its step done. CPU µs a step."""
        done[0] = False
        sched.handle(AddRequest(rid, prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True, **sampling)))
        sched.step()
        steps, cpu = 0, 0.0
        phases.clear()
        prof = cProfile.Profile() if args.profile_drained else None
        while not done[0]:
            if torch.cuda.is_available() and args.device != "cpu":
                torch.cuda.synchronize()
            if prof is not None:
                prof.enable()
            c0 = clock()
            sched.step()
            cpu += clock() - c0
            if prof is not None:
                prof.disable()
            steps += 1
        while sched._inflight is not None:
            sched.step()
        if prof is not None:  # (its own overhead inflates the phases above)
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            print(f"-- the drained steps' Python functions ({steps} steps)\n{buf.getvalue()}", flush=True)
        return cpu / steps * 1e6, {k: round(v / steps * 1e6, 1) for k, v in phases.items()}

    def one(rid: str, tokens: int, profile: int = 0) -> tuple[int, float, float, str]:
        done[0] = False
        sched.handle(AddRequest(rid, prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True, **sampling)))
        sched.step()  # the prefill
        steps, ops = 0, ""
        prof = cprof = None
        phases.clear()
        w0, c0 = time.perf_counter(), clock()
        while not done[0]:
            if profile and steps == 20:
                acts = [torch.profiler.ProfilerActivity.CPU]
                if torch.cuda.is_available() and args.device != "cpu":
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                prof = torch.profiler.profile(activities=acts)
                prof.__enter__()
            if profile and steps == 20 + profile:
                assert prof is not None
                prof.__exit__(None, None, None)
                ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
                kernels = kernel_table(prof, profile)
                if acts[-1] != torch.profiler.ProfilerActivity.CPU:
                    kernels += "\n" + timeline_table(prof, args.model)
                ops = kernels + "\n" + ops
                prof = None
                cprof = cProfile.Profile()
                cprof.enable()
            if cprof is not None and steps == 20 + 2 * profile:
                cprof.disable()
                buf = io.StringIO()
                pstats.Stats(cprof, stream=buf).sort_stats("tottime").print_stats(30)
                ops += "\n" + buf.getvalue()
                cprof = None
            sched.step()
            steps += 1
        while sched._inflight is not None:
            sched.step()
        return steps, time.perf_counter() - w0, clock() - c0, ops

    one("warm", 64)
    steps, wall, cpu, _ = one("timed", args.tokens)
    split = {k: round(v / steps * 1e6, 1) for k, v in phases.items()}
    host_own, own_split = drained("drained", min(args.tokens, 256))
    _, _, _, ops = one("profiled", 40 + 2 * args.profile_steps + 8, profile=args.profile_steps)
    if args.print_ops:
        print(ops, flush=True)
    out = {"model": args.model, "quantization": args.quantization, "sampled": args.sampled, "steps": steps,
           "tok_s": round(steps / wall, 1),
           "step_us": round(wall / steps * 1e6, 1), "host_cpu_us": round(cpu / steps * 1e6, 1),
           "host_own_us": round(host_own, 1), "split_us": split, "own_split_us": own_split}
    print("RESULT " + json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--sampled", action="store_true", help="temperature 0.7, top-p 0.9 (default greedy)")
    ap.add_argument("--profile-steps", type=int, default=100)
    ap.add_argument("--print-ops", action="store_true", help="print the torch-op and cProfile tables")
    ap.add_argument("--profile-drained", action="store_true",
                    help="cProfile the drained steps too (the host's own work by function; inflates their figure)")
    ap.add_argument("--quantization", default="auto", help="the engine's linear weights (auto, none, fp8)")
    ap.add_argument("--old", help="another tree: the same run there first, in a child")
    args = ap.parse_args()
    rows = []
    if args.old:
        argv = [a for a in sys.argv[1:] if a != "--old" and a != args.old]
        # This script (it may be newer than that tree) on that tree's package.
        env = {**os.environ, "PYTHONPATH": f"{args.old}:{os.environ.get('PYTHONPATH', '')}"}
        child = subprocess.run([sys.executable, os.path.abspath(__file__), *argv],
                               env=env, capture_output=True, text=True)
        print(child.stdout[-20000:], child.stderr[-3000:] if child.returncode else "", flush=True)
        rows += [{"tree": "old", **json.loads(line[7:])} for line in child.stdout.splitlines()
                 if line.startswith("RESULT ")]
    rows.append({"tree": "new", **run(args)})
    print(f"\n{'tree':5} {'model':14} {'mode':8} {'tok/s':>8} {'step µs':>8} {'host CPU µs':>11} {'host own µs':>11}"
          "  split µs/step")
    for r in rows:
        print(f"{r['tree']:5} {r['model']:14} {'sampled' if r['sampled'] else 'greedy':8} {r['tok_s']:8.1f} "
              f"{r['step_us']:8.1f} {r['host_cpu_us']:11.1f} {r['host_own_us']:11.1f}  {r['split_us']}")
        print(f"{'':>62}  drained: {r.get('own_split_us')}")


if __name__ == "__main__":
    main()
