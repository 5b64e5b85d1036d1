"""The bench run: builds the workload, drives each target over cases x concurrency levels, collects results."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from minisgl_cli.bench import workloads as wl
from minisgl_cli.bench.metrics import compute_metrics
from minisgl_cli.bench.report import BenchReport, BenchResult
from minisgl_cli.bench.target import BenchTarget

BUSY_SHARE = 0.7  # a client process above this share of a core may be what limits the run


@dataclass
class BenchConfig:
    """Everything one `minisgl bench` invocation decides; the command only fills it in."""

    dataset: str = "reference"  # reference | random | shared-prefix | a chat prompt (workloads.CHAT_PROMPTS)
    preset: str | None = None  # nano-vllm
    concurrency: list[int] = field(default_factory=lambda: [4])
    repeat: int = 3
    warmup: int = 1
    mixed_prompts: bool = True
    cases: list[str] | None = None  # reference case names to keep
    num_prompts: int | None = None
    max_new_tokens: int | None = None  # reference: caps every case
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 1.0
    prefix_len: int = 400
    question_len: int = 16
    seed: int = 0
    baselines: list[str] = field(default_factory=lambda: ["hf-stream"])
    peers: list[str] = field(default_factory=list)
    caches: list[str] = field(default_factory=lambda: ["radix"])
    engines: list[str] = field(default_factory=lambda: ["auto"])  # --engine, repeated to compare engines
    sampling: wl.Sampling = field(default_factory=wl.Sampling)  # every request's (greedy by default)
    # online
    url: str | None = None
    api: str = "completions"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    served_model: str | None = None
    client_procs: int | None = None  # HTTP client worker processes (None: one per 32 streams, up to the cores)

    def __post_init__(self) -> None:
        if self.dataset not in wl.DATASETS:
            raise ValueError(f"unknown dataset {self.dataset!r}; choose one of {', '.join(wl.DATASETS)}")
        if self.preset is not None and self.preset not in wl.PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(wl.PRESETS)}")
        if not self.concurrency or any(c < 1 for c in self.concurrency):
            raise ValueError("--concurrency must be >= 1")
        if self.repeat < 1 or self.warmup < 0:
            raise ValueError("--repeat must be >= 1 and --warmup >= 0")
        if not self.caches:
            raise ValueError("--cache needs at least one prefix cache kind")
        if not self.engines:
            raise ValueError("--engine needs at least one engine")
        if self.client_procs is not None and (self.url is None or self.client_procs < 1):
            raise ValueError("--client-procs spreads --url's streams over processes (>= 1); without --url the "
                             "engine's client runs in this process")

    def variants(self) -> list[tuple[str, str | None, str]]:
        """(engine, prefix cache, result name) of each engine run: a serial engine (hf, mlx) once, ours per cache;
        one run is plain "minisgl", several are told apart in brackets."""
        from minisgl_cli.backends import SERIAL, resolve

        engines = list(dict.fromkeys(resolve(e) for e in self.engines))
        runs: list[tuple[str, str | None]] = [
            (e, None) if e in SERIAL else (e, c) for e in engines for c in ([None] if e in SERIAL else self.caches)]
        runs = list(dict.fromkeys(runs))

        def name(engine: str, cache: str | None) -> str:
            if len(runs) == 1:
                return "minisgl"
            parts = [engine] * (len(engines) > 1) + [cache] * (cache is not None and len(self.caches) > 1)
            return f"minisgl[{'/'.join(p for p in parts if p)}]"

        return [(e, c, name(e, c)) for e, c in runs]


def build_levels(
    cfg: BenchConfig, tokenizer: Any, vocab_size: int, on_gpu: bool, levels: list[int]
) -> list[list[wl.Case]]:
    """The cases for each concurrency level, each level's prompts its own (the reference suite's runs open with words
    of their own, the other workloads draw with seed + level index), so a level does not hit the prefix cache filled
    by the level before it; the sequential baselines run the first level's."""
    return [build_cases(cfg, tokenizer, vocab_size, on_gpu, level=i) for i in range(len(levels))]


