"""The media engine's speed options side by side, in one process, on full-size random-weight pipelines.

For Z-Image-Turbo (1024^2, 9 steps) and Wan2.1-T2V-1.3B (832x480x81, CFG 5), each variant is built from the same
built-in config with the same seeded weights (media/configs.py), then timed: the first call (a cold compile where
the variant compiles; the stored compile where an earlier start left one), then warm calls with new prompts
(no prompt-cache hits), split into text encoder, transformer (a step = all its calls in one denoise step) and VAE.
Each output is compared with the exact path's (same seed, same prompt): PSNR in dB (inf: identical pixels).

Variants (`--variants`, comma-separated; tokens joined by "+"):
  plain        diffusers' pipeline as it comes (the baseline)
  eager        our load_pipeline, nothing compiled     compile   regional compile (+ the image VAE decode)
  fp8          FP8 DiT linears                         fbcache / dbcache / taylorseer   cache-dit's step cache
  nographs     no CUDA graphs of the short passes (--disable-cuda-graph; media/graphs.py)
  sdpa / cudnn / flash3 / fp8attn   the attention kernels (default: auto; fp8attn: ours in FP8, approximate)

    python examples/media_bench.py --out /tmp/media                       # H200: both models, default variants
    python examples/media_bench.py --wan-steps 50 --variants plain,compile+fp8+fbcache --skip-image
    python examples/media_bench.py --wan-steps 50 --skip-image --video-variants compile,compile+fp8+fp8attn+fbcache \
        --cache-options scm=fast,scm-policy=static      # a cache's knobs (--media-cache's :key=value,...)
    python examples/media_bench.py --tiny --device cpu                     # the tiny configs: a CPU smoke run

A variant listed twice (`compile,compile`) times a start that finds the first one's compile stored (dynamo reset,
inductor's caches kept): the cold start with the stored compile.

Wan at 50 steps takes about a minute a variant; `--wan-steps 10` (the default) times 10 and extrapolates to 50
from the warm step time ("s@50"), which holds for the exact variants, not for a step cache (it skips more of a
longer run): time those at 50.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

IMAGE_VARIANTS = ("plain,eager+sdpa,eager,compile+sdpa,compile,compile,fp8,compile+fp8,compile+fbcache,"
                  "compile+fp8+fbcache")
VIDEO_VARIANTS = "plain,eager,compile,compile+fp8,compile+fbcache,compile+fp8+fbcache,compile+fp8+taylorseer"
ATTENTION = {"sdpa": "sdpa", "cudnn": "cudnn", "flash2": "flash2", "flash3": "flash3", "fp8attn": "fp8", "auto": "auto"}
CACHES = ("fbcache", "dbcache", "taylorseer")


@dataclass
class Row:
    model: str
    variant: str
    first_s: float = math.nan
    warm_s: float = math.nan
    step_ms: float = math.nan  # one denoise step's transformer time (CFG: both calls)
    text_ms: float = math.nan
    vae_ms: float = math.nan
    psnr_db: float = math.nan
    at_50_s: float = math.nan  # video: warm time extrapolated to 50 steps
    cached_steps: list[int] = field(default_factory=list)
    note: str = ""


class Timer:
    """Wall time of a module's forward (or a method) per call, CUDA-synchronised at both ends."""

    def __init__(self, sync: Any):
        self.sync, self.times = sync, defaultdict(list)

    def module(self, name: str, module: Any) -> None:
        starts: list[float] = []

        def pre(*_: Any) -> None:
            self.sync()
            starts.append(time.perf_counter())

        def post(*_: Any) -> None:
            self.sync()
            self.times[name].append(time.perf_counter() - starts.pop())

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def method(self, name: str, obj: Any, attr: str) -> None:
        inner = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            self.sync()
            self.times[name].append(time.perf_counter() - t)
            return out

        setattr(obj, attr, timed)

    def text_encoder(self, pipe: Any) -> None:
        """The prompt's encoding, timed around the pipeline's own method where it has one (Z-Image): hooks on the
        encoder module would run inside its CUDA graph's capture (media/graphs.py), where a sync cannot."""
        if hasattr(pipe, "_encode_prompt"):
            self.method("text", pipe, "_encode_prompt")
        else:
            self.module("text", pipe.text_encoder)

    def take(self) -> dict[str, list[float]]:
        out, self.times = dict(self.times), defaultdict(list)
        return out


