"""`minisgl bench`: engine vs HF transformers (and llama.cpp), offline or against a running server."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Annotated, Optional

import typer

from commands import common as c

app = typer.Typer()

_HELP = (
    "Benchmark the engine against the HF transformers streaming baseline (same model, device, prompts; greedy "
    "unless --temperature).\n\n"
    "With no flags it runs the reference suite: short / medium / long prompts (16 / 64 / 256 tokens) decoding up to "
    "256 / 512 / 1024 tokens on a GPU, and 32 / 64 / 128 tokens on a CPU so the whole run takes a few minutes; mixed "
    "prompts on, --repeat 3, --warmup 1, --concurrency 4; then it prints the reference stack's summary lines "
    "(Streaming chat summary / Baseline HF streaming chat summary / Comparison).\n\n"
    "Other workloads: --dataset random, --dataset shared-prefix (compare --cache radix --cache naive), "
    "--preset nano-vllm. --url benchmarks any OpenAI-compatible server instead of loading the engine here."
)


@app.command("bench", help=_HELP)
@c.engine_options(c.ALL, exclude={"cache", "engine"})  # bench's --cache and --engine take lists
def bench(
    dataset: Annotated[str, typer.Option(
        "--dataset", help="reference (short/medium/long), random, shared-prefix.")] = "reference",
    preset: Annotated[Optional[str], typer.Option(
        "--preset", help="nano-vllm: 256 requests, in/out lengths uniform in 100..1024, EOS ignored, seed 0 "
                         "(overrides --dataset).")] = None,
    concurrency: Annotated[Optional[list[int]], typer.Option(
        "--concurrency", help="Requests in flight; repeat to sweep (--concurrency 1 --concurrency 4). "
                              "Env BENCH_CONCURRENCY (e.g. '1 4 16'). [default: 4]")] = None,
    repeat: Annotated[Optional[int], typer.Option(
        "--repeat", help="Reference suite: times each prompt is sent. Env BENCH_REPEAT. [default: 3]")] = None,
    warmup: Annotated[Optional[int], typer.Option(
        "--warmup", help="Small untimed requests per stack first. Env BENCH_WARMUP. [default: 1]")] = None,
    mixed_prompts: Annotated[Optional[bool], typer.Option(
        "--mixed-prompts/--no-mixed-prompts", help="Reference suite: random suffix on every other prompt. "
                                                   "Env BENCH_MIXED_PROMPTS=0 turns it off. [default: on]")] = None,
    case: Annotated[Optional[list[str]], typer.Option(
        "--case", help="Reference suite: keep only these cases (repeatable).")] = None,
    num_prompts: Annotated[Optional[int], typer.Option(
        "--num-prompts", help="Requests (random 64, shared-prefix 32, nano-vllm 256); reference: distinct prompts "
                              "per case (default: the largest concurrency).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        "--max-new-tokens", help="Reference: cap every case's decode length; shared-prefix: output length "
                                 "(default 16).")] = None,
    input_len: Annotated[int, typer.Option("--input-len", help="Random: max input tokens.")] = 1024,
    output_len: Annotated[int, typer.Option("--output-len", help="Random: max output tokens.")] = 128,
    range_ratio: Annotated[float, typer.Option(
        "--range-ratio", help="Random: lengths uniform in [len*ratio, len].")] = 1.0,
    prefix_len: Annotated[int, typer.Option("--prefix-len", help="Shared-prefix: system prompt tokens.")] = 400,
    question_len: Annotated[int, typer.Option(
        "--question-len", help="Shared-prefix: tokens of each distinct question.")] = 16,
    seed: Annotated[int, typer.Option("--seed", help="Workload and arrival seed.")] = 0,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="Every request's temperature (0 = greedy; e.g. 0.7 with --top-p 0.9 for a sampled "
                              "run).")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Every request's top-p (1 = off).")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Every request's top-k (-1 = off).")] = -1,
    min_p: Annotated[float, typer.Option("--min-p", help="Every request's min-p (0 = off).")] = 0.0,
    baseline: Annotated[Optional[list[str]], typer.Option(
        "--baseline", help="hf-stream (default) and/or hf-batched; repeatable.")] = None,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip the HF baselines.")] = False,
    peer: Annotated[Optional[list[str]], typer.Option(
        "--peer", help="llama-cpp: llama.cpp on the same GGUF (needs llama-cpp-python).")] = None,
    url: Annotated[Optional[str], typer.Option(
        "--url", help="Online mode: benchmark this OpenAI-compatible server (e.g. http://127.0.0.1:8000) over "
                      "streaming HTTP instead of loading the engine.")] = None,
    api: Annotated[str, typer.Option(
        "--api", help="Online: completions (/v1/completions) or chat (/v1/chat/completions).")] = "completions",
    request_rate: Annotated[float, typer.Option(
        "--request-rate", help="Online: requests/s, Poisson arrivals; inf = all at once.")] = math.inf,
    max_concurrency: Annotated[Optional[int], typer.Option(
        "--max-concurrency", help="Online: requests in flight at most (default: the --concurrency levels).")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="Online: model field to send (default: the server's first /v1/models id).")]
        = None,
    output_json: Annotated[Optional[str], typer.Option(
        "--output-json", help="Write every result (bench_serving names) as JSON.")] = None,
    plot: Annotated[Optional[str], typer.Option(
        "--plot", help="Write a PNG: throughput per engine per case, latency percentiles.")] = None,
    cache: Annotated[Optional[list[str]], typer.Option(
        "--cache", help="Prefix cache: radix or naive; repeat both to compare them in one run. "
                        "[default: radix]")] = None,
    engine: Annotated[Optional[list[str]], c.repeatable(
        "engine", "Repeat to compare engines on one workload in one table (--engine torch --engine hf "
                  "--engine mlx). [default: auto]")] = None,
    *,
    opts: c.EngineOptions,  # every engine option but --cache goes here in --help
    verbose: c.Verbose = False,
) -> None:
    from rich.console import Console

    from minisgl_cli import env
    from minisgl_cli.bench.report import print_report, write_plot
    from minisgl_cli.bench.suite import BenchConfig, run_offline, run_online
    from minisgl_cli.bench.workloads import Sampling

    c.setup_logging(verbose)
    if url and engine:
        c.fail("--engine picks the engine bench loads here; --url benchmarks a running server instead", code=2)
    try:
        cfg = BenchConfig(
            dataset=dataset,
            preset=preset,
            concurrency=concurrency or env.bench_concurrency(),
            repeat=repeat if repeat is not None else env.bench_repeat(),
            warmup=warmup if warmup is not None else env.bench_warmup(),
            mixed_prompts=mixed_prompts if mixed_prompts is not None else env.bench_mixed_prompts(),
            cases=case,
            num_prompts=num_prompts,
            max_new_tokens=max_new_tokens,
            input_len=input_len,
            output_len=output_len,
            range_ratio=range_ratio,
            prefix_len=prefix_len,
            question_len=question_len,
            seed=seed,
            baselines=[] if no_baseline else (baseline or ["hf-stream"]),
            peers=peer or [],
            caches=cache or ["radix"],
            engines=engine or ["auto"],
            url=url,
            api=api,
            request_rate=request_rate,
            max_concurrency=max_concurrency,
            served_model=served_model_name,
            sampling=Sampling(temperature, top_p, top_k, min_p),
        )
    except ValueError as exc:
        c.fail(str(exc))
    console = Console(stderr=True)  # progress and notes; the table and summary lines go to stdout
    out = Console(width=None if sys.stdout.isatty() else 200)  # piped: no 80-column squeeze
    model_arg = opts.engine.model

    try:
        for name in cfg.engines:  # every engine's flags are checked before the first one runs
            opts.with_engine(name).check()
    except ValueError as exc:
        c.fail(str(exc), code=2)

    def make_client(engine_name: str, cache_kind: str | None):
        variant = opts.with_engine(engine_name)
        # The warm-up waits for a background compile of the CPU decode: an in-process engine may compile too.
        variant = replace(variant, engine=replace(variant.engine, compile_in_process=True))
        if cache_kind is not None:
            variant = replace(variant, scheduler=replace(opts.scheduler, cache=cache_kind))
        return variant.client()

    try:
        report = (run_online(cfg, console, model_arg) if url
                  else run_offline(cfg, make_client, console, model_arg, opts.engine.load_format))
    except ValueError as exc:
        c.fail(str(exc))
    print_report(report, out)
    if output_json:
        report.write_json(output_json)
        console.print(f"wrote {output_json}", highlight=False)
    if plot:
        try:
            write_plot(report, plot)
            console.print(f"wrote {plot}", highlight=False)
        except RuntimeError as exc:
            c.fail(str(exc))
    failed = sum(r.metrics.failed for r in report.results)
    raise typer.Exit(1 if failed or not report.results else 0)