def build_cases(cfg: BenchConfig, tokenizer: Any, vocab_size: int, on_gpu: bool, level: int = 0) -> list[wl.Case]:
    cases = _workload(cfg, tokenizer, vocab_size, on_gpu, level)
    for case in cases:
        for req in case.requests:
            req.sampling = cfg.sampling
    return cases


def _workload(cfg: BenchConfig, tokenizer: Any, vocab_size: int, on_gpu: bool, level: int) -> list[wl.Case]:
    seed = cfg.seed + level
    if cfg.preset == "nano-vllm":
        return [wl.nano_vllm_case(vocab_size, cfg.num_prompts or 256, seed)]
    if cfg.dataset == "random":
        return [wl.random_case(tokenizer, vocab_size, num_prompts=cfg.num_prompts or 64, input_len=cfg.input_len,
                               output_len=cfg.output_len, range_ratio=cfg.range_ratio, seed=seed)]
    if cfg.dataset == "shared-prefix":
        return [
            wl.shared_prefix_case(
                tokenizer,
                vocab_size,
                num_prompts=cfg.num_prompts or 32,
                prefix_len=cfg.prefix_len,
                question_len=cfg.question_len,
                output_len=cfg.max_new_tokens or 16,
                seed=seed,
            )
        ]
    if cfg.dataset in wl.CHAT_PROMPTS:
        return [wl.chat_case(tokenizer, cfg.dataset, num_prompts=cfg.num_prompts or 4,
                             max_new_tokens=cfg.max_new_tokens or wl.CHAT_NEW_TOKENS)]
    # The reference suite sends num_prompts x repeat requests per case; every level the same shape, cold.
    return wl.reference_cases(tokenizer, vocab_size, num_prompts=cfg.num_prompts or max(cfg.concurrency),
                              repeat=cfg.repeat, mixed_prompts=cfg.mixed_prompts, on_gpu=on_gpu,
                              max_new_tokens=cfg.max_new_tokens, names=cfg.cases, seed=cfg.seed, level=level)


class Bench:
    """Runs targets one after another (never two stacks on the device at once) and keeps the results."""

    def __init__(self, cfg: BenchConfig, report: BenchReport, console: Console):
        self.cfg = cfg
        self.report = report
        self.console = console

    def note(self, text: str) -> None:
        self.report.notes.append(text)
        self.console.print(f"[yellow]note:[/] {escape(text)}", highlight=False)

    def run(self, target: BenchTarget, cases: list[list[wl.Case]], levels: list[int], vocab_size: int) -> None:
        """cases[i] are the cases of levels[i]; a sequential target runs the first level's, once, at c=1."""
        if self.cfg.warmup:
            with self.console.status(f"warming up {target.name} ({self.cfg.warmup} request(s); an engine that "
                                     "compiles its CPU decode first finishes that)"):
                target.warmup(wl.warmup_requests(vocab_size, self.cfg.warmup))
        if target.sequential:
            plan = [(case, 1) for case in cases[0]]
        else:
            plan = [(case, c) for level_cases, c in zip(cases, levels) for case in level_cases]
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=self.console, transient=False) as progress:
            for case, c in plan:
                if case.prime:
                    target.warmup(case.prime)
                task = progress.add_task(escape(f"{target.name} {case.name} c={c}"), total=len(case.requests))
                started = time.time()
                out = target.run(case, c, functools.partial(progress.advance, task))
                metrics = compute_metrics(out.timings, out.duration_s)
                self.report.results.append(BenchResult(target.name, case.name, c, len(case.requests), metrics,
                                                       case.params, out.client_cpu, out.started_at or started))
                busy = [i for i, u in enumerate(out.client_cpu) if u.core_share > BUSY_SHARE]
                if busy:
                    worst = max(u.core_share for u in out.client_cpu)
                    self.note(f"{target.name} {case.name} c={c}: {len(busy)} of {len(out.client_cpu)} client "
                              f"process(es) above {BUSY_SHARE:.0%} of a core (max {worst:.0%}): the client may be "
                              "what limits this figure; raise --client-procs")
                errors = {t.error or "no error message" for t in out.timings if not t.success}
                if errors:
                    self.note(
                        f"{target.name} {case.name} c={c}: {metrics.failed} request(s) failed: {sorted(errors)[0]}"
                    )


