"""`minisgl bench --media`: seconds per image (or video) one at a time and images per minute under concurrency
through a server's media routes, beside plain diffusers on the same pipeline in this process; JSON and a plot.

A run sends `num_prompts` requests at each concurrency level (level 1: one at a time), each with its own seed,
and times each from send to the whole decoded answer, after `warmup` untimed rounds at that level (a compiled DiT
compiles again for a new batch size: that is start-up, not a warm figure). The diffusers baseline runs the same
jobs one at a time through `DiffusionPipeline.__call__` (no server, no PNG / mp4 encode), after the same warm-up:
the figure our serving path is measured against. The cold start is timed apart from the warm runs, for both
stacks: start (a server this run starts, to /health 200; the pipeline's load here) and the first request.
The server is the one at `url`, or a `minisgl serve` this run starts on the pipeline dir.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl_cli.bench.metrics import percentile
from minisgl_cli.media.jobs import ImageJob, Kind, MediaError, VideoJob, job_defaults, parse_size

PROMPTS = [
    "a red lantern over a misty harbour at dawn",
    "a paper boat drifting down a rain-soaked street",
    "a snow fox curled in a birch forest, soft light",
    "a lighthouse on a cliff under a starry sky",
]


@dataclass
class MediaBenchConfig:
    kind: Kind = "image"
    url: str | None = None  # None: start `minisgl serve` on model_dir
    model_dir: Path | None = None  # the local pipeline dir: the diffusers baseline, and the server this run starts
    size: str = "1024x1024"
    steps: int = 9
    num_frames: int = 33  # video only
    num_prompts: int = 4  # requests per concurrency level
    concurrency: list[int] = field(default_factory=lambda: [1, 4])
    warmup: int = 1  # untimed rounds at each level first (the server loads the pipeline on its first request)
    seed: int = 0
    baseline: bool = True  # plain diffusers in this process
    device: str | None = None
    serve_model: str | None = None  # the LLM the started server loads (serve always serves chat too)
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        self.job(0)  # every job field checked before any server starts
        if self.num_prompts < 1 or self.warmup < 0 or any(c < 1 for c in self.concurrency):
            raise MediaError("--num-prompts and --concurrency must be >= 1, --warmup >= 0")
        if self.url is None and self.model_dir is None:
            raise MediaError("bench --media needs --url (a running server) or --media-model-dir (a pipeline dir to "
                             "serve here)")
        if self.model_dir is not None and not (self.model_dir / "model_index.json").is_file():
            raise MediaError(f"--media-model-dir {self.model_dir} has no model_index.json (not a diffusers pipeline)")

    def job(self, i: int) -> ImageJob | VideoJob:
        width, height = parse_size(self.size)
        prompt, seed = PROMPTS[i % len(PROMPTS)], self.seed + i
        if self.kind == "image":
            return ImageJob(prompt, width, height, self.steps, job_defaults(ImageJob)["guidance_scale"], 1, seed)
        cfg = job_defaults(VideoJob)["guidance_scale"]
        return VideoJob(prompt, width, height, self.num_frames, 16, self.steps, cfg, seed)

    @property
    def unit(self) -> str:
        return self.kind  # "image" / "video": what a request makes


@dataclass
class MediaRun:
    """One stack at one concurrency: each request's latency (successes only), failures, the wall time of the run;
    apart from them, the untimed warm-up's latencies (None: failed) and the stack's start where this run started it."""

    stack: str
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    latencies_s: list[float]
    errors: list[str] = field(default_factory=list)
    warmup_s: list[float | None] = field(default_factory=list)
    start_s: float | None = None

    def summary(self) -> dict[str, Any]:
        ok = self.latencies_s
        return {
            "stack": self.stack,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "s_per_item": sum(ok) / len(ok) if ok else None,
            "items_per_min": 60.0 * len(ok) / self.duration_s if self.duration_s > 0 else None,
            "p50_s": percentile(ok, 50) if ok else None,
            "p99_s": percentile(ok, 99) if ok else None,
            "latencies_s": ok,
            "errors": self.errors[:3],
            "warmup_s": self.warmup_s,
            "start_s": self.start_s,
        }


# --- through a server ------------------------------------------------------------------------------------------


def _request(cfg: MediaBenchConfig, i: int) -> tuple[str, dict[str, Any]]:
    job = cfg.job(i)
    body: dict[str, Any] = {"prompt": job.prompt, "size": cfg.size, "steps": job.steps, "seed": job.seed}
    if isinstance(job, ImageJob):
        return "/v1/images/generations", {**body, "n": 1, "response_format": "b64_json"}
    return "/v1/videos/generations", {**body, "num_frames": job.num_frames, "fps": job.fps}


def _send(client: Any, cfg: MediaBenchConfig, i: int) -> tuple[float | None, str | None]:
    """(seconds to the whole decoded answer, None) or (None, why it failed)."""
    path, body = _request(cfg, i)
    start = time.perf_counter()
    try:
        r = client.post(path, json=body)
        if r.status_code != 200:
            return None, f"HTTP {r.status_code}: {r.text[:200]}"
        data = r.json()["data"]
        if not data or not base64.b64decode(data[0]["b64_json"]):
            return None, "an empty answer"
    except Exception as exc:  # a dropped connection or a bad body: counted as failed, the run goes on
        return None, f"{type(exc).__name__}: {exc}"
    return time.perf_counter() - start, None


def run_server(cfg: MediaBenchConfig, url: str, concurrency: int, first: int) -> MediaRun:
    import httpx

    with httpx.Client(base_url=url.rstrip("/"), timeout=cfg.timeout_s) as client:
        with ThreadPoolExecutor(concurrency) as pool:
            warm = list(pool.map(lambda i: _send(client, cfg, 10_000 + first + i), range(cfg.warmup * concurrency)))
            start = time.perf_counter()
            results = list(pool.map(lambda i: _send(client, cfg, first + i), range(cfg.num_prompts)))
            duration = time.perf_counter() - start
    ok = [t for t, _ in results if t is not None]
    errors = [e for _, e in results if e is not None] + [f"warm-up: {e}" for _, e in warm if e is not None]
    return MediaRun("minisgl serve", concurrency, cfg.num_prompts, cfg.num_prompts - len(ok), duration, ok, errors,
                    warmup_s=[t for t, _ in warm])


class StartedServer:
    """`minisgl serve` on the pipeline dir, on a free port, for the run's length (stderr kept for the error)."""

    def __init__(self, cfg: MediaBenchConfig) -> None:
        from minisgl_cli.api.http_server import free_port

        assert cfg.model_dir is not None
        self.url = f"http://127.0.0.1:{free_port()}"
        flag = "--image-model-dir" if cfg.kind == "image" else "--video-model-dir"
        args = ["serve", flag, str(cfg.model_dir), "--port", self.url.rsplit(":", 1)[1]]
        args += ["--model", cfg.serve_model] if cfg.serve_model else []
        args += ["--device", cfg.device] if cfg.device else []
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "minisgl_cli.app", *args], stdout=subprocess.DEVNULL,
                                     stderr=self.err, env=os.environ.copy())

    def wait_healthy(self, timeout_s: float = 900) -> None:
        from minisgl_cli.api.http_server import wait_healthy

        try:
            wait_healthy(self.url, self.proc, timeout_s)
        except RuntimeError as exc:
            self.err.seek(0)
            tail = self.err.read().strip().splitlines()[-1:] or ["no output"]
            raise MediaError(f"the server this bench started {exc}: {tail[0]}") from None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


