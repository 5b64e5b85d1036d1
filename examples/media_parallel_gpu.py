"""One video over two GPUs (`--media-parallel cfg` and `ulysses`) against one GPU, in one process, on Wan2.1-T2V-1.3B
built from its built-in config with random weights (media/configs.py, the same seeded weights on every rank).

For each variant: one call to load and warm up, then `--runs` warm calls timed end to end (text encoder, the denoise
steps, the VAE decode on rank 0) at 832x480, 81 frames, CFG 5, `--steps` steps (10 by default), extrapolated to 50
steps from the mean step time ("s@50", as examples/media_bench.py does). The frames of each two-GPU variant are
compared with the one-GPU frames of the same seed and prompt: PSNR in dB over the 8-bit frames (inf: identical).
Eager (no torch.compile) unless `--compile`; attention: auto (cuDNN on Hopper). Each variant runs in a process of its
own (as a server runs one group a process). A table on stdout, JSON under --out.

    python examples/media_parallel_gpu.py --out $OUT                   # 2 GPUs: one, cfg, ulysses (~3-4 min)
    python examples/media_parallel_gpu.py --tiny --device cpu          # the tiny Wan over 2 gloo ranks (CPU smoke)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass
class Row:
    variant: str
    gpus: int
    load_s: float = math.nan  # start the ranks, build the pipeline on each, join
    first_s: float = math.nan
    warm_s: float = math.nan  # one video, end to end
    step_s: float = math.nan  # one denoise step (CFG: both passes)
    at_50_s: float = math.nan
    speedup_50: float = math.nan  # one GPU's s@50 over this one's
    psnr_db: float = math.nan  # against the one-GPU frames
    note: str = ""


def psnr(a: Any, b: Any) -> float:
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def run_variant(variant: str, a: argparse.Namespace, sync: Any) -> tuple[Row, Any]:
    import torch

    from minisgl_cli.media import batch, ranks
    from minisgl_cli.media.jobs import MediaError, ModelSpec, VideoJob
    from minisgl_cli.media.pipelines import unload_all

    mode = None if variant == "one" else variant
    row = Row(variant, 1 if mode is None else a.size)
    spec = ModelSpec.create("video", a.model, None, device=a.device, load_format="dummy", compile=a.compile,
                            media_parallel=mode, media_parallel_size=a.size)
    marks: list[float] = []

    def on_step(done: int, total: int, latents: Any) -> None:
        sync()
        marks.append(time.perf_counter())

    def video(i: int) -> tuple[float, Any]:
        job = VideoJob(f"a bench prompt number {i}, a lantern festival over a river at night", a.width, a.height,
                       a.frames, 16, a.steps, a.guidance, seed=a.seed)
        marks.clear()
        sync()
        t = time.perf_counter()
        frames = np.stack(batch.generate(loaded, [job], on_step)[0].frames)
        sync()
        return time.perf_counter() - t, frames

    frames = None
    try:
        t = time.perf_counter()
        loaded = ranks.load(spec)
        row.load_s = time.perf_counter() - t
        row.first_s, frames = video(0)  # the frames compared: the same prompt and seed in every variant
        warm, steps = [], []
        for i in range(a.runs):
            s, _ = video(i + 1)
            warm.append(s)
            steps.append((marks[-1] - marks[0]) / (len(marks) - 1))
        row.warm_s, row.step_s = statistics.median(warm), statistics.median(steps)
        row.at_50_s = row.warm_s + (50 - a.steps) * row.step_s
    except MediaError as exc:
        row.note = f"refused: {exc.message}"
    except Exception as exc:  # noqa: BLE001 - e.g. a collective that timed out: this variant's row says so
        row.note = f"failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    finally:
        ranks.close()
        unload_all()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row, frames


def table(rows: list[Row], a: argparse.Namespace) -> str:
    lines = [f"Wan {a.model} {a.width}x{a.height}x{a.frames}, CFG {a.guidance}, {a.steps} steps timed "
             f"(s@50 extrapolated), {'compiled' if a.compile else 'eager'}",
             "| variant | GPUs | load s | first s | warm s | step s | s@50 | speed-up @50 | PSNR dB vs one | note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.variant} | {r.gpus} | {r.load_s:.1f} | {r.first_s:.2f} | {r.warm_s:.2f} | {r.step_s:.3f} "
                     f"| {r.at_50_s:.1f} | {r.speedup_50:.2f}x | {r.psnr_db:.1f} | {r.note} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny Wan at 64x64x5, 3 steps (a CPU smoke run)")
    ap.add_argument("--device", default=None, help="rank 0's device (auto: cuda, else cpu); rank r takes the next")
    ap.add_argument("--variants", default="one,cfg,ulysses")
    ap.add_argument("--size", type=int, default=2, help="ranks of the two-GPU variants")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=1, help="warm calls a variant (median)")
    ap.add_argument("--width", type=int, default=832)
    ap.add_argument("--height", type=int, default=480)
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--guidance", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--compile", action="store_true", help="regional compile of the DiT's blocks (default: eager)")
    ap.add_argument("--collective-timeout", type=float, default=120.0,
                    help="seconds any collective may wait (a hung rank fails the variant, not the whole budget)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/media_parallel"))
    ap.add_argument("--variant-timeout", type=float, default=600.0, help="seconds a variant's process may take")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # run this variant here (the loop runs each in a child)
    a = ap.parse_args()
    a.model = "wan2.1-t2v-1.3b"
    if a.tiny:
        a.model, a.width, a.height, a.frames, a.steps = "tiny-wan", 64, 64, 5, min(a.steps, 3)
    import datetime

    import torch

    from minisgl_cli.device import pick_device
    from minisgl_cli.media import ranks
    from minisgl_cli.media.console import quiet_libraries

    quiet_libraries()
    ranks.TIMEOUT = datetime.timedelta(seconds=a.collective_timeout)
    a.device = pick_device(a.device)
    cuda = a.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // a.size))
    sync: Any = torch.cuda.synchronize if cuda else (lambda: None)
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    reference = None
    if a.one:  # a child of the loop below: one variant, its row and frames to files
        row, frames = run_variant(a.one, a, sync)
        (a.out / f"{a.one}.row.json").write_text(json.dumps(asdict(row)))
        if frames is not None:
            np.save(a.out / f"{a.one}.frames.npy", frames)
        return
    for variant in a.variants.split(","):
        row, frames = variant_in_child(variant, a)
        if variant == "one":
            reference = frames
        if reference is not None and frames is not None:
            row.psnr_db = psnr(frames, reference)
        one = next((r for r in rows if r.variant == "one"), None)
        if one is not None:
            row.speedup_50 = one.at_50_s / row.at_50_s
        elif variant == "one":
            row.speedup_50 = 1.0
        rows.append(row)
        save(rows, a, torch)  # after each variant: a process torn down later keeps what was measured
        print(f"{variant}: load {row.load_s:.1f} s, first {row.first_s:.2f} s, warm {row.warm_s:.2f} s, step "
              f"{row.step_s:.3f} s, s@50 {row.at_50_s:.1f}, PSNR {row.psnr_db:.1f} dB {row.note}", flush=True)
    print(table(rows, a))


def variant_in_child(variant: str, a: argparse.Namespace) -> tuple[Row, Any]:
    """One variant in a process of its own: a torn-down NCCL group leaves state behind it (a Ulysses group started
    after a CFG group's close crashed in NCCL's split on two H200s), and a user's server starts one group a process."""
    import subprocess

    for f in (a.out / f"{variant}.row.json", a.out / f"{variant}.frames.npy"):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, *sys.argv[1:], "--one", variant, "--out", str(a.out)]
    try:
        ended = f"exited {subprocess.run(cmd, timeout=a.variant_timeout).returncode}"
    except subprocess.TimeoutExpired:
        ended = f"ran past {a.variant_timeout:.0f} s"
    row_file, frames_file = a.out / f"{variant}.row.json", a.out / f"{variant}.frames.npy"
    if not row_file.exists():
        return Row(variant, 1 if variant == "one" else a.size, note=f"failed: its process {ended}"), None
    frames = np.load(frames_file) if frames_file.exists() else None
    frames_file.unlink(missing_ok=True)
    return Row(**json.loads(row_file.read_text())), frames


def save(rows: list[Row], a: argparse.Namespace, torch: Any) -> None:
    cuda = a.device.startswith("cuda")
    (a.out / "media_parallel.md").write_text(table(rows, a) + "\n")
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "gpus": torch.cuda.device_count() if cuda else 0}
    (a.out / "media_parallel.json").write_text(json.dumps(
        {"env": env, "args": {k: str(v) for k, v in vars(a).items()}, "rows": [asdict(r) for r in rows]},
        indent=1, default=str))


if __name__ == "__main__":
    main()
