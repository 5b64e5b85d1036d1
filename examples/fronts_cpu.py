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
core; µs/tok is CPU microseconds per output token of the timed runs. Logs and each run's JSON under --out.

`--old TREE` also runs every variant's server from TREE (a `git archive` of the old commit; the bench client stays
this tree's), alternating old and new for `--rounds` rounds: a change's CPU per token, A/B in one run. On the CPU,
a tiny random model (examples/host_bound_cpu.py builds one) makes the engine cheap and the fronts the work:

    git archive main | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    python examples/fronts_cpu.py --old /tmp/base --rounds 2 --serve-args "--model /tmp/host_bound_cpu/tiny-model \
        --device cpu --max-running-requests 256 --max-total-tokens 204800 --torch-compile off" --bench-args \
        "--dataset random --num-prompts 256 --input-len 64 --output-len 768 --range-ratio 0.5 --concurrency 256 \
        --warmup 1 --client-procs 2"

`--py-spy SECONDS` also samples every server process (py-spy, non-blocking) for SECONDS once the bench has run
`--py-spy-delay` seconds, writes each one's collapsed stacks to --out (pyspy-<variant>-<process>.txt) and prints
each one's functions by own and by total samples: where a saturated process spends its core.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

from minisgl_cli.api import http_server
from minisgl_cli.api.http_server import free_port

SERVE = "--model qwen3-0.6b --load-format dummy --max-running-requests 256 --cuda-graph-max-bs 256 " \
        "--max-total-tokens 300000"
BENCH = "--preset nano-vllm --num-prompts 256 --concurrency 256 --concurrency 256 --warmup 1"


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "minisgl_cli.app", *args]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    try:
        http_server.wait_healthy(url, proc, timeout, poll_s=0.5)
    except RuntimeError as exc:
        sys.exit(f"serve {exc}; see {log}")


def stop(proc: subprocess.Popen) -> None:
    """End a `minisgl serve` as its user would (SIGTERM), killing it after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def tree_env(tree: Path) -> dict[str, str]:
    """This environment with `tree`'s package first on the path: a child that runs another tree's code (an A/B)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}


def cpu(url: str) -> dict[str, float]:
    return httpx.get(f"{url}/metrics", timeout=30).json()["process_cpu_seconds"]


def server_pids(proc: subprocess.Popen, log: Path) -> dict[str, int]:
    """The serve process ("api") and each child its log names: "starting scheduler rank 0 (pid 123)"."""
    pids = {"api": proc.pid}
    for name, pid in re.findall(r"starting (.+?) \(pid (\d+)\)", log.read_text()):
        pids[name.replace(" ", "-")] = int(pid)
    return pids


def top_functions(raw: Path, n: int = 12) -> list[str]:
    """py-spy's collapsed stacks ("f (file.py:12);g (file.py:30) 7" per line) summed by function: the n with the
    most own samples, then the n with the most samples inside them."""
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        k = int(count)
        samples += k
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
    pct = lambda c: f"{100 * c / samples:5.1f}%" if samples else "-"  # noqa: E731
    return ([f"{samples} samples; own:"] + [f"  {pct(c)} {f}" for f, c in own.most_common(n)] + ["total:"]
            + [f"  {pct(c)} {f}" for f, c in total.most_common(n)])


