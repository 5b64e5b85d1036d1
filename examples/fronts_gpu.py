"""One GPU, one run: the nano-vllm preset (256 requests in flight, greedy; --sampled: t=0.7, top_p=0.9) on Qwen3-0.6B
(--model: another built-in config; --quantization its weights) dummy weights, for each KV dtype of --kv (FP8 by
default), through the scheduler driven directly (raw), the Python API as processes (`LLM(processes=True)`),
`minisgl bench` offline (`--runtime processes`) and `minisgl serve` + `minisgl bench --url`, each with the same prefill
budget (raw's 16,384 tokens unless --max-prefill-tokens says otherwise), then a short table of out tok/s, each as a
share of raw, and each process's CPU over HTTP. Each path's figure is the median of --draws (3) warm draws of one
engine or server: one 5-second draw moved by 20% between calls. `--paths` also takes llm-here (`LLM()` in this
process) and offline-here (`minisgl bench --runtime in-process`): what the in-process engine gives against them.

    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py        # raw, offline, http: ~130 s on one H100; + llm
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --paths raw,http   # ~90 s
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --kv bf16,fp8_e4m3  # both KV dtypes
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --model qwen3-30b-a3b --quantization fp8 --sampled
    # the CPU: the script end to end at a tiny size (SmolLM2-135M's shape, dummy weights, 8 requests of 16..48 tokens)
    PYTHONPATH=. python examples/fronts_gpu.py --device cpu --model smollm2-135m --kv auto --num-prompts 8 \
        --lens 16,48 --max-total-tokens 4096 --max-prefill-tokens 512

Logs and JSON under $OUT/<kv>/ (raw.log, llm.log, offline.log / offline.json, http/: fronts_cpu.py's serve and bench
logs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import step_trace  # examples/, beside this script
from fronts_cpu import SERVE

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Setting:
    """What every path runs: the model, its weights and KV, the device, the pool, and the workload (`num_prompts`
    requests, input and output lengths uniform in lens; 256 and 100..1024: the nano-vllm preset)."""

    kv: str
    model: str = "qwen3-0.6b"
    quantization: str = "none"
    load_format: str = "dummy"
    device: str | None = None  # the engine's default (CUDA where there is one)
    max_total_tokens: int | None = None  # fronts_cpu.SERVE's
    num_prompts: int = 256
    lens: tuple[int, int] = (100, 1024)

    def flags(self) -> str:
        """`serve` / `bench` flags of the engine raw runs: fronts_cpu.py's (gpu_bench.make_engine's limits) with this
        model, its weights, the KV, the device and the pool."""
        out = SERVE.replace("--model qwen3-0.6b", f"--model {self.model}")
        out = out.replace("--load-format dummy", f"--load-format {self.load_format}")
        if self.max_total_tokens is not None:
            out = out.replace("--max-total-tokens 300000", f"--max-total-tokens {self.max_total_tokens}")
        return f"{out} --quantization {self.quantization} --kv-cache-dtype {self.kv}" + \
            (f" --device {self.device}" if self.device else "")

    def engine_kw(self) -> dict:
        """The same as EngineConfig fields (raw's and LLM's)."""
        kw = dict(kv_cache_dtype=self.kv, quantization=self.quantization, load_format=self.load_format)
        if self.device:
            kw["device"] = self.device
        if self.max_total_tokens is not None:
            kw["max_total_tokens"] = self.max_total_tokens
        return kw

    def workload(self) -> str:
        """The bench's workload flags: the nano-vllm preset, or the random dataset at these lengths."""
        lo, hi = self.lens
        if (lo, hi) == (100, 1024):
            return f"--preset nano-vllm --num-prompts {self.num_prompts}"
        return (f"--dataset random --num-prompts {self.num_prompts} --input-len {hi} --output-len {hi} "
                f"--range-ratio {lo / hi}")

    def preset(self, seed: int) -> tuple[list[list[int]], list[int]]:
        """raw's and LLM's requests (gpu_bench.preset: the nano-vllm preset at 256 and 100..1024)."""
        sys.path.insert(0, str(HERE))
        import gpu_bench as gb

        return gb.preset(seed, self.num_prompts, *self.lens)


SAMPLED = dict(temperature=0.7, top_p=0.9)  # --sampled: what chat clients send (issue 28's sampled rows)


