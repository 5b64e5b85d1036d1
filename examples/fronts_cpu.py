"""Where the CPU goes behind `minisgl serve`: for each variant of the server's flags, start `minisgl serve`, run
`minisgl bench --url` on a workload, and print the bench's figures beside each process's CPU seconds and share of a
core (the API, tokenizer workers, detokenizer, scheduler ranks from /metrics' `process_cpu_seconds`; the bench's
own client processes from its JSON). Every variant runs in the same invocation, so a change is an A/B in one run.

    # GPU: Qwen3-0.6B dummy weights, the nano-vllm preset at 256 in flight, twice (the second draw is warm)
    python examples/fronts_cpu.py --variant base= --variant fp8kv="--kv-cache-dtype fp8_e4m3"
    python examples/fronts_cpu.py --variant "one-client=|--client-procs 1" --variant "four-clients=|--client-procs 4"
    # CPU check with the default small model
    python examples/fronts_cpu.py --serve-args "--device cpu --max-total-tokens 8192 --torch-compile off" \\
        --bench-args "--dataset random --num-prompts 8 --input-len 64 --output-len 32 --concurrency 8"

A share is CPU seconds over the timed runs' summed duration (the untimed warm-up adds a little); 100% is one
core. Logs and each run's JSON under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from minisgl_cli.api.http_server import free_port

SERVE = "--model qwen3-0.6b --load-format dummy --max-running-requests 256 --cuda-graph-max-bs 256 " \
        "--max-total-tokens 300000"
BENCH = "--preset nano-vllm --num-prompts 256 --concurrency 256 --concurrency 256 --warmup 1"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "minisgl_cli.app", *args]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve exited with code {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    sys.exit(f"serve not healthy after {timeout:.0f}s; see {log}")


def cpu(url: str) -> dict[str, float]:
    return httpx.get(f"{url}/metrics", timeout=30).json()["process_cpu_seconds"]


def run_variant(name: str, serve_args: list[str], bench_args: list[str], model: str | None, out: Path) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out / f"serve-{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cli("serve", *serve_args, "--port", str(port)), stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        before = cpu(url)
        report = out / f"bench-{name}.json"
        bench = cli("bench", "--url", url, *(["--model", model] if model else []), *bench_args,
                    "--output-json", str(report))
        with (out / f"bench-{name}.txt").open("w") as f:
            rc = subprocess.run(bench, stdout=f, stderr=subprocess.STDOUT).returncode
        after = cpu(url)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if rc != 0 or not report.exists():
        sys.exit(f"bench failed (code {rc}); see {out / f'bench-{name}.txt'}")
    results = json.loads(report.read_text())["results"]
    duration = sum(r["duration_s"] for r in results)
    last = results[-1]  # the warm draw
    server = {p: after[p] - before.get(p, 0.0) for p in after}
    return {"name": name, "out_tok_s": last["output_throughput"], "duration_s": duration,
            "client": [(s, c) for s, c in zip(last.get("client_core_share", []), last.get("client_cpu_seconds", []))],
            "server": server}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default=SERVE, help="flags of every `minisgl serve` (the model among them)")
    ap.add_argument("--bench-args", default=BENCH, help="flags of every `minisgl bench --url`")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=EXTRA_SERVE_FLAGS[|EXTRA_BENCH_FLAGS]; repeat for an A/B (default: one run, `base=`)")
    ap.add_argument("--out", default="/tmp/fronts_cpu")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    serve_args = shlex.split(args.serve_args)
    model = serve_args[serve_args.index("--model") + 1] if "--model" in serve_args else None
    rows = []
    for spec in args.variant or ["base="]:
        name, _, extra = spec.partition("=")
        serve_extra, _, bench_extra = extra.partition("|")
        serve = serve_args + shlex.split(serve_extra)
        bench = shlex.split(args.bench_args) + shlex.split(bench_extra)
        print(f"== {name}: serve {' '.join(serve)}; bench {' '.join(bench)}", flush=True)
        rows.append(run_variant(name, serve, bench, model, out))
        r = rows[-1]
        print(f"   {r['out_tok_s']:.1f} out tok/s (last run), timed runs {r['duration_s']:.1f}s", flush=True)

    procs = list(dict.fromkeys(p for r in rows for p in r["server"]))
    width = max(len(p) for p in [*procs, "client (busiest)"]) + 2
    print()
    print("".ljust(width) + "".join(f"{r['name']:>24}" for r in rows))
    print("out tok/s (last run)".ljust(width) + "".join(f"{r['out_tok_s']:>24.1f}" for r in rows))
    for p in procs:
        cells = []
        for r in rows:
            s = r["server"].get(p)
            share = f" {s / r['duration_s']:.0%}" if s is not None and r["duration_s"] else ""
            cells.append("-" if s is None else f"{s:.1f}s{share}")
        print(p.ljust(width) + "".join(f"{c:>24}" for c in cells))
    cells = []
    for r in rows:
        if r["client"]:
            share, secs = max(r["client"])
            cells.append(f"{len(r['client'])}x {secs:.1f}s {share:.0%}")
        else:
            cells.append("-")
    print("client (busiest)".ljust(width) + "".join(f"{c:>24}" for c in cells))
    print(f"\nCPU seconds over all timed runs, share = seconds / their duration (100% = one core); the client's from "
          f"the last run. Logs and JSON in {out}")


if __name__ == "__main__":
    main()
