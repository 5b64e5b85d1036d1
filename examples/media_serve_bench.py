"""Images through `minisgl serve` as a user gets them: end to end (HTTP, PNG, base64), alone and 8 at once, with a
chat stream beside them.

For each `--media-quantization` given, start `minisgl serve` (the text model and the image pipeline both; on a
GPU machine without weights, built-in configs with random weights: `--load-format dummy --media-load-format dummy`),
then:
- cold: the first image (the pipeline's build and its compile, stored for the next start);
- alone: `--runs` images one after another (each a new prompt and seed): median seconds an image;
- chat alone: a streamed chat completion of 128 tokens: its time per output token (TPOT);
- 8 at once: `--concurrency` image requests sent together with a chat stream beside them: images per minute,
  p50 / p99 latency, and the chat's TPOT while they run (after one untimed burst of as many: the batch sizes it
  brings compiled first);
- where an image's seconds went, from the server's `Server-Timing` header: the pipeline call, the PNG, the rest
  inside the server, the rest outside it (`alone_where`, `concurrent_where`).

    python examples/media_serve_bench.py --out /tmp/media_serve                                 # GPU, dummy weights
    python examples/media_serve_bench.py --videos ";--media-attention fp8 --media-quantization fp8"   # Wan, 2 servers
    python examples/media_serve_bench.py --serve-args "--device cpu --model DIR" --image-args "--image-model-dir D \\
        --media-load-format auto" --size 256x256 --concurrency 4 --quantizations none           # a CPU smoke run

`--videos`: Wan2.1-1.3B instead (832x480x81, CFG 5), one server per `;`-separated list of extra serve arguments
(an empty one: the exact defaults): its first video (build and compile, `--video-cold-steps` steps), then one video of
`--video-steps` steps (an mp4, as a user gets it), with where its seconds went.

A table on stdout, JSON and each server's log under --out."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minisgl_cli.api.http_server import free_port  # noqa: E402

SERVE = "--model qwen3-0.6b --load-format dummy"  # serve leaves the image pipeline its room (media/memory.py)
IMAGE = "--media-load-format dummy --image-model z-image-turbo"


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


TIMED: list[dict[str, float]] = []  # each image's seconds: end to end, and the server's Server-Timing parts


def record(r: httpx.Response, since: float) -> float:
    """Seconds since `since` for a finished response, kept in TIMED with its Server-Timing parts."""
    took = time.perf_counter() - since
    parts = dict(p.split(";dur=") for p in r.headers.get("server-timing", "").split(", ") if ";dur=" in p)
    TIMED.append({"e2e": took, **{k: float(v) / 1e3 for k, v in parts.items()}})
    return took


async def image(client: httpx.AsyncClient, url: str, prompt: str, seed: int, size: str) -> float:
    t = time.perf_counter()
    r = await client.post(f"{url}/v1/images/generations",
                          json={"prompt": prompt, "size": size, "seed": seed, "output_format": "png"})
    r.raise_for_status()
    assert r.json()["data"][0]["b64_json"]
    return record(r, t)


async def video(client: httpx.AsyncClient, url: str, prompt: str, seed: int, steps: int,
                a: argparse.Namespace) -> float:
    t = time.perf_counter()
    r = await client.post(f"{url}/v1/videos/generations", json={"prompt": prompt, "seed": seed, "steps": steps,
                                                                 "size": a.video_size, "num_frames": a.video_frames})
    r.raise_for_status()
    assert r.json()["data"][0]["mime_type"] == "video/mp4"
    return record(r, t)


async def measure_video(url: str, a: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=1800) as client:
        t = time.perf_counter()
        await video(client, url, "a cold start: waves on a rocky shore", 1, a.video_cold_steps, a)
        cold = time.perf_counter() - t
        TIMED.clear()
        took = await video(client, url, "a red fox running through fresh snow, cinematic", 7, a.video_steps, a)
        return {"cold_first_video_s": cold, "video_s": took, "where": where(TIMED), "steps": a.video_steps}


def where(timed: list[dict[str, float]]) -> dict[str, float]:
    """Medians (ms) of where an image's seconds went: the pipeline call, the PNG, the rest inside the server (queue,
    hand-offs between its processes) and outside it (HTTP, base64, JSON, the client)."""
    if not timed or "total" not in timed[0]:
        return {}
    med = lambda f: round(1e3 * statistics.median(f(t) for t in timed), 1)  # noqa: E731
    return {"generate_ms": med(lambda t: t["generate"]), "encode_ms": med(lambda t: t["encode"]),
            "in_server_rest_ms": med(lambda t: t["total"] - t["generate"] - t["encode"]),
            "outside_server_ms": med(lambda t: t["e2e"] - t["total"])}


async def chat_tpot(client: httpx.AsyncClient, url: str, tokens: int) -> float:
    """Seconds between output tokens of one streamed greedy completion (after the first). Token ids for a prompt: a
    built-in dummy text model has no tokenizer."""
    body = {"prompt": list(range(100, 132)), "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    stamps = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
    return statistics.median(gaps) if gaps else float("nan")


async def measure(url: str, a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=900) as client:
        t = time.perf_counter()
        await image(client, url, "a cold start: a lantern festival over a river at night", 1, a.size)
        out["cold_first_image_s"] = time.perf_counter() - t
        TIMED.clear()
        alone = [await image(client, url, f"a portrait number {i} in a misty bamboo courtyard", 10 + i, a.size)
                 for i in range(a.runs)]
        out["alone_s"] = statistics.median(alone)
        out["alone_all_s"] = alone
        out["alone_where"] = where(TIMED)
        out["chat_tpot_alone_ms"] = 1e3 * await chat_tpot(client, url, a.chat_tokens)
        # Untimed: the same burst once, so the batch sizes it brings are compiled before the timed one (the worker
        # also compiles them when idle, batch.warm_up, but a bench leaves it no idle time).
        t = time.perf_counter()
        await asyncio.gather(*(image(client, url, f"a warm-up crowd number {i}", 200 + i, a.size)
                               for i in range(a.concurrency)))
        out["burst_warmup_s"] = time.perf_counter() - t
        TIMED.clear()
        t = time.perf_counter()
        chat = asyncio.create_task(chat_tpot(client, url, a.chat_tokens))
        lat = await asyncio.gather(*(image(client, url, f"a crowd scene number {i}, lanterns", 100 + i, a.size)
                                     for i in range(a.concurrency)))
        wall = time.perf_counter() - t
        out["chat_tpot_during_ms"] = 1e3 * await chat
        out["concurrent_where"] = where(TIMED)
        out |= {"concurrent": a.concurrency, "concurrent_wall_s": wall, "images_per_min": 60 * a.concurrency / wall,
                "images_per_min_alone": 60 / out["alone_s"], "p50_s": percentile(lat, 0.5),
                "p99_s": percentile(lat, 0.99)}
        metrics = (await client.get(f"{url}/metrics", params={"format": "json"})).json()
        out["media_metrics"] = metrics.get("media")
    return out


def serve(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minisgl_cli.app", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"serve exited with code {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    sys.exit(f"serve not healthy after 600 s; see {log}")


def stop(proc: subprocess.Popen) -> float:
    """SIGTERM, as a user ends it; seconds until it exited (killed past 30 s)."""
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default=SERVE)
    ap.add_argument("--image-args", default=IMAGE)
    ap.add_argument("--quantizations", default="none,fp8", help="--media-quantization values, one server each (one "
                    "named twice starts again: its first image then takes the stored compile)")
    ap.add_argument("--size", default="1024x1024")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--chat-tokens", type=int, default=128)
    ap.add_argument("--videos", default=None, help="Wan through serve: `;`-separated extra serve arguments, a "
                    "server each (instead of the image runs)")
    ap.add_argument("--video-model", default="wan2.1-t2v-1.3b")
    ap.add_argument("--video-size", default="832x480")
    ap.add_argument("--video-frames", type=int, default=81)
    ap.add_argument("--video-steps", type=int, default=50)
    ap.add_argument("--video-cold-steps", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/media_serve"))
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.videos is not None:
        videos(a)
        return
    rows = {}
    for q in a.quantizations.split(","):
        starts = sum(k.split()[0] == q for k in rows)  # a later start's first image takes the stored compile
        key = f"{q} start {starts + 1}" if starts else q
        log = a.out / f"serve-{key.replace(' ', '-')}.log"
        t = time.perf_counter()
        proc, url = serve([*shlex.split(a.serve_args), *shlex.split(a.image_args), "--media-quantization", q], log)
        healthy_s = time.perf_counter() - t
        try:
            row = asyncio.run(measure(url, a))
        finally:
            row_stop = stop(proc)
        row |= {"healthy_s": healthy_s, "sigterm_exit_s": row_stop}
        rows[key] = row
        print(f"{key}: " + json.dumps({k: v for k, v in row.items() if k != "media_metrics"}), flush=True)
    (a.out / "media_serve.json").write_text(json.dumps(rows, indent=2))
    print("\n| quantization | first image after start s | image alone s | images/min alone | images/min x"
          f"{a.concurrency} | p50 / p99 s | chat TPOT alone / during ms | SIGTERM exit s |")
    print("|---|---|---|---|---|---|---|---|")
    for q, r in rows.items():
        print(f"| {q} | {r['cold_first_image_s']:.1f} | {r['alone_s']:.3f} | {r['images_per_min_alone']:.1f} | "
              f"{r['images_per_min']:.1f} | {r['p50_s']:.2f} / {r['p99_s']:.2f} | "
              f"{r['chat_tpot_alone_ms']:.1f} / {r['chat_tpot_during_ms']:.1f} | {r['sigterm_exit_s']:.1f} |")


def videos(a: argparse.Namespace) -> None:
    rows = {}
    for i, extra in enumerate(a.videos.split(";")):
        key = extra.strip() or "exact (defaults)"
        t = time.perf_counter()
        proc, url = serve([*shlex.split(a.serve_args), "--media-load-format", "dummy", "--video-model",
                           a.video_model, *shlex.split(extra)], a.out / f"serve-video-{i}.log")
        healthy_s = time.perf_counter() - t
        try:
            row = asyncio.run(measure_video(url, a))
        finally:
            exit_s = stop(proc)
        rows[key] = row = row | {"healthy_s": healthy_s, "sigterm_exit_s": exit_s}
        print(f"{key}: {json.dumps(row)}", flush=True)
    (a.out / "media_serve_video.json").write_text(json.dumps(rows, indent=2))
    print("\n| serve arguments | first video after start s (steps) | video s (steps) | in the pipeline s | mp4 s | "
          "rest s | SIGTERM exit s |")
    print("|---|---|---|---|---|---|---|")
    for key, r in rows.items():
        w = r["where"]
        rest = r["video_s"] - (w.get("generate_ms", 0) + w.get("encode_ms", 0)) / 1e3
        print(f"| {key} | {r['cold_first_video_s']:.1f} ({a.video_cold_steps}) | {r['video_s']:.1f} ({r['steps']}) | "
              f"{w.get('generate_ms', float('nan')) / 1e3:.1f} | {w.get('encode_ms', float('nan')) / 1e3:.2f} | "
              f"{rest:.2f} | {r['sigterm_exit_s']:.1f} |")


if __name__ == "__main__":
    main()
