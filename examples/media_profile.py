"""Where a media call's GPU time goes, and what recompiles, for a few variants of one dummy pipeline.

Each variant (media_bench.py's tokens, plus `dynamic`: the DiT compiled with symbolic shapes from the start instead
of static ones first; `autotune`: inductor's GEMM autotuning) is built from the same built-in config, called once
(the cold compile) and twice warm, then:
  - a warm call's wall time split into text encoder / transformer / VAE (media_bench.py's Timer);
  - torch.profiler over one warm call (the part timer's syncs off: the call as the server makes it): GPU kernel
    time by class (GEMM, attention, Triton-fused, other), the GPU's busy fraction of the wall, the top kernels, and
    the GPU's idle gaps of `--gap-us` or more with the host ops that ran through each (where the host held it up);
  - with `--shapes`: calls with other batch sizes and prompt lengths, each one's time and the graphs dynamo
    compiled for it (a recompile shows as seconds and a count above 0); `--warm-up` runs the media worker's
    warm-up (batch.warm_up) before them.

    python examples/media_profile.py --variants compile,compile+dynamic --shapes --out /tmp/prof
    python examples/media_profile.py --tiny --device cpu --variants eager --steps 2   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from media_bench import Timer, parse  # noqa: E402

EXTRA = ("dynamic", "autotune")
CLASSES = (("attention", ("fmha", "flash", "attention", "attn", "sdpa")),
           ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "_mm_", "matmul", "tem_fused")),
           ("triton", ("triton_",)))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CLASSES if any(k in low for k in keys)), "other")


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The union of kernel intervals: how long the GPU ran anything."""
    total, end = 0.0, -1.0
    for s, e in sorted(spans):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def idle_gaps(spans: list[tuple[float, float]], host: list[tuple[float, float, str]], min_us: float
                ) -> list[dict[str, Any]]:
    """The GPU's idle intervals of at least `min_us` between its first and last kernel, each with the longest host
    ops (name, µs) that overlap it: what the host was doing while the device waited."""
    gaps, end = [], None
    for s, e in sorted(spans):
        if end is not None and s - end >= min_us:
            gaps.append((end, s))
        end = e if end is None else max(end, e)
    out = []
    for g0, g1 in gaps:
        ops: dict[str, float] = defaultdict(float)
        for s, e, name in host:
            if s < g1 and e > g0:
                ops[name] += min(e, g1) - max(s, g0)
        top = sorted(ops.items(), key=lambda kv: -kv[1])[:4]
        out.append(dict(start_us=g0, us=g1 - g0, host=[(n[:60], round(v, 1)) for n, v in top]))
    return out


def profile_call(call: Any, gap_us: float = 200.0) -> dict[str, Any]:
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    by_class: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    spans, host = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CPU and not e.name.startswith(("cuda", "cudnn", "ProfilerStep")):
            host.append((e.time_range.start, e.time_range.end, e.name))
        if e.device_type != DeviceType.CUDA or e.name.startswith(("Memcpy", "Memset")):
            continue
        us = e.time_range.end - e.time_range.start
        by_class[kernel_class(e.name)] += us
        by_name[e.name[:90]] += us
        counts[e.name[:90]] += 1
        spans.append((e.time_range.start, e.time_range.end))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    gaps = idle_gaps(spans, host, gap_us)
    t0 = min(s for s, _ in spans) if spans else 0.0
    for g in gaps:
        g["start_us"] = round(g["start_us"] - t0, 1)
    return dict(wall_ms=1e3 * wall, busy_ms=busy_us(spans) / 1e3, kernels=len(spans),
                class_ms={k: v / 1e3 for k, v in sorted(by_class.items())},
                top=[(n, v / 1e3, counts[n]) for n, v in top],
                gaps_ms=sum(g["us"] for g in gaps) / 1e3, gaps=gaps)


def graphs() -> int:
    import torch._dynamo.utils as du

    return int(du.counters["stats"]["unique_graphs"])


