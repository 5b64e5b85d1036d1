"""TP decode, one engine start per configuration: greedy tokens (with each position's top two logprobs) on a
fixed prompt set, then batch-1 decode speed; `--report` compares the configurations' files.

    python examples/tp_decode.py --tp 1 --json /tmp/tp/tp1.json                  # Llama-3.1-8B dummy weights
    python examples/tp_decode.py --tp 2 --json /tmp/tp/tp2.json                  # --all-reduce auto
    python examples/tp_decode.py --tp 2 --all-reduce nccl --json /tmp/tp/tp2-nccl.json
    python examples/tp_decode.py --report /tmp/tp/tp1.json /tmp/tp/tp2.json /tmp/tp/tp2-nccl.json

Batch-1 decode is what `minisgl bench --concurrency 1` measures (the same engine target and metrics: median
TPOT, its inverse in tok/s) over `--num-prompts` requests of `--input-len` random ids and `--output-len` tokens,
EOS ignored, after one warm-up request. Greedy tokens: 4 prompts of 17 / 100 / 250 / 600 random ids, 32 tokens
each. The report counts identical sequences against the first file, and where one splits, TP 1's gap between
its top two logprobs there (a near tie: under 0.06, tests/test_gpu_numerics.py's tolerance).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

TIE = 6e-2
PROMPT_LENS = (17, 100, 250, 600)


def measure(args: argparse.Namespace) -> dict:
    from minisgl_cli.api.http_server import free_port
    from minisgl_cli.bench.metrics import compute_metrics
    from minisgl_cli.bench.offline import EngineTarget
    from minisgl_cli.bench.workloads import BenchRequest, random_case
    from minisgl_cli.client.protocol import complete
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.runtime.config import RuntimeConfig
    from minisgl_cli.runtime.launch import launch
    from minisgl_cli.scheduler.scheduler import SchedulerConfig
    from minisgl_cli.types import GenerateRequest, SamplingParams

    engine = EngineConfig(model=args.model, load_format="dummy", max_running_requests=len(PROMPT_LENS),
                          cuda_graph_max_bs=len(PROMPT_LENS), max_total_tokens=args.max_total_tokens,
                          quantization=args.quantization)
    rt = RuntimeConfig(tp_size=args.tp, all_reduce=args.all_reduce, dist_init_addr=f"127.0.0.1:{free_port()}")
    lines: list[str] = []

    def progress(line: str) -> None:
        lines.append(line)
        print(f"  {line}", flush=True)

    t0 = time.perf_counter()
    client = launch(engine, SchedulerConfig(), rt, progress)
    start_s = time.perf_counter() - t0
    try:
        rnd = random.Random(0)
        prompts = [[rnd.randrange(10000) for _ in range(n)] for n in PROMPT_LENS]
        params = SamplingParams(max_new_tokens=32, ignore_eos=True, logprobs=True, top_logprobs=2)

        async def greedy():
            return await asyncio.gather(*(complete(client, GenerateRequest(input_ids=p, params=params))
                                          for p in prompts))

        runs = asyncio.run(greedy())
        target = EngineTarget(client)
        target.warmup([BenchRequest(prompts[0], 16, True)])
        case = random_case(None, client.info.vocab_size, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=args.output_len, range_ratio=1.0)
        out = target.run(case, 1, lambda: None)
        m = compute_metrics(out.timings, out.duration_s)
    finally:
        client.close()
    return {
        "tp": args.tp, "all_reduce": args.all_reduce, "model": args.model, "quantization": args.quantization,
        "start_s": round(start_s, 1), "ready": [line for line in lines if " ready" in line],
        "tokens": [[t.token_id for t in r.logprobs or []] for r in runs],
        # per position: the chosen token's logprob and the top two logprobs
        "logprobs": [[[t.logprob, *sorted((c.logprob for c in t.top), reverse=True)] for t in r.logprobs or []]
                     for r in runs],
        "completed": m.completed, "failed": m.failed, "median_tpot_ms": m.tpot_ms.median,
        "tok_s": 1000 / m.tpot_ms.median if m.tpot_ms.median else None,
    }


def name(r: dict) -> str:
    quant = f" {r['quantization']}" if r.get("quantization", "none") != "none" else ""
    return f"--tp {r['tp']}" + (f" --all-reduce {r['all_reduce']}" if r["tp"] > 1 else "") + quant


def splits(base: dict, other: dict) -> str:
    """'4/4 identical' or '2/4 identical; split at 23 (TP 1 top-2 gap 0.031), ...'."""
    same, notes = 0, []
    for ids_a, ids_b, lps in zip(base["tokens"], other["tokens"], base["logprobs"]):
        i = next((k for k, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), None)
        if i is None and len(ids_a) == len(ids_b):
            same += 1
            continue
        if i is None:
            notes.append("length differs")
            continue
        gap = lps[i][1] - lps[i][2] if len(lps[i]) > 2 else float("nan")
        notes.append(f"split at {i} ({'near tie' if gap < TIE else 'NOT a tie'}: top-2 gap {gap:.3f})")
    return f"{same}/{len(base['tokens'])} identical" + ("; " + ", ".join(notes) if notes else "")


def report(paths: list[str]) -> int:
    rows = []
    for path in paths:
        try:
            with open(path) as f:
                rows.append(json.load(f))
        except (OSError, ValueError) as exc:
            print(f"{path}: not read ({type(exc).__name__})")
    if not rows:
        return 1
    base = rows[0]
    print(f"{'configuration':<30} {'start s':>8} {'batch-1 tok/s':>14} {'vs first':>9}  greedy tokens vs first")
    for r in rows:
        speed = f"{r['tok_s']:.1f}" if r.get("tok_s") else "-"
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if r.get("tok_s") and base.get("tok_s") else "-"
        print(f"{name(r):<30} {r['start_s']:>8.1f} {speed:>14} {ratio:>9}  "
              f"{'(reference)' if r is base else splits(base, r)}")
    for r in rows:
        for line in r.get("ready", []):
            if "all-reduce" in line and "rank 0" in line:
                print(f"{name(r)}: {line}")
    return 0


def main() -> int:
    from minisgl_cli.distributed import ALL_REDUCES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--all-reduce", default="auto", choices=ALL_REDUCES)
    parser.add_argument("--model", default="llama-3.1-8b", help="a built-in config (dummy weights)")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-total-tokens", type=int, default=16384)
    parser.add_argument("--json", help="write this configuration's result here")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="compare these results (the first: reference)")
    args = parser.parse_args()
    if args.report:
        return report(args.report)
    result = measure(args)
    print(f"{name(result)}: batch-1 {result['tok_s'] or 0:.1f} tok/s (median TPOT {result['median_tpot_ms']:.2f} ms), "
          f"{result['completed']} done, {result['failed']} failed, start {result['start_s']}s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":  # spawn re-imports this file in every child process
    sys.exit(main())
