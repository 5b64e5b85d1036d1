"""One GPU, one run: the nano-vllm preset (256 requests in flight, greedy) on Qwen3-0.6B dummy weights, for each KV
dtype of --kv (FP8 by default), through the scheduler driven directly (raw), `minisgl bench` offline and `minisgl serve`
+ `minisgl bench --url`, each with the same prefill budget (raw's 16,384 tokens unless --max-prefill-tokens says
otherwise), then a short table of out tok/s, each as a share of raw, and each process's CPU over HTTP.

    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py        # ~100 s on one H100, starts included
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --paths raw,http   # ~70 s
    OUT=/tmp/fronts PYTHONPATH=. python examples/fronts_gpu.py --kv bf16,fp8_e4m3  # both KV dtypes, ~200 s

Logs and JSON under $OUT/<kv>/ (raw.log, offline.log / offline.json, http/: fronts_cpu.py's serve and bench logs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENGINE = dict(model="qwen3-0.6b", max_running_requests=256, cuda_graph_max_bs=256, max_total_tokens=300_000)


def flags(kv: str) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in ENGINE.items()) + f" --kv-cache-dtype {kv} " \
        "--load-format dummy"


def raw_child(prefill: int, kv: str) -> None:
    """The scheduler driven directly (gpu_bench.py's run_requests): a warm-up of every prefill shape, a timed run."""
    sys.path.insert(0, str(HERE))
    import gpu_bench as gb

    e = gb.make_engine(ENGINE["model"], kv_cache_dtype=kv)
    prompts, outs = gb.preset()
    gb.run_requests(e, prompts, [2] * len(prompts), overlap=True, prefill_tokens=prefill)
    st = gb.run_requests(e, prompts, outs, overlap=True, prefill_tokens=prefill)
    print(json.dumps({"tok_s": st.tokens / st.wall, "steps": st.steps, "wall_s": st.wall}))


def timed(cmd: list[str], log: Path, timeout: float = 300) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    with log.open("w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, timeout=timeout)
    log.write_text(log.read_text() + p.stdout)
    return p.returncode, time.perf_counter() - t0, p.stdout


def one_dtype(kv: str, paths: list[str], prefill: int, out: Path) -> None:
    """Each path of one KV dtype, then its table."""
    out.mkdir(parents=True, exist_ok=True)
    got: dict[str, float] = {}
    notes: dict[str, str] = {}
    budget = f"--max-prefill-tokens {prefill}"
    if "raw" in paths:
        rc, secs, stdout = timed([sys.executable, __file__, "--child-raw", "--max-prefill-tokens", str(prefill),
                                  "--kv", kv], out / "raw.log")
        if rc == 0:
            got["raw"] = json.loads(stdout.strip().splitlines()[-1])["tok_s"]
        notes["raw"] = f"{secs:.0f}s" + ("" if rc == 0 else f", failed ({rc}): see raw.log")
    if "offline" in paths:
        report = out / "offline.json"
        # two draws at 256: the first meets every prefill shape (as raw's warm-up does), the last is the figure
        rc, secs, _ = timed([sys.executable, "-m", "minisgl_cli.app", "bench", "--preset", "nano-vllm",
                             *flags(kv).split(), *budget.split(), "--no-baseline", "--concurrency", "256",
                             "--concurrency", "256", "--warmup", "1", "--output-json", str(report)],
                            out / "offline.log")
        if rc == 0:
            got["offline"] = json.loads(report.read_text())["results"][-1]["output_throughput"]
        notes["offline"] = f"{secs:.0f}s" + ("" if rc == 0 else f", failed ({rc}): see offline.log")
    if "http" in paths:
        rc, secs, _ = timed([sys.executable, str(HERE / "fronts_cpu.py"), "--serve-args", f"{flags(kv)} {budget}",
                             "--out", str(out / "http")], out / "http.log")
        if rc == 0:
            report = json.loads((out / "http" / "bench-base.json").read_text())
            got["http"] = report["results"][-1]["output_throughput"]
        notes["http"] = f"{secs:.0f}s" + ("" if rc == 0 else f", failed ({rc}): see http.log")
    raw = got.get("raw")
    print(f"\nQwen3-0.6B dummy, {kv} KV, nano-vllm preset (256 in flight, greedy), prefill budget {prefill}")
    print(f"{'path':<9}{'out tok/s':>12}{'of raw':>9}  wall")
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
    ap.add_argument("--child-raw", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_raw:
        raw_child(args.max_prefill_tokens, args.kv)
        return
    for kv in args.kv.split(","):
        one_dtype(kv, args.paths.split(","), args.max_prefill_tokens, Path(args.out) / kv)


if __name__ == "__main__":
    main()