def raw_child(prefill: int, draws: int, sampled: bool, setting: Setting) -> None:
    """The scheduler driven directly (gpu_bench.py's run_requests): a warm-up of every prefill shape, timed draws."""
    sys.path.insert(0, str(HERE))
    import gpu_bench as gb

    e = gb.make_engine(setting.model, **setting.engine_kw())
    prompts, outs = setting.preset(0)
    sampling = SAMPLED if sampled else None
    overlap = e.device.type == "cuda"  # as the fronts' schedulers run (overlap is a CUDA feature)
    gb.run_requests(e, prompts, [2] * len(prompts), overlap=overlap, prefill_tokens=prefill, sampling=sampling)
    runs = [gb.run_requests(e, prompts, outs, overlap=overlap, prefill_tokens=prefill, sampling=sampling)
            for _ in range(draws)]
    print(json.dumps({"draws": [st.tokens / st.wall for st in runs]}))


def llm_child(prefill: int, draws: int, sampled: bool, setting: Setting, processes: bool) -> None:
    """The Python API, `LLM(processes=...)`, with raw's limits: a warm-up of every prefill shape (the first draw's
    prompts, 2 tokens each), then `draws` timed generate calls, each on fresh prompts (as the bench draws them: no
    prefix cache hits from the draw before)."""
    from minisgl_cli import LLM, SamplingParams

    kw = {"max_running_requests": 256, "cuda_graph_max_bs": 256, "max_total_tokens": 300_000, **setting.engine_kw()}
    sampling = SAMPLED if sampled else {}
    with LLM(setting.model, processes=processes, max_prefill_tokens=prefill, **kw) as llm:
        prompts, _ = setting.preset(0)
        llm.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True, **sampling))
        tok_s, windows = [], []
        for seed in range(1, draws + 1):
            prompts, outs = setting.preset(seed)
            params = [SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling) for n in outs]
            started, t0 = time.time(), time.perf_counter()
            done = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            tok_s.append(sum(len(c.token_ids) for c in done) / wall)
            windows.append((started, wall))
    print(json.dumps({"draws": tok_s, "windows": windows}))


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


def one_dtype(setting: Setting, paths: list[str], prefill: int, draws: int, sampled: bool, out: Path) -> None:
    """Each path of one KV dtype, then its table: each path's median of `draws` warm draws (and the fronts' first)."""
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, float] = {}
    notes: dict[str, str] = {}
    by_draw: dict[str, list[str]] = {}  # each path's draws: TTFT / ITL and the client (fronts), the step trace
    budget = f"--max-prefill-tokens {prefill}"
    engine = setting.flags()
    workload = setting.workload()
    # The fronts' sweeps: a first draw at 256 meets every prefill shape (as raw's warm-up does), then the timed ones.
    sweep = f"--concurrency {setting.num_prompts} " * (draws + 1)
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

    child = [sys.executable, __file__, "--max-prefill-tokens", str(prefill), "--draws", str(draws),
             *setting_args(setting), *(["--sampled"] if sampled else [])]
    def from_child(stdout: str) -> tuple[None, list[float], list[tuple[float, float]] | None, list[str]]:
        """A child's timed draws (and for LLM their windows: the step trace by draw, with its lead and trail)."""
        got = json.loads(stdout.strip().splitlines()[-1])
        return None, got["draws"], [tuple(w) for w in got["windows"]] if "windows" in got else None, []

    if "raw" in paths:
        path("raw", [*child, "--child", "raw"], from_child)
    for name, how in (("llm", "llm-processes"), ("llm-here", "llm-in-process")):
        if name in paths:
            path(name, [*child, "--child", how], from_child)
    for name, runtime in (("offline", "processes"), ("offline-here", "in-process")):
        if name in paths:
            path(name, [sys.executable, "-m", "minisgl_cli.app", "bench", *workload.split(), *engine.split(),
                        *budget.split(), "--runtime", runtime, "--no-baseline", *sweep.split(), *sampling.split(),
                        "--warmup", "1", "--output-json", str(out / f"{name}.json")],
                 lambda _, name=name: bench_draws(out / f"{name}.json"))
    if "http" in paths:
        path("http", [sys.executable, str(HERE / "fronts_cpu.py"), "--serve-args",
                      f"{engine} {budget}",
                      "--bench-args", f"{workload} {sweep}{sampling}--warmup 1",
                      "--out", str(out / "http")],
             lambda _: bench_draws(out / "http" / "bench-base.json"))
    raw = got.get("raw")
    what = ", ".join(f"{k}={v}" for k, v in SAMPLED.items()) if sampled else "greedy"
    lo, hi = setting.lens
    print(f"\n{setting.model} {setting.load_format}, {setting.quantization} weights, {setting.kv} KV on "
          f"{setting.device or 'the default device'}, {setting.num_prompts} requests of {lo}..{hi} tokens in and out "
          f"({what}), all in flight, prefill budget {prefill}")
    print(f"{'path':<13}{'out tok/s':>12}{'of raw':>9}  wall, draws")
    for p in paths:
        v = got.get(p)
        share = f"{v / raw:.2f}" if v and raw else "-"
        print(f"{p:<13}{(f'{v:,.0f}' if v else '-'):>12}{share:>9}  {notes.get(p, '')}")
    for p in paths:
        print(f"\n{p}, by draw (the first: the warm-up sweep):")
        print("\n".join(by_draw.get(p, [])))
    if "http" in paths and (out / "http.log").exists():
        print("\nover HTTP, CPU per process (fronts_cpu.py):")
        print("\n".join(line for line in (out / "http.log").read_text().splitlines()
                        if line.startswith(("api", "detokenizer", "scheduler", "tokenizer", "client"))))
    print(f"logs and JSON in {out}", flush=True)