def run_variant(variant: str, a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor_config

    from minisgl_cli.media import batch
    from minisgl_cli.media.compile import compile_denoiser, compile_vae_decode
    from minisgl_cli.media.jobs import ImageJob, ModelSpec
    from minisgl_cli.media.pipelines import load_pipeline, unload_all

    tokens = set(variant.split("+"))
    opts = parse("+".join(sorted(tokens - set(EXTRA))) or "eager")
    unload_all()
    torch._dynamo.reset()
    gc.collect()
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
    inductor_config.max_autotune_gemm = "autotune" in tokens
    own_compile = "dynamic" in tokens
    spec = ModelSpec.create("image", a.model, None, device=a.device, load_format="dummy",
                            compile=opts["compile"] and not own_compile, attention_backend=opts["attention_backend"],
                            quantization=opts["quantization"], media_cache=opts["media_cache"],
                            cuda_graphs=opts["cuda_graphs"])
    loaded = load_pipeline(spec)
    pipe = loaded.pipe
    if own_compile:
        compile_denoiser(pipe.transformer, dynamic=True)
        compile_vae_decode(pipe.vae)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timer = Timer(sync)
    timer.text_encoder(pipe)
    timer.module("transformer", pipe.transformer)
    timer.method("vae", pipe.vae, "decode")
    prompt = "a lantern festival over a river at night, number {}"

    def call(i: int, n: int = 1, words: int = 0) -> float:
        job = ImageJob(prompt.format(i) + " and more" * words, a.width, a.height, a.steps, 0.0, num_images=n,
                       seed=a.seed)
        t = time.perf_counter()
        batch.generate(loaded, [job])
        sync()
        return time.perf_counter() - t

    out: dict[str, Any] = dict(variant=variant, gap_us=a.gap_us)
    g0 = graphs()
    out["first_s"] = call(0)
    out["first_graphs"] = graphs() - g0
    call(1)
    timer.take()
    warm, parts = [], defaultdict(list)
    for i in range(a.runs):
        warm.append(call(2 + i))
        for k, v in timer.take().items():
            parts[k].append(1e3 * sum(v))
    out["warm_s"] = statistics.median(warm)
    out["parts_ms"] = {k: statistics.median(v) for k, v in parts.items()}
    if cuda:
        timer.sync = lambda: None  # the call as the server makes it: no sync at each part's ends
        out["unsynced_s"] = statistics.median(call(20 + i) for i in range(a.runs))
        out["profile"] = profile_call(lambda: call(50), a.gap_us)
        timer.sync = sync
    if a.warm_up:
        g = graphs()
        t = time.perf_counter()
        batch.warm_up(loaded, ImageJob(prompt.format(0), a.width, a.height, a.steps, 0.0, seed=a.seed))
        sync()
        out["warm_up"] = dict(s=round(time.perf_counter() - t, 2), graphs=graphs() - g)
    if a.shapes:
        seq = []
        for n, words in ((1, 30), (2, 0), (1, 0), (4, 0), (3, 12), (2, 30), (1, 60)):
            g = graphs()
            s = call(100 + len(seq), n, words)
            seq.append(dict(n=n, extra_words=words, s=round(s, 3), per_image_s=round(s / n, 3), graphs=graphs() - g))
        out["shapes"] = seq
    timer.take()
    if loaded.graphs is not None:  # media/graphs.py: what was captured, replayed, kept eager
        out["cuda_graphs"] = {m.name: dict(captures=m.captures, replays=m.replays, eager=len(m.eager))
                              for m in loaded.graphs.members}
    unload_all()
    inductor_config.max_autotune_gemm = False
    return out


def report(r: dict[str, Any]) -> str:
    p = r.get("parts_ms", {})
    step = p.get("transformer", 0.0)
    lines = [f"## {r['variant']}: first {r['first_s']:.2f} s ({r['first_graphs']} graphs), warm {r['warm_s']:.3f} s"
             f" | text {p.get('text', 0):.1f} ms, transformer {step:.1f} ms, VAE {p.get('vae', 0):.1f} ms"]
    if "profile" in r:
        pr = r["profile"]
        classes = ", ".join(f"{k} {v:.1f}" for k, v in pr["class_ms"].items())
        lines.append(f"   profiled call {pr['wall_ms']:.1f} ms, GPU busy {pr['busy_ms']:.1f} ms "
                     f"({pr['busy_ms'] / pr['wall_ms']:.0%}), {pr['kernels']} kernels; ms by class: {classes}")
        lines += [f"     {ms:8.2f} ms {count:5d}x  {name}" for name, ms, count in pr["top"]]
        lines.append(f"   unsynced warm call {r['unsynced_s']:.3f} s; GPU idle gaps >= {r['gap_us']:.0f} us: "
                     f"{len(pr['gaps'])}, {pr['gaps_ms']:.1f} ms")
        for g in sorted(pr["gaps"], key=lambda g: -g["us"])[:15]:
            ops = "; ".join(f"{n} {us:.0f}" for n, us in g["host"])
            lines.append(f"     at {g['start_us'] / 1e3:8.2f} ms: {g['us']:7.0f} us idle | host: {ops}")
    if "cuda_graphs" in r:
        lines.append("   CUDA graphs (captured / replays / shapes kept eager): " + "; ".join(
            f"{name} {g['captures']} / {g['replays']} / {g['eager']}" for name, g in r["cuda_graphs"].items()))
    if "warm_up" in r:
        lines.append(f"   warm-up (batch.warm_up): {r['warm_up']['s']:.2f} s, {r['warm_up']['graphs']} graphs")
    for s in r.get("shapes", []):
        lines.append(f"   n={s['n']} +{s['extra_words']} words: {s['s']:.3f} s ({s['per_image_s']:.3f} s/image), "
                     f"{s['graphs']} new graphs")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="z-image-turbo")
    ap.add_argument("--tiny", action="store_true", help="the tiny-z-image config (CPU smoke runs)")
    ap.add_argument("--variants", default="compile,compile+dynamic,compile+fp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", action="store_true", help="time other batch sizes and prompt lengths")
    ap.add_argument("--warm-up", action="store_true", help="before --shapes, the worker's warm-up (batch.warm_up)")
    ap.add_argument("--gap-us", type=float, default=200.0, help="the GPU idle gaps listed: this long or longer")
    ap.add_argument("--out", default=None, help="write profile.json here")
    a = ap.parse_args()
    if a.tiny:
        a.model, a.width, a.height = "tiny-z-image", min(a.width, 64), min(a.height, 64)
    results = []
    for variant in a.variants.split(","):
        unknown = set(variant.split("+")) - set(EXTRA)
        parse("+".join(sorted(unknown)) or "eager")  # exits on an unknown token
        r = run_variant(variant, a)
        print(report(r), flush=True)
        results.append(r)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
