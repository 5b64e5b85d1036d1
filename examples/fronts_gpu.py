"""One GPU, one run: the nano-vllm preset (256 requests in flight, greedy) on Qwen3-0.6B dummy weights, for each KV
dtype of --kv (FP8 by default), through the scheduler driven directly (raw), `minisgl bench` offline and `minisgl serve`
+ `minisgl bench --url`, each with the same prefill budget (raw's 16,384 tokens unless --max-prefill-tokens says
otherwise), then a short table of out tok/s, each as a share of raw, and each process's CPU over HTTP. Each path's
figure is the median of --draws (3) warm draws of one engine or server: one 5-second draw moved by 20% between calls.

    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py        # ~130 s on one H100, starts included
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --paths raw,http   # ~90 s
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --kv bf16,fp8_e4m3  # both KV dtypes, ~260 s

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

HERE = Path(__file__).resolve().parent
ENGINE = dict(model="qwen3-0.6b", max_running_requests=256, cuda_graph_max_bs=256, max_total_tokens=300_000)


def flags(kv: str) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ENGINE.items()) + f" --kv-cache-dtype {kv} " \
        "--load-format dummy"


def raw_child(prefill: int, kv: str, draws: int) -> None:
    """The scheduler driven directly (gpu_bench.py's run_requests): a warm-up of every prefill shape, timed draws."""
    sys.path.insert(0, str(HERE))
    import gpu_bench as gb

    e = gb.make_engine(ENGINE["model"], kv_cache_dtype=kv)
    prompts, outs = gb.preset()
    gb.run_requests(e, prompts, [2] * len(prompts), overlap=True, prefill_tokens=prefill)
    runs = [gb.run_requests(e, prompts, outs, overlap=True, prefill_tokens=prefill) for _ in range(draws)]
    print(json.dumps({"draws": [st.tokens / st.wall for st in runs]}))


def median(draws: list[float]) -> tuple[float, str]:
    """The figure of a path's draws, and their spread for the table."""
    return statistics.median(draws), f"{min(draws):,.0f}-{max(draws):,.0f} over {len(draws)}"


def timed(cmd: list[str], log: Path, timeout: float = 300) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout)
    log.write_text(log.read_text() + p.stdout)
    return p.returncode, time.perf_counter() - t0, p.stdout


def one_dtype(kv: str, paths: list[str], prefill: int, draws: int, out: Path) -> None:
    """Each path of one KV dtype, then its table: each path's median of `draws` warm draws."""
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, float] = {}
    notes: dict[str, str] = {}
    budget = f"--max-prefill-tokens {prefill}"
    # The fronts' sweeps: a first draw at 256 meets every prefill shape (as raw's warm-up does), then the timed ones.
    sweep = "--concurrency 256 " * (draws + 1)
    if "raw" in paths:
        rc, secs, stdout = timed([sys.executable, __file__, "--child-raw", "--max-prefill-tokens", str(prefill),
                                  "--kv", kv, "--draws", str(draws)], out / "raw.log")
        if rc == 0:
            got["raw"], spread = median(json.loads(stdout.strip().splitlines()[-1])["draws"])
        notes["raw"] = f"{secs:.0f}s" + (f", {spread}" if rc == 0 else f", failed ({rc}): see raw.log")
    if "offline" in paths:
        report = out / "offline.json"
        rc, secs, _ = timed([sys.executable, "-m", "minisgl_cli.app", "bench", "--preset", "nano-vllm",
                             *flags(kv).split(), *budget.split(), "--no-baseline", *sweep.split(), "--warmup", "1",
                             "--output-json", str(report)], out / "offline.log")
        if rc == 0:
            results = json.loads(report.read_text())["results"]
            got["offline"], spread = median([r["output_throughput"] for r in results[1:]])
        notes["offline"] = f"{secs:.0f}s" + (f", {spread}" if rc == 0 else f", failed ({rc}): see offline.log")
    if "http" in paths:
        rc, secs, _ = timed([sys.executable, str(HERE / "fronts_cpu.py"), "--serve-args", f"{flags(kv)} {budget}",
                             "--bench-args", f"--preset nano-vllm --num-prompts 256 {sweep}--warmup 1",
                             "--out", str(out / "http")], out / "http.log")
        if rc == 0:
            report = json.loads((out / "http" / "bench-base.json").read_text())
            got["http"], spread = median([r["output_throughput"] for r in report["results"][1:]])
        notes["http"] = f"{secs:.0f}s" + (f", {spread}" if rc == 0 else f", failed ({rc}): see http.log")
    raw = got.get("raw")
    print(f"\nQwen3-0.6B dummy, {kv} KV, nano-vllm preset (256 in flight, greedy), prefill budget {prefill}")
    print(f"{'path':<9}{'out tok/s':>12}{'of raw':>9}  wall, draws")
    for p in paths:
        v = got.get(p)
        share = f"{v / raw:.2f}" if v and raw else "-"
        print(f"{p:<9}{(f'{v:,.0f}' if v else '-'):>12}{share:>9}  {notes.get(p, '')}")
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
    ap.add_argument("--child-raw", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_raw:
        raw_child(args.max_prefill_tokens, args.kv, args.draws)
        return
    for kv in args.kv.split(","):
        one_dtype(kv, args.paths.split(","), args.max_prefill_tokens, args.draws, Path(args.out) / kv)


if __name__ == "__main__":
    main()