PATHS = ("raw", "llm", "llm-here", "offline", "offline-here", "http")


def setting_args(setting: Setting) -> list[str]:
    """The command-line flags that make `setting` again (for the raw and LLM children)."""
    return ["--kv", setting.kv, "--model", setting.model, "--quantization", setting.quantization, "--load-format",
            setting.load_format, *(["--device", setting.device] if setting.device else []),
            *(["--max-total-tokens", str(setting.max_total_tokens)] if setting.max_total_tokens else []),
            "--num-prompts", str(setting.num_prompts), "--lens", ",".join(map(str, setting.lens))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/fronts_gpu"))
    ap.add_argument("--max-prefill-tokens", type=int, default=16384, help="every path's prefill budget")
    ap.add_argument("--paths", default="raw,llm,offline,http", help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--kv", default="fp8_e4m3", help="KV cache dtypes, comma-separated (bf16, fp8_e4m3; auto)")
    ap.add_argument("--draws", type=int, default=3, help="timed draws per path (the table shows their median)")
    ap.add_argument("--sampled", action="store_true", help="every request sampled at t=0.7, top_p=0.9 (else greedy)")
    ap.add_argument("--model", default="qwen3-0.6b", help="a built-in config (dummy weights), or a model dir")
    ap.add_argument("--quantization", default="none", help="its weights: none or fp8 (`serve --quantization`)")
    ap.add_argument("--load-format", default="dummy", help="dummy (random weights), or auto for a model dir's")
    ap.add_argument("--device", help="cuda or cpu (default: the engine's, CUDA where there is one)")
    ap.add_argument("--max-total-tokens", type=int, help="the KV pool (default 300,000 tokens)")
    ap.add_argument("--num-prompts", type=int, default=256, help="requests per draw, all in flight")
    ap.add_argument("--lens", default="100,1024", help="LO,HI: input and output lengths uniform in LO..HI")
    ap.add_argument("--child", choices=("raw", "llm-processes", "llm-in-process"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    lo, hi = (int(x) for x in args.lens.split(","))
    settings = [Setting(kv, args.model, args.quantization, args.load_format, args.device, args.max_total_tokens,
                        args.num_prompts, (lo, hi)) for kv in args.kv.split(",")]
    if args.child == "raw":
        raw_child(args.max_prefill_tokens, args.draws, args.sampled, settings[0])
        return
    if args.child is not None:
        llm_child(args.max_prefill_tokens, args.draws, args.sampled, settings[0], args.child == "llm-processes")
        return
    paths = args.paths.split(",")
    if unknown := [p for p in paths if p not in PATHS]:
        ap.error(f"unknown paths: {', '.join(unknown)} (choose from {', '.join(PATHS)})")
    for setting in settings:
        one_dtype(setting, paths, args.max_prefill_tokens, args.draws, args.sampled, Path(args.out) / setting.kv)


if __name__ == "__main__":
    main()
