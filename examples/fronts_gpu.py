"""One GPU, one run: the nano-vllm preset (256 requests in flight, greedy; --sampled: t=0.7, top_p=0.9) on Qwen3-0.6B
(--model: another built-in config; --quantization its weights) dummy weights, for each KV dtype of --kv (FP8 by
default), through the scheduler driven directly (raw), `minisgl bench` offline and `minisgl serve` + `minisgl bench
--url`, each with the same prefill budget (raw's 16,384 tokens unless --max-prefill-tokens says otherwise), then a
short table of out tok/s, each as a share of raw, and each process's CPU over HTTP. Each path's figure is the median
of --draws (3) warm draws of one engine or server: one 5-second draw moved by 20% between calls.

    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py        # ~130 s on one H100, starts included
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --paths raw,http   # ~90 s
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --kv bf16,fp8_e4m3  # both KV dtypes, ~260 s
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --model qwen3-30b-a3b --quantization fp8 --sampled

Logs and JSON under $OUT/<kv>/ (raw.log, offline.log / offline.json, http/: fronts_cpu.py's serve and bench logs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import step_trace  # examples/, beside this script
from fronts_cpu import SERVE

HERE = Path(__file__).resolve().parent


def flags(kv: str, model: str, quantization: str) -> str:
    """`serve` / `bench` flags of the engine raw runs: fronts_cpu.py's (gpu_bench.make_engine's limits) with this
    model, its weights and the KV."""
    return f"{SERVE.replace('--model qwen3-0.6b', f'--model {model}')} --quantization {quantization} " \
           f"--kv-cache-dtype {kv}"


SAMPLED = dict(temperature=0.7, top_p=0.9)  # --sampled: what chat clients send (issue 28's sampled rows)


def raw_child(prefill: int, kv: str, draws: int, sampled: bool, model: str, quantization: str) -> None:
    """The scheduler driven directly (gpu_bench.py's run_requests): a warm-up of every prefill shape, timed draws."""
    sys.path.insert(0, str(HERE))
    import gpu_bench as gb

    e = gb.make_engine(model, kv_cache_dtype=kv, quantization=quantization)
    prompts, outs = gb.preset()
    sampling = SAMPLED if sampled else None
    gb.run_requests(e, prompts, [2] * len(prompts), overlap=True, prefill_tokens=prefill, sampling=sampling)
    runs = [gb.run_requests(e, prompts, outs, overlap=True, prefill_tokens=prefill, sampling=sampling)
            for _ in range(draws)]
    print(json.dumps({"draws": [st.tokens / st.wall for st in runs]}))


def median(draws: list[float]) -> tuple[float, str]:
    """The figure of a path's draws, and their spread for the table."""
    return statistics.median(draws), f"{min(draws):,.0f}-{max(draws):,.0f} over {len(draws)}"


def timed(cmd: list[str], log: Path, trace: Path, timeout: float = 300) -> tuple[int, float, str]:
    """Run cmd (its scheduler's step trace under `trace`), its stderr then stdout into log."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout,
                           env={**os.environ, "MINISGL_STEP_TRACE_DIR": str(trace)})
    log.write_text(log.read_text() + p.stdout)
    return p.returncode, time.perf_counter() - t0, p.stdout


def one_dtype(kv: str, paths: list[str], prefill: int, draws: int, sampled: bool, out: Path, model: str,
              quantization: str) -> None:
    """Each path of one KV dtype, then its table: each path's median of `draws` warm draws (and the fronts' first)."""
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, float] = {}
    notes: dict[str, str] = {}
    by_draw: dict[str, list[str]] = {}  # each path's draws: TTFT / ITL and the client (fronts), the step trace
    budget = f"--max-prefill-tokens {prefill}"
    engine = flags(kv, model, quantization)
    # The fronts' sweeps: a first draw at 256 meets every prefill shape (as raw's warm-up does), then the timed ones.
    sweep = "--concurrency 256 " * (draws + 1)
    sampling = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in SAMPLED.items()) + " " if sampled else ""

    def path(name: str, cmd: list[str], figures) -> None:
        """Run one path's command (its log under out), its timed draws' median into `got`, their spread and the first
        draw (right after the start and a one-request warm-up: every prefill shape still new) into `notes`."""
        rc, secs, stdout = timed(cmd, out / f"{name}.log", out / f"{name}-trace")
        if rc != 0:
            notes[name] = f"{secs:.0f}s, failed ({rc}): see {name}.log"
            return
        first, draws_, windows, lines = figures(stdout)
        by_draw[name] = lines + step_trace.report(out / f"{name}-trace", windows=windows)
        if windows and os.environ.get("TRITON_CACHE_DIR"):  # kernels Triton compiled during each draw
            made = [d.stat().st_mtime for d in Path(os.environ["TRITON_CACHE_DIR"]).iterdir()]
            counts = [sum(t0 <= t <= t0 + d for t in made) for t0, d in windows]
            by_draw[name].append(f"Triton kernels compiled during each draw: {counts}")
        got[name], spread = median(draws_)
        notes[name] = f"{secs:.0f}s, {spread}" + (f"; first draw {first:,.0f}" if first is not None else "")

    def client(r: dict) -> str:
        """The bench client's processes over a draw: the busiest one's share of a core, their GC pauses."""
        if not r.get("client_core_share"):
            return ""
        return (f"; client: {len(r['client_core_share'])} proc, busiest {max(r['client_core_share']):.0%}, GC "
                f"{sum(r['client_gc_seconds']) * 1e3:.0f} ms (longest {max(r['client_gc_longest_seconds']) * 1e3:.0f})")

    def bench_draws(report: Path) -> tuple[float, list[float], list[tuple[float, float]], list[str]]:
        """The first draw's tok/s, the timed draws', every draw's (start, seconds) and its TTFT / ITL line."""
        results = json.loads(report.read_text())["results"]
        lines = [f"  draw {i}: {r['output_throughput']:,.0f} tok/s, TTFT p50 / p99 {r['median_ttft_ms']:,.0f} / "
                 f"{r['p99_ttft_ms']:,.0f} ms, ITL p50 / p99 {r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} ms"
                 f"{client(r)}" for i, r in enumerate(results)]
        tok_s = [r["output_throughput"] for r in results]
        return tok_s[0], tok_s[1:], [(r["started_at"], r["duration_s"]) for r in results], lines

    if "raw" in paths:
        path("raw", [sys.executable, __file__, "--child-raw", "--max-prefill-tokens", str(prefill), "--kv", kv,
                     "--draws", str(draws), "--model", model, "--quantization", quantization,
                     *(["--sampled"] if sampled else [])],
             lambda stdout: (None, json.loads(stdout.strip().splitlines()[-1])["draws"], None, []))
    if "offline" in paths:
        path("offline", [sys.executable, "-m", "minisgl_cli.app", "bench", "--preset", "nano-vllm", *engine.split(),
                         *budget.split(), "--no-baseline", *sweep.split(), *sampling.split(), "--warmup", "1",
                         "--output-json", str(out / "offline.json")],
             lambda _: bench_draws(out / "offline.json"))
    if "http" in paths:
        path("http", [sys.executable, str(HERE / "fronts_cpu.py"), "--serve-args",
                      f"{engine} {budget}",
                      "--bench-args", f"--preset nano-vllm --num-prompts 256 {sweep}{sampling}--warmup 1",
                      "--out", str(out / "http")],
             lambda _: bench_draws(out / "http" / "bench-base.json"))
    raw = got.get("raw")
    what = ", ".join(f"{k}={v}" for k, v in SAMPLED.items()) if sampled else "greedy"
    print(f"\n{model} dummy, {quantization} weights, {kv} KV, nano-vllm preset (256 in flight, {what}), "
          f"prefill budget {prefill}")
    print(f"{'path':<9}{'out tok/s':>12}{'of raw':>9}  wall, draws")
    for p in paths:
        v = got.get(p)
        share = f"{v / raw:.2f}" if v and raw else "-"
        print(f"{p:<9}{(f'{v:,.0f}' if v else '-'):>12}{share:>9}  {notes.get(p, '')}")
    for p in paths:
        print(f"\n{p}, by draw (the first: the warm-up sweep):")
        print("\n".join(by_draw.get(p, [])))
    if "http" in paths and (out / "http.log").exists():
        print("\nover HTTP, CPU per process (fronts_cpu.py):")
        print("\n".join(line for line in (out / "http.log").read_text().splitlines()
                        if line.startswith(("api", "detokenizer", "scheduler", "tokenizer", "client"))))
    print(f"logs and JSON in {out}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/fronts_gpu"))
    ap.add_argument("--max-prefill-tokens", type=int, default=16384, help="every path's prefill budget")
    ap.add_argument("--paths", default="raw,offline,http")
    ap.add_argument("--kv", default="fp8_e4m3", help="KV cache dtypes, comma-separated (bf16, fp8_e4m3)")
    ap.add_argument("--draws", type=int, default=3, help="timed draws per path (the table shows their median)")
    ap.add_argument("--sampled", action="store_true", help="every request sampled at t=0.7, top_p=0.9 (else greedy)")
    ap.add_argument("--model", default="qwen3-0.6b", help="a built-in config (dummy weights)")
    ap.add_argument("--quantization", default="none", help="its weights: none or fp8 (`serve --quantization`)")
    ap.add_argument("--child-raw", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_raw:
        raw_child(args.max_prefill_tokens, args.kv, args.draws, args.sampled, args.model, args.quantization)
        return
    for kv in args.kv.split(","):
        one_dtype(kv, args.paths.split(","), args.max_prefill_tokens, args.draws, args.sampled, Path(args.out) / kv,
                  args.model, args.quantization)


if __name__ == "__main__":
    main()
