"""Image chats through a real `minisgl serve`: N concurrent single-image chats streamed with the OpenAI API,
output tok/s and TTFT, each workload after a warm-up.

    PYTHONPATH=. python examples/bench_vlm.py cpu [--out DIR]
    PYTHONPATH=. python examples/bench_vlm.py gpu [--out DIR] [--config qwen2.5-vl-7b] [-- SERVE ARGS...]

cpu: a small random Qwen2-VL (examples/make_tiny_media_models.py: 256 wide, 4 layers, a 4-block 128-wide tower,
14-pixel patches; images 224x224 -> 64 image tokens), 8 concurrent chats, 32 new tokens each (EOS ignored,
greedy, fp32), served twice in one run: on our engine (`--model DIR`: batched, radix-cached) and on the
transformers path (`--vlm-model DIR` beside the default text model: one chat at a time).

gpu: a Qwen2.5-VL-7B with dummy weights (the built-in config; a directory with a byte-level tokenizer and Qwen's
image processor is written under the output dir: make_tiny_media_models.write_dummy_vlm_dir), 64 concurrent
chats, 448x448 images (256 image tokens each), 128 new tokens: once with 64 different images, once with one
image shared by all 64 (asked once first, so the rest hit its KV in the radix cache); four tokenizer workers
run the image processor. Kept under ~3 minutes on an H100 (weights are drawn on the GPU; CUDA graphs are
captured at start). TTFT counts everything from the request's send: the body's JSON and JPEG decoding, the
processor in a tokenizer worker, queueing, the vision tower and the prefill.

Prints a table and writes bench_vlm_<mode>.json and each server's stderr under --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from minisgl_cli.api.http_server import free_port
from minisgl_cli.bench.http_client import Send, Share, stream_requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
import make_tiny_media_models as tiny  # noqa: E402


def picture_url(size: int, seed: int) -> str:
    """A data: URL of a size x size JPEG (distinct seeds: distinct pictures): a random 16x16 colour grid scaled up,
    about the bytes of a photo of that size, not of incompressible noise."""
    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    grid = Image.fromarray((torch.rand(16, 16, 3, generator=g) * 255).byte().numpy())
    buf = io.BytesIO()
    grid.resize((size, size), Image.BILINEAR).save(buf, format="JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


class Server:
    """`minisgl serve ARGS` on a free port, its stderr in a file, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, args: list[str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen([sys.executable, "-m", "minisgl_cli.app", "serve", *args, "--port",
                                      str(self.port)], stdout=subprocess.DEVNULL, stderr=log.open("w"), env=env)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with code {self.proc.returncode}: see {self.log}\n"
                                   + "\n".join(self.log.read_text().splitlines()[-15:]))
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"serve not healthy after 600 s: see {self.log}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def scheduler(self) -> dict:
        return httpx.get(f"{self.url}/metrics", params={"format": "json"}, timeout=30).json()["scheduler"]