def _meta(cfg: BenchConfig, **extra: Any) -> dict[str, Any]:
    config = dataclasses.asdict(cfg)
    config["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate  # JSON has no inf
    return {"created": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "python": platform.python_version(), "config": config, **extra}


def run_offline(cfg: BenchConfig, make_client: Callable[[str, str | None], Any], console: Console,
                model_arg: str | None, load_format: str) -> BenchReport:
    """Each engine (ours once per --cache) then baselines and peers, in that order, each alone on the device."""
    import torch

    from minisgl_cli.bench.offline import EngineTarget
    from minisgl_cli.runtime.pool import EnginePool
    from minisgl_cli.runtime.remote import RemoteClient
    from minisgl_cli.tokenizer import Tokenizer

    report: BenchReport | None = None
    cases: list[list[wl.Case]] = []
    model_dir = None
    device = dtype = None
    vocab_size = 0
    for engine, cache, name in cfg.variants():
        client = make_client(engine, cache)
        info = client.info
        if report is None:
            import minisgl_cli

            vocab_size = info.vocab_size
            tokenizer = Tokenizer(info.model_dir).hf if info.has_tokenizer else None
            # The HF baselines run with torch: on the engine's device, or the CPU where mlx ran; dense in the
            # engine's dtype, or beside int4 / int8 weights on the CPU in fp32 (HF's default there: our exact mode's).
            device = "cpu" if info.device.startswith("mlx") else info.device
            dense = info.quantization == "none" or device != "cpu"
            dtype = getattr(torch, info.dtype) if dense else torch.float32
            cases = build_levels(cfg, tokenizer, vocab_size, device.startswith("cuda"), cfg.concurrency)
            model_dir = info.model_dir
            report = BenchReport(_meta(cfg, mode="offline", model=info.name, device=info.device, dtype=info.dtype,
                                       quantization=info.quantization, kv_cache_dtype=info.kv_cache_dtype,
                                       attention_backend=info.attention_backend, torch=torch.__version__,
                                       minisgl=getattr(minisgl_cli, "__version__", "0.1.0")))
            bench = Bench(cfg, report, console)
            console.print(f"model={info.name} device={info.device} dtype={info.dtype} quantization={info.quantization} "
                          f"kv_cache_dtype={info.kv_cache_dtype} backend={info.attention_backend} "
                          f"sampling={cfg.sampling.label} "
                          f"cases={', '.join(f'{c.name}({len(c.requests)} req)' for c in cases[0])} "
                          f"concurrency={cfg.concurrency}", highlight=False)
        if len(cfg.engines) > 1:
            console.print(escape(f"{name}: engine {info.engine} on {info.device} {info.dtype}, attention "
                                 f"{info.attention_backend}"), highlight=False)
        target = EngineTarget(client, name, remote=isinstance(client, (RemoteClient, EnginePool)))
        try:
            bench.run(target, cases, cfg.concurrency, vocab_size)
        finally:
            target.close()
            del client, target
            _free(device)

    assert report is not None  # BenchConfig requires at least one engine and one cache kind
    _run_baselines(cfg, bench, cases, model_dir, device, dtype, vocab_size, load_format)
    _run_peers(cfg, bench, cases, model_arg, device, vocab_size)
    return report


def _free(device: str | None) -> None:
    import gc

    import torch

    gc.collect()
    if device and device.startswith("cuda"):
        torch.cuda.empty_cache()


def _run_baselines(cfg: BenchConfig, bench: Bench, cases: list[list[wl.Case]], model_dir: Any, device: Any, dtype: Any,
                   vocab_size: int, load_format: str) -> None:
    from transformers.utils import logging as hf_logging

    from minisgl_cli.bench.baselines import BASELINES, HFBatchedTarget, HFStreamTarget

    hf_logging.disable_progress_bar()  # its "Loading weights" bar would tear through ours

    for name in cfg.baselines:
        if name not in BASELINES:
            raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
        if model_dir is None or load_format == "dummy":
            bench.note(f"{name} baseline skipped: dummy weights have no HF checkpoint to load")
            continue
        cls = HFStreamTarget if name == "hf-stream" else HFBatchedTarget
        with bench.console.status(f"loading HF transformers model for {name}"):
            target = cls(model_dir, device, dtype)
        try:
            bench.run(target, cases, cfg.concurrency, vocab_size)
        finally:
            target.close()
            del target
            _free(device)


def _run_peers(cfg: BenchConfig, bench: Bench, cases: list[list[wl.Case]], model_arg: str | None, device: Any,
               vocab_size: int) -> None:
    from minisgl_cli.bench.baselines import PEERS, LlamaCppTarget, llama_cpp_available

    for name in cfg.peers:
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}; choose from {', '.join(PEERS)}")
        if not llama_cpp_available():
            bench.note("llama.cpp peer skipped: llama-cpp-python is not installed (pip install 'minisgl[llama-cpp]')")
            continue
        gguf = _gguf_for(model_arg)
        if gguf is None:
            bench.note("llama.cpp peer skipped: it needs a GGUF model (the default model or --model FILE.gguf)")
            continue
        need = max(r.prompt_tokens + r.max_new_tokens for lv in cases for c in lv for r in c.requests) + 16
        target = LlamaCppTarget(gguf, on_gpu=str(device).startswith("cuda"), n_ctx=max(2048, need))
        try:
            bench.run(target, cases, cfg.concurrency, vocab_size)
        finally:
            target.close()


