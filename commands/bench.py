"""`minisgl bench`: engine vs HF transformers (and llama.cpp), offline or against a running server."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from commands import common as c

app = typer.Typer()
workload = c.in_panel(c.BENCH_PANEL)
online = c.in_panel(c.ONLINE_PANEL)
scheduler = c.in_panel(c.SCHEDULER_PANEL)
media_panel = c.in_panel("Bench images and videos (--media)")

_HELP = (
    "Benchmark the engine against the HF transformers streaming baseline (same model, device, prompts; greedy "
    "unless --temperature).\n\n"
    "With no flags it runs the reference suite: short / medium / long prompts (16 / 64 / 256 tokens) decoding "
    "256 / 512 / 1024 tokens on a GPU, and 32 / 64 / 128 tokens on a CPU so the whole run takes a few minutes (EOS "
    "ignored: every stack decodes as many); mixed prompts on, --repeat 3 (each run cold: its prompts open with a "
    "word of their own), --warmup 1, --concurrency 4; then it prints the reference stack's summary lines (Streaming "
    "chat summary / Baseline HF streaming chat summary / Comparison), each saying its concurrency (the HF baseline "
    "runs one request at a time), output tokens and prompt tokens served from the prefix cache.\n\n"
    "Other workloads: --dataset random, --dataset shared-prefix (compare --cache radix --cache naive), "
    "--dataset rewrite / code-edit / open-chat (one chat prompt, sent --num-prompts times: compare "
    "--speculative-algorithm ngram), --preset nano-vllm. --url benchmarks any OpenAI-compatible server instead of "
    "loading the engine here.\n\n"
    "--media benchmarks the image (or video) routes instead: seconds per image one at a time, images per minute "
    "under --concurrency, p50 / p99 latency, and plain diffusers on the same pipeline in this process, against --url "
    "or a `minisgl serve` it starts on --media-model-dir."
)


@app.command("bench", cls=c.Command, help=_HELP)
# --runtime auto runs our engine as processes, as `serve` does, on every device: in this process the scheduler's thread
# would share one GIL with the bench's own per-token work, and the figure would be the engine's less what the bench
# took from it (a GPU waits on that thread: issues 29 and 45). --runtime in-process measures the in-process engine.
@c.engine_options(c.ALL, exclude={"cache", "engine"}, processes=True)  # bench's --cache and --engine take lists
def bench(
    dataset: Annotated[str, workload("--dataset",
        help="reference, random, shared-prefix, rewrite, code-edit or open-chat.")] = "reference",
    preset: Annotated[Optional[str], workload("--preset",
        help="nano-vllm: 256 requests, lengths 100..1024 (overrides --dataset).")] = None,
    concurrency: Annotated[Optional[list[int]], workload("--concurrency", metavar="<int>",
        help="Requests in flight; repeat to sweep. Env BENCH_CONCURRENCY.", show_default="4")] = None,
    repeat: Annotated[Optional[int], workload("--repeat",
        help="Reference: times each prompt is sent, each run cold. Env BENCH_REPEAT.", show_default="3")] = None,
    warmup: Annotated[Optional[int], workload("--warmup",
        help="Untimed requests per stack first. Env BENCH_WARMUP.", show_default="1")] = None,
    mixed_prompts: Annotated[Optional[bool], workload("--mixed-prompts/--no-mixed-prompts",
        help="Reference: random suffix on every other prompt. Env BENCH_MIXED_PROMPTS.", show_default="on")] = None,
    case: Annotated[Optional[list[str]], workload(
        "--case", metavar="<str>", help="Reference: keep only these cases (repeatable).")] = None,
    num_prompts: Annotated[Optional[int], workload("--num-prompts",
        help="Requests (random 64, shared-prefix 32, chat prompts 4); reference: prompts per case.")] = None,
    max_new_tokens: Annotated[Optional[int], workload("--max-new-tokens",
        help="Reference: cap on decode lengths; shared-prefix: output length (16); chat prompts: cap (256).")] = None,
    input_len: Annotated[int, workload("--input-len", help="Random: max input tokens.")] = 1024,
    output_len: Annotated[int, workload("--output-len", help="Random: max output tokens.")] = 128,
    range_ratio: Annotated[float, workload("--range-ratio",
        help="Random: lengths uniform in \\[len*ratio, len].")] = 1.0,
    prefix_len: Annotated[int, workload("--prefix-len", help="Shared-prefix: system prompt tokens.")] = 400,
    question_len: Annotated[int, workload("--question-len", help="Shared-prefix: tokens per question.")] = 16,
    seed: Annotated[int, workload("--seed", help="Workload seed.")] = 0,
    temperature: Annotated[float, workload("--temperature",
        help="Every request's temperature (0 = greedy; e.g. 0.7 with --top-p 0.9).")] = 0.0,
    top_p: Annotated[float, workload("--top-p", help="Every request's top-p (1 = off).")] = 1.0,
    top_k: Annotated[int, workload("--top-k", help="Every request's top-k (-1 = off).")] = -1,
    min_p: Annotated[float, workload("--min-p", help="Every request's min-p (0 = off).")] = 0.0,
    baseline: Annotated[Optional[list[str]], workload(
        "--baseline", metavar="<str>", help="hf-stream (default), hf-batched; repeatable.")] = None,
    no_baseline: Annotated[bool, workload("--no-baseline", help="Skip the HF baselines.")] = False,
    peer: Annotated[Optional[list[str]], workload("--peer", metavar="<str>",
        help="llama-cpp: llama.cpp on the same GGUF; repeatable.")] = None,
    output_json: Annotated[Optional[str], workload("--output-json", help="Write every result as JSON.")] = None,
    plot: Annotated[Optional[str], workload("--plot", help="Write a PNG of throughput and latency.")] = None,
    url: Annotated[Optional[str], online("--url",
        help="Benchmark this OpenAI-compatible server instead of an engine here.")] = None,
    api: Annotated[str, online("--api", help="completions or chat.")] = "completions",
    request_rate: Annotated[float, online("--request-rate",
        help="Requests/s, Poisson arrivals; inf = all at once.")] = math.inf,
    max_concurrency: Annotated[Optional[int], online("--max-concurrency",
        help="Requests in flight at most (default: --concurrency).")] = None,
    served_model_name: Annotated[Optional[str], online("--served-model-name",
        help="Model field to send (default: the server's first).")] = None,
    client_procs: Annotated[Optional[int], online("--client-procs",
        help="Client processes the streams are spread over (default: one per 32 in flight, up to the cores).")
    ] = None,
    media: Annotated[bool, media_panel("--media",
        help="Bench /v1/images (or videos) generations, not chat.")] = False,
    media_kind: Annotated[str, media_panel("--media-kind", help="image or video.")] = "image",
    media_model_dir: Annotated[Optional[Path], media_panel("--media-model-dir",
        help="Pipeline dir: the diffusers baseline, and the server started here without --url.")] = None,
    size: Annotated[Optional[str], media_panel("--size",
        help="WIDTHxHEIGHT.", show_default="1024x1024; video 832x480")] = None,
    steps: Annotated[Optional[int], media_panel("--steps",
        help="Denoising steps.", show_default="9; video 30")] = None,
    num_frames: Annotated[int, media_panel("--num-frames", help="Video: frames (4k+1 for Wan).")] = 33,
    cache: Annotated[Optional[list[str]], scheduler("--cache", metavar="<str>",
        help="Prefix cache: radix or naive; repeat both to compare.", show_default="radix")] = None,
    engine: Annotated[Optional[list[str]], c.repeatable("engine", "Repeat to compare engines in one table.")] = None,
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
    media_flags = [name for name, used in (
        ("--media-kind", media_kind != "image"), ("--media-model-dir", media_model_dir is not None),
        ("--size", size is not None), ("--steps", steps is not None), ("--num-frames", num_frames != 33)) if used]
    if media:
        _bench_media(opts, media_kind, media_model_dir, size, steps, num_frames, url, concurrency, num_prompts,
                     warmup, seed, no_baseline, output_json, plot, llm_flags=[
                         *map(c.flag, opts.changed(n for n in c.ALL if n not in ("model", "device"))),
                         *(name for name, used in (
                             ("--dataset", dataset != "reference"), ("--preset", preset), ("--case", case),
                             ("--cache", cache), ("--engine", engine), ("--baseline", baseline), ("--peer", peer),
                             ("--api", api != "completions"), ("--request-rate", request_rate != math.inf),
                             ("--max-concurrency", max_concurrency), ("--served-model-name", served_model_name),
                             ("--client-procs", client_procs)) if used)])
        return
    if media_flags:
        c.fail(f"{', '.join(media_flags)} configure(s) the media bench: add --media", code=2)
    if url:  # the server runs its own engine: only --model (the prompts' tokenizer) means something here
        here = [*(["--engine"] * bool(engine)), *map(c.flag, opts.changed(n for n in c.ALL if n != "model")),
                *(name for name, used in (("--cache", cache), ("--baseline", baseline), ("--no-baseline", no_baseline),
                                          ("--peer", peer)) if used)]
        if here:
            c.fail(f"--url benchmarks a running server: drop {', '.join(here)} (they configure what bench runs "
                   "here)", code=2)
    else:
        online_only = [name for name, used in (
            ("--api", api != "completions"), ("--request-rate", request_rate != math.inf),
            ("--max-concurrency", max_concurrency is not None), ("--served-model-name", served_model_name is not None),
        ) if used]
        if online_only:
            c.fail(f"drop {', '.join(online_only)} or add --url: options of benchmarking a server", code=2)
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
            client_procs=client_procs,
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


def _bench_media(opts: c.EngineOptions, kind: str, model_dir: Optional[Path], size: Optional[str],
                 steps: Optional[int], num_frames: int, url: Optional[str], concurrency: Optional[list[int]],
                 num_prompts: Optional[int], warmup: Optional[int], seed: int, no_baseline: bool,
                 output_json: Optional[str], plot: Optional[str], llm_flags: list[str]) -> None:
    """`bench --media`: the media routes through a server, beside plain diffusers here (minisgl_cli/bench/media.py)."""
    from rich.console import Console

    from minisgl_cli.bench.media import MediaBenchConfig, print_media_report, run_media_bench, write_media_plot
    from minisgl_cli.media.jobs import MediaError

    if llm_flags:
        c.fail(f"--media benchmarks image / video generation: drop {', '.join(llm_flags)} (chat bench options)", code=2)
    if kind not in ("image", "video"):
        c.fail(f"--media-kind must be image or video, got {kind!r}", code=2)
    if url and "model" in opts.changed(["model"]):
        c.fail("--url benchmarks a running server: drop --model (the LLM a server started here would load)", code=2)
    console = Console(stderr=True)
    try:
        cfg = MediaBenchConfig(
            kind="image" if kind == "image" else "video", url=url,
            model_dir=model_dir.expanduser() if model_dir else None,
            size=size or ("1024x1024" if kind == "image" else "832x480"), steps=steps or (9 if kind == "image" else 30),
            num_frames=num_frames, num_prompts=num_prompts or 4, concurrency=concurrency or [4],
            warmup=1 if warmup is None else warmup, seed=seed, baseline=not no_baseline,
            device=opts.engine.device if "device" in opts.changed(["device"]) else None,
            serve_model=opts.engine.model if "model" in opts.changed(["model"]) else None,
        )
        report = run_media_bench(cfg, note=lambda m: console.print(m, highlight=False))
    except MediaError as exc:
        c.fail(exc.message)
    print_media_report(report, Console(width=None if sys.stdout.isatty() else 200))
    if output_json:
        report.write_json(output_json)
        console.print(f"wrote {output_json}", highlight=False)
    if plot:
        if write_media_plot(report, plot):
            console.print(f"wrote {plot}", highlight=False)
        else:
            console.print(f"plot skipped: matplotlib is not installed (pip install matplotlib), {plot} not written",
                          highlight=False)
    failed = sum(r.failed for r in report.runs)
    raise typer.Exit(1 if failed else 0)