def to_8bit(x: Any) -> Any:
    """A pipeline's float output in [0, 1] as the 8-bit pixels a user gets (what batch.generate hands back)."""
    return (np.clip(np.asarray(x, np.float64), 0.0, 1.0) * 255).round().astype(np.uint8)


def psnr(a: Any, b: Any) -> float:
    """Of two 8-bit outputs, in dB (inf: identical pixels)."""
    mse = float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def parse(variant: str, cache_options: str = "") -> dict[str, Any]:
    tokens = set(variant.split("+"))
    unknown = tokens - {"plain", "eager", "compile", "fp8", "nographs", *CACHES, *ATTENTION}
    if unknown:
        raise SystemExit(f"unknown variant token(s) {sorted(unknown)} in {variant!r}")
    return dict(plain="plain" in tokens, compile="compile" in tokens, quantization="fp8" if "fp8" in tokens else None,
                media_cache=next((f"{t}:{cache_options}" if cache_options else t for t in tokens if t in CACHES), None),
                attention_backend=next((ATTENTION[t] for t in tokens if t in ATTENTION), "auto"),
                cuda_graphs="nographs" not in tokens)


def run_model(kind: str, name: str, variants: list[str], a: argparse.Namespace, sync: Any) -> list[Row]:
    import torch

    from minisgl_cli.device import pick_device, pick_dtype
    from minisgl_cli.media import batch, step_cache
    from minisgl_cli.media.configs import build_dummy_pipeline
    from minisgl_cli.media.jobs import ImageJob, MediaError, ModelSpec, VideoJob
    from minisgl_cli.media.pipelines import load_pipeline, unload_all

    device = pick_device(a.device)
    dtype = pick_dtype(device)
    steps = a.image_steps if kind == "image" else a.wan_steps
    w, h = (a.width, a.height) if kind == "image" else (a.wan_width, a.wan_height)
    call: dict[str, Any] = dict(height=h, width=w, num_inference_steps=steps, output_type="np",
                                guidance_scale=0.0 if kind == "image" else 5.0)
    if kind == "video":
        call["num_frames"] = a.wan_frames
    rows, reference, seen = [], None, set()
    for variant in variants:
        opts = parse(variant, a.cache_options)
        row = Row(name, variant)
        if variant in seen:  # a compiled variant again: its first call reads the compile the first one stored
            row.note = "again: stored compile"
        seen.add(variant)
        timer = Timer(sync)
        unload_all()
        torch._dynamo.reset()  # each variant's blocks are new modules: start from no compiled code
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        try:
            if opts["plain"]:
                pipe = build_dummy_pipeline(name, device, dtype)
                pipe.set_progress_bar_config(disable=True)

                def generate(prompt: str, seed: int, pipe: Any = pipe) -> Any:
                    out = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed), **call)
                    return to_8bit(out.images if kind == "image" else out.frames[0])
            else:
                spec = ModelSpec.create(kind, name, None, device=device, load_format="dummy", compile=opts["compile"],
                                        attention_backend=opts["attention_backend"],
                                        quantization=opts["quantization"], media_cache=opts["media_cache"],
                                        cuda_graphs=opts["cuda_graphs"])
                loaded = load_pipeline(spec)
                pipe = loaded.pipe

                def generate(prompt: str, seed: int, loaded: Any = loaded) -> Any:
                    job = (ImageJob(prompt, w, h, steps, 0.0, seed=seed) if kind == "image" else
                           VideoJob(prompt, w, h, a.wan_frames, 16, steps, 5.0, seed=seed))
                    result = batch.generate(loaded, [job])[0]  # what serve and the CLI run
                    return np.stack([np.asarray(x) for x in (result.images if kind == "image" else result.frames)])
        except MediaError as exc:
            row.note = f"refused: {exc.message}"
            rows.append(row)
            print(f"{name} {variant}: {row.note}", flush=True)
            continue
        timer.text_encoder(pipe)
        timer.module("transformer", pipe.transformer)
        timer.method("vae", pipe.vae, "decode")
        t = time.perf_counter()
        first = generate("a bench prompt number 0, a lantern festival over a river at night", a.seed)
        sync()
        row.first_s = time.perf_counter() - t
        if opts["media_cache"]:
            row.cached_steps = step_cache.cached_steps(pipe)
        timer.take()
        warm, parts = [], defaultdict(list)
        for i in range(a.runs if kind == "image" else a.video_runs):
            t = time.perf_counter()
            generate(f"a bench prompt number {i + 1}, a lantern festival over a river at night", a.seed)
            sync()
            warm.append(time.perf_counter() - t)
            for k, v in timer.take().items():
                parts[k].append(sum(v))
        row.warm_s = statistics.median(warm)
        row.text_ms = 1e3 * statistics.median(parts["text"]) if parts["text"] else 0.0
        row.vae_ms = 1e3 * statistics.median(parts["vae"])
        row.step_ms = 1e3 * statistics.median(parts["transformer"]) / steps
        if kind == "video":
            row.at_50_s = row.warm_s + (50 - steps) * row.step_ms / 1e3
        if reference is None:
            reference = first
            row.note = "reference (exact)"
        row.psnr_db = psnr(first, reference)
        rows.append(row)
        print(f"{name} {variant}: first {row.first_s:.2f} s, warm {row.warm_s:.3f} s, step {row.step_ms:.1f} ms, "
              f"PSNR {row.psnr_db:.1f} dB {row.note}", flush=True)
        del pipe, generate
    unload_all()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| model | variant | first call s | warm s | s@50 | step ms | text enc ms | VAE ms | PSNR dB | cached | "
             "note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.variant} | {r.first_s:.2f} | {r.warm_s:.3f} | {r.at_50_s:.1f} | "
                     f"{r.step_ms:.1f} | {r.text_ms:.1f} | {r.vae_ms:.1f} | {r.psnr_db:.1f} | "
                     f"{len(r.cached_steps)} | {r.note} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny configs at small sizes (a CPU smoke run)")
    ap.add_argument("--device", default=None, help="auto: cuda, mps, cpu")
    ap.add_argument("--image-variants", default=IMAGE_VARIANTS)
    ap.add_argument("--video-variants", default=VIDEO_VARIANTS)
    ap.add_argument("--variants", default=None, help="one list for both models")
    ap.add_argument("--skip-image", action="store_true")
    ap.add_argument("--skip-video", action="store_true")
    ap.add_argument("--runs", type=int, default=3, help="warm image calls a variant (median)")
    ap.add_argument("--video-runs", type=int, default=1, help="warm video calls a variant (median)")
    ap.add_argument("--image-steps", type=int, default=9)
    ap.add_argument("--wan-steps", type=int, default=10)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--wan-width", type=int, default=832)
    ap.add_argument("--wan-height", type=int, default=480)
    ap.add_argument("--wan-frames", type=int, default=81)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--cache-options", default="", help="the step cache variants' knobs, e.g. scm=fast,threshold=0.2")
    ap.add_argument("--out", type=Path, default=Path("/tmp/media_bench"))
    a = ap.parse_args()
    image_model, video_model = ("tiny-z-image", "tiny-wan") if a.tiny else ("z-image-turbo", "wan2.1-t2v-1.3b")
    if a.tiny:
        a.width = a.height = a.wan_width = a.wan_height = 32
        a.wan_frames, a.image_steps, a.wan_steps = 5, 4, min(a.wan_steps, 4)
        a.runs = min(a.runs, 2)
        if a.variants is None:  # compiling on a CPU takes minutes: ask for it by name
            a.variants = "plain,eager,fp8,fbcache,taylorseer+sdpa"
    import torch

    from minisgl_cli.media.console import quiet_libraries

    quiet_libraries()
    sync: Any = torch.cuda.synchronize if torch.cuda.is_available() and a.device != "cpu" else (lambda: None)
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    if not a.skip_image:
        rows += run_model("image", image_model, (a.variants or a.image_variants).split(","), a, sync)
    if not a.skip_video:
        rows += run_model("video", video_model, (a.variants or a.video_variants).split(","), a, sync)
    text = table(rows)
    print(text)
    (a.out / "media_bench.md").write_text(text + "\n")
    cuda = torch.cuda.is_available() and a.device != "cpu"
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    (a.out / "media_bench.json").write_text(json.dumps({"env": env, "args": {k: str(v) for k, v in vars(a).items()},
                                                        "rows": [asdict(r) for r in rows]}, indent=1, default=str))


if __name__ == "__main__":
    main()