# --- plain diffusers, in this process --------------------------------------------------------------------------


def run_diffusers(cfg: MediaBenchConfig) -> MediaRun:
    """The same jobs through a DiffusionPipeline loaded here as its docs show, one at a time."""
    import warnings

    import torch
    from diffusers import DiffusionPipeline

    from minisgl_cli.device import pick_device, pick_dtype
    from minisgl_cli.media.console import quiet_libraries

    assert cfg.model_dir is not None
    quiet_libraries()  # no loading bars between the bench's own lines
    device = pick_device(cfg.device)
    loading = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        pipe = DiffusionPipeline.from_pretrained(str(cfg.model_dir), torch_dtype=pick_dtype(device)).to(device)
    pipe.set_progress_bar_config(disable=True)
    load_s = time.perf_counter() - loading

    def call(i: int) -> float:
        start = time.perf_counter()
        job = cfg.job(i)
        assert job.seed is not None
        kwargs: dict[str, Any] = dict(prompt=job.prompt, height=job.height, width=job.width,
                                      num_inference_steps=job.steps, guidance_scale=job.guidance_scale,
                                      generator=torch.Generator("cpu").manual_seed(job.seed))
        if isinstance(job, VideoJob):
            kwargs.update(num_frames=job.num_frames, output_type="np")
        with torch.inference_mode():
            pipe(**kwargs)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    warm: list[float | None] = [call(10_000 + i) for i in range(cfg.warmup)]
    start = time.perf_counter()
    latencies = [call(i) for i in range(cfg.num_prompts)]
    return MediaRun("diffusers", 1, cfg.num_prompts, 0, time.perf_counter() - start, latencies, warmup_s=warm,
                    start_s=load_s)


# --- the run, its table, JSON and plot --------------------------------------------------------------------------