def chat(image: str, question: str, max_tokens: int) -> Send:
    body = {"model": "default", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": question}]}]}
    return Send("/v1/chat/completions", body, 0)


def run(server: Server, sends: list[Send], name: str) -> dict:
    """Every request at once; the figures of the batch."""
    before = server.scheduler()
    t0 = time.perf_counter()
    sents = asyncio.run(stream_requests(server.url, Share(list(range(len(sends))), sends, None, float("inf"), 0),
                                        timeout_s=600, on_done=lambda i: None))
    wall = time.perf_counter() - t0
    after = server.scheduler()
    failed = [s.timing.error for s in sents if not s.timing.success]
    if failed:
        raise RuntimeError(f"{name}: {len(failed)} requests failed, the first: {failed[0]}")
    tokens = sum(s.usage_tokens or 0 for s in sents)
    ttft = sorted(s.timing.ttft_s or 0.0 for s in sents)
    return {"workload": name, "requests": len(sends), "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tok_s": round(tokens / wall, 2), "ttft_p50_s": round(statistics.median(ttft), 3),
            "ttft_max_s": round(ttft[-1], 3),
            "cached_tokens": sum(s.timing.cached_tokens or 0 for s in sents),
            "images_encoded": after.get("images_encoded", 0) - before.get("images_encoded", 0),
            "vision_s": round(after.get("vision_s", 0.0) - before.get("vision_s", 0.0), 3)}


def table(rows: list[dict]) -> str:
    cols = ["path", "workload", "requests", "output_tok_s", "ttft_p50_s", "ttft_max_s", "wall_s", "cached_tokens",
            "images_encoded", "vision_s"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    lines += [" | ".join(str(r.get(c, "")) for c in cols) for r in rows]
    return "\n".join(lines)


def cpu(out: Path, n: int, size: int, new: int, serve_args: list[str]) -> list[dict]:
    model = tiny.build_tiny_qwen2_vl(Path(tempfile.mkdtemp(prefix="bench-vlm-")) / "qwen2-vl-small", width=256,
                                     layers=4, vision_width=128, vision_depth=4, patch=14, max_pixels=224 * 224)
    sends = [chat(picture_url(size, i), f"Question {i}: what is in this picture?", new) for i in range(n)]
    warm = [chat(picture_url(size, 1000), "Warm up.", 4)]
    rows = []
    exact = ["--dtype", "float32", "--quantization", "none", "--max-total-tokens", "8192"]
    # --model smollm2 beside it: the Qwen2-VL runs in transformers (alone, --vlm-model would put it on the engine)
    for path, args in (("engine", ["--model", str(model), *exact]),
                       ("transformers", ["--model", "smollm2", "--vlm-model", str(model), *exact])):
        with Server([*args, *serve_args], out / f"bench_vlm_cpu_{path}.err") as server:
            run(server, warm, "warm-up")
            rows.append({"path": path, **run(server, sends, f"{n} chats, {size}x{size} images, {new} tokens")})
    return rows


def gpu(out: Path, config: str, n: int, size: int, new: int, serve_args: list[str]) -> list[dict]:
    from minisgl_cli.loader.configs import builtin_config

    from_file = config.endswith(".json")
    cfg = json.loads(Path(config).read_text()) if from_file else builtin_config(config)
    model = tiny.write_dummy_vlm_dir(out / f"dummy-{Path(config).parent.name if from_file else config}", cfg)
    rows = []
    # Four tokenizer workers run the image processor side by side (~50 ms a 448x448 picture on one core).
    args = ["--model", str(model), "--load-format", "dummy", "--num-tokenizer", "4", *serve_args]
    with Server(args, out / "bench_vlm_gpu.err") as server:
        run(server, [chat(picture_url(size, 10_000 + i), "Warm up.", 8) for i in range(4)], "warm-up")
        distinct = [chat(picture_url(size, i), f"Question {i}: describe the image.", new) for i in range(n)]
        rows.append({"path": "engine", **run(server, distinct, f"{n} chats, distinct {size}x{size} images")})
        shared = picture_url(size, 5_000)
        run(server, [chat(shared, "First look.", 4)], "the shared image, once")
        same = [chat(shared, f"Question {i}: describe the image.", new) for i in range(n)]
        rows.append({"path": "engine", **run(server, same, f"{n} chats, one shared {size}x{size} image")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["cpu", "gpu"])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--config", default="qwen2.5-vl-7b", help="gpu: a built-in config name or a config.json path")
    ap.add_argument("--requests", type=int, help="concurrent chats (cpu: 8, gpu: 64)")
    ap.add_argument("--image-size", type=int, help="square images of this many pixels (cpu: 224, gpu: 448)")
    ap.add_argument("--max-tokens", type=int, help="new tokens per chat (cpu: 32, gpu: 128)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.serve_args = argv[cut + 1 :]  # more `minisgl serve` flags, after --
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    n, size, new = (8, 224, 32) if args.mode == "cpu" else (64, 448, 128)
    n, size, new = args.requests or n, args.image_size or size, args.max_tokens or new
    rows = (cpu(args.out, n, size, new, args.serve_args) if args.mode == "cpu" else
            gpu(args.out, args.config, n, size, new, args.serve_args))
    print(table(rows))
    print(f"({time.perf_counter() - t0:.0f} s in all; logs and bench_vlm_{args.mode}.json in {args.out})")
    (args.out / f"bench_vlm_{args.mode}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