def _gguf_for(model_arg: str | None):
    from pathlib import Path

    from minisgl_cli.loader.resolve import DEFAULT_ALIASES, default_gguf_path

    if model_arg is None or model_arg.strip().lower() in DEFAULT_ALIASES:
        return default_gguf_path()
    p = Path(model_arg).expanduser()
    return p if p.is_file() and p.suffix.lower() == ".gguf" else None


def run_online(cfg: BenchConfig, console: Console, model_arg: str | None) -> BenchReport:
    """Benchmark a running OpenAI-compatible server; the tokenizer (for prompts) comes from --model."""
    from minisgl_cli.bench.online import HttpTarget

    if cfg.url is None:
        raise ValueError("online mode needs --url")
    tokenizer, vocab_size = _local_tokenizer(model_arg, console)
    target = HttpTarget(cfg.url, api=cfg.api, model=cfg.served_model, request_rate=cfg.request_rate,
                          tokenizer=tokenizer, seed=cfg.seed, client_procs=cfg.client_procs)
    levels = [cfg.max_concurrency] if cfg.max_concurrency else cfg.concurrency
    import torch

    # The server's device is unknown: size the reference cases by this machine's (a local server's).
    cases = build_levels(dataclasses.replace(cfg, concurrency=levels), tokenizer, vocab_size,
                         torch.cuda.is_available(), levels)
    report = BenchReport(_meta(cfg, mode="online", model=target.model, device=cfg.url))
    console.print(f"server={cfg.url} model={target.model} api={cfg.api} request_rate={cfg.request_rate} "
                  f"max_concurrency={levels} client_procs={[target.procs_for(c) for c in levels]} "
                  f"cases={', '.join(f'{c.name}({len(c.requests)} req)' for c in cases[0])}",
                  highlight=False)
    Bench(cfg, report, console).run(target, cases, levels, vocab_size)
    return report


def _local_tokenizer(model_arg: str | None, console: Console) -> tuple[Any, int]:
    """The model's tokenizer when it resolves locally (exact prompt lengths); else none and a fixed vocab."""
    try:
        from transformers import AutoTokenizer

        from minisgl_cli.loader import resolve_model

        tok = AutoTokenizer.from_pretrained(str(resolve_model(model_arg).path))
        return tok, len(tok)
    except Exception as exc:
        console.print(f"[yellow]note:[/] no local tokenizer for {escape(model_arg or 'the default model')} "
                      f"({type(exc).__name__}); sending token ids and counting chunks", highlight=False)
        return None, 10_000