@dataclass
class MediaReport:
    config: dict[str, Any]
    runs: list[MediaRun]

    def to_json(self) -> dict[str, Any]:
        runs = [r.summary() for r in self.runs]
        ours = next((r for r in runs if r["stack"] != "diffusers" and r["concurrency"] == 1), None)
        plain = next((r for r in runs if r["stack"] == "diffusers"), None)
        ratio = (plain["s_per_item"] / ours["s_per_item"]
                 if ours and plain and ours["s_per_item"] and plain["s_per_item"] else None)
        return {"mode": "media", **self.config, "runs": runs, "speedup_vs_diffusers": ratio, "cold": self.cold()}

    def cold(self) -> dict[str, dict[str, float | None]]:
        """Each stack's start and first request (its first warm-up one, which pays the load / compile): None where
        this run did not start it or ran no warm-up."""
        first: dict[str, MediaRun] = {}
        for r in self.runs:
            first.setdefault(r.stack, r)
        return {stack: {"start_s": r.start_s, "first_request_s": r.warmup_s[0] if r.warmup_s else None}
                for stack, r in first.items()}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def run_media_bench(cfg: MediaBenchConfig, note: Any = print) -> MediaReport:
    config = {"kind": cfg.kind, "url": cfg.url, "model_dir": str(cfg.model_dir) if cfg.model_dir else None,
              "size": cfg.size, "steps": cfg.steps, "num_prompts": cfg.num_prompts, "concurrency": cfg.concurrency,
              "warmup": cfg.warmup, "seed": cfg.seed, **({"num_frames": cfg.num_frames} if cfg.kind == "video" else {})}
    runs: list[MediaRun] = []
    started, start_s = None, None
    try:
        url = cfg.url
        if url is None:
            note(f"starting minisgl serve on {cfg.model_dir}...")
            t = time.perf_counter()
            started = StartedServer(cfg)
            started.wait_healthy()
            start_s, url = time.perf_counter() - t, started.url
            config["url"] = url
        for n, c in enumerate(dict.fromkeys([1, *cfg.concurrency])):  # one at a time first: s per image
            note(f"minisgl serve, concurrency {c}: {cfg.num_prompts} {cfg.unit} requests...")
            runs.append(run_server(cfg, url, c, n * cfg.num_prompts))
        runs[0].start_s = start_s
    finally:
        if started is not None:
            started.stop()
    if cfg.baseline and cfg.model_dir is not None:
        note(f"plain diffusers in this process: {cfg.num_prompts} {cfg.unit}s one at a time...")
        runs.append(run_diffusers(cfg))
    elif cfg.baseline:
        note("diffusers baseline skipped: give --media-model-dir (the server's pipeline dir, here) to run it")
    return MediaReport(config, runs)


def print_media_report(report: MediaReport, out: Any) -> None:
    from rich.table import Table

    data = report.to_json()
    unit = data["kind"]
    table = Table(title=f"{unit}s {data['size']}, {data['steps']} steps"
                  + (f", {data['num_frames']} frames" if unit == "video" else ""))
    for col in ("stack", "conc", f"s/{unit}", f"{unit}s/min", "p50 s", "p99 s", "failed"):
        table.add_column(col, justify="left" if col == "stack" else "right")
    fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    for r in data["runs"]:
        table.add_row(r["stack"], str(r["concurrency"]), fmt(r["s_per_item"]), fmt(r["items_per_min"], ".1f"),
                      fmt(r["p50_s"]), fmt(r["p99_s"]), str(r["failed"]))
    out.print(table)
    if data["speedup_vs_diffusers"]:
        ours, plain = (next(r for r in data["runs"] if r["stack"] == s) for s in ("minisgl serve", "diffusers"))
        out.print(f"one at a time: {ours['s_per_item']:.2f} s/{unit} through minisgl serve (end to end, encode "
                  f"included) vs {plain['s_per_item']:.2f} s for plain diffusers' pipeline call: "
                  f"{data['speedup_vs_diffusers']:.2f}x its speed", highlight=False)
    for stack, cold in data["cold"].items():
        parts = [f"{what} {cold[key]:.2f} s" for what, key in (
            ("start" if stack == "diffusers" else "start to /health", "start_s"),
            ("first request", "first_request_s")) if cold[key] is not None]
        if parts:
            out.print(f"cold, {stack}: {', '.join(parts)} (apart from the warm figures above)", highlight=False)


def write_media_plot(report: MediaReport, path: str | Path) -> bool:
    """Two panels: items per minute and latency (p50 bar, p99 tick) per stack and concurrency.
    False (nothing written) where matplotlib is not installed: it is an optional extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    data = report.to_json()
    runs = data["runs"]
    labels = [f"{r['stack']}\nc={r['concurrency']}" for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(runs) * 2), 4))
    xs = range(len(runs))
    a.bar(xs, [r["items_per_min"] or 0 for r in runs], color="tab:blue")
    a.set_title(f"{data['kind']}s per minute")
    b.bar(xs, [r["p50_s"] or 0 for r in runs], color="tab:orange")
    b.scatter(xs, [r["p99_s"] or 0 for r in runs], marker="_", s=400, color="black")
    b.set_title("latency s (bar p50, tick p99)")
    for ax in (a, b):
        ax.set_xticks(list(xs), labels, fontsize=8)
    fig.suptitle(f"minisgl bench --media: {data['size']}, {data['steps']} steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