def py_spy(pids: dict[str, int], seconds: int, tag: str, out: Path) -> None:
    """Sample every process at once for `seconds`; print each one's top functions."""
    runs = {name: (out / f"pyspy-{tag}-{name}.txt",
                   subprocess.Popen(["py-spy", "record", "--nonblocking", "--format", "raw", "-r", "200", "-d",
                                     str(seconds), "-p", str(pid), "-o", str(out / f"pyspy-{tag}-{name}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
            for name, pid in pids.items()}
    for name, (path, p) in runs.items():
        _, err = p.communicate(timeout=seconds + 60)
        print(f"-- py-spy {tag} {name}:", flush=True)
        print("\n".join(top_functions(path)) if path.exists() else f"  no samples ({err.decode()[-300:].strip()})",
              flush=True)


def chunks(result: dict) -> float:
    """The streamed chunks of a bench run, from the client's figures: each request's gaps between chunks span its
    first to its last chunk (~ e2e - TTFT), so the gaps number n * (e2e - TTFT) / ITL, and the chunks n more. Below
    one per token where a consumer behind the engine got several tokens' text in one chunk."""
    n = result["completed"]
    return n * (result["mean_e2e_latency_ms"] - result["mean_ttft_ms"]) / result["mean_itl_ms"] + n \
        if result["mean_itl_ms"] else float(n)


def run_variant(name: str, serve_args: list[str], bench_args: list[str], model: str | None, out: Path,
                spy: tuple[int, float] = (0, 0.0), tree: Path | None = None) -> dict:
    """One `serve` (from `tree`'s code when given) and one `minisgl bench --url` against it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out / f"serve-{name}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(cli("serve", *serve_args, "--port", str(port)), stdout=f, stderr=subprocess.STDOUT,
                                cwd=tree, env=None if tree is None else tree_env(tree))
    try:
        wait_healthy(url, proc, log)
        before = cpu(url)
        report = out / f"bench-{name}.json"
        bench = cli("bench", "--url", url, *(["--model", model] if model else []), *bench_args,
                    "--output-json", str(report))
        with (out / f"bench-{name}.txt").open("w") as f:
            running = subprocess.Popen(bench, stdout=f, stderr=subprocess.STDOUT)
            if spy[0]:
                time.sleep(spy[1])
                py_spy(server_pids(proc, log), spy[0], name, out)
            rc = running.wait()
        after = cpu(url)
    finally:
        stop(proc)
    if rc != 0 or not report.exists():
        sys.exit(f"bench failed (code {rc}); see {out / f'bench-{name}.txt'}")
    results = json.loads(report.read_text())["results"]
    duration = sum(r["duration_s"] for r in results)
    last = results[-1]  # the warm draw
    server = {p: after[p] - before.get(p, 0.0) for p in after}
    return {"name": name, "out_tok_s": last["output_throughput"], "duration_s": duration,
            "tokens": sum(r["total_output_tokens"] for r in results), "chunks": sum(map(chunks, results)),
            "client": [(s, c) for s, c in zip(last.get("client_core_share", []), last.get("client_cpu_seconds", []))],
            "server": server}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default=SERVE, help="flags of every `minisgl serve` (the model among them)")
    ap.add_argument("--bench-args", default=BENCH, help="flags of every `minisgl bench --url`")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=EXTRA_SERVE_FLAGS[|EXTRA_BENCH_FLAGS]; repeat for an A/B (default: one run, `base=`)")
    ap.add_argument("--out", default="/tmp/fronts_cpu")
    ap.add_argument("--py-spy", type=int, default=0, metavar="SECONDS", help="sample each server process this long")
    ap.add_argument("--py-spy-delay", type=float, default=10.0, help="seconds into the bench before sampling")
    ap.add_argument("--old", help="also serve every variant from this tree (the old commit's files): an A/B")
    ap.add_argument("--rounds", type=int, default=1, help="run the variants (old and new alternating) this often")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    serve_args = shlex.split(args.serve_args)
    model = serve_args[serve_args.index("--model") + 1] if "--model" in serve_args else None
    trees = ([("@old", Path(args.old).resolve())] if args.old else []) + [("", None)]
    rows = []
    for r in range(args.rounds):
        for spec in args.variant or ["base="]:
            name, _, extra = spec.partition("=")
            serve_extra, _, bench_extra = extra.partition("|")
            serve = serve_args + shlex.split(serve_extra)
            bench = shlex.split(args.bench_args) + shlex.split(bench_extra)
            for suffix, tree in trees:
                tag = name + suffix + (f"#{r}" if args.rounds > 1 else "")
                print(f"== {tag}: serve {' '.join(serve)}; bench {' '.join(bench)}", flush=True)
                rows.append(run_variant(tag, serve, bench, model, out, (args.py_spy, args.py_spy_delay), tree))
                done = rows[-1]
                print(f"   {done['out_tok_s']:.1f} out tok/s (last run), timed runs {done['duration_s']:.1f}s",
                      flush=True)

    procs = list(dict.fromkeys(p for r in rows for p in r["server"]))
    width = max(len(p) for p in [*procs, "client (busiest)"]) + 2
    print()
    print("".ljust(width) + "".join(f"{r['name']:>24}" for r in rows))
    print("out tok/s (last run)".ljust(width) + "".join(f"{r['out_tok_s']:>24.1f}" for r in rows))
    print("chunks / token".ljust(width) + "".join(f"{r['chunks'] / max(r['tokens'], 1):>24.3f}" for r in rows))
    for p in procs:
        cells = []
        for r in rows:
            s = r["server"].get(p)
            share = f" {s / r['duration_s']:.0%}" if s is not None and r["duration_s"] else ""
            per_token = f" {1e6 * s / r['tokens']:.1f}µs/tok" if s is not None and r["tokens"] else ""
            cells.append("-" if s is None else f"{s:.1f}s{share}{per_token}")
        print(p.ljust(width) + "".join(f"{c:>24}" for c in cells))
    cells = []
    for r in rows:
        if r["client"]:
            share, secs = max(r["client"])
            cells.append(f"{len(r['client'])}x {secs:.1f}s {share:.0%}")
        else:
            cells.append("-")
    print("client (busiest)".ljust(width) + "".join(f"{c:>24}" for c in cells))
    print(f"\nCPU seconds over all timed runs, share = seconds / their duration (100% = one core), µs/tok = CPU "
          f"microseconds per output token of the timed runs; the client's from the last run. Logs and JSON in {out}")


if __name__ == "__main__":
    main()
