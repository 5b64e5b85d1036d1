"""Online vs offline throughput: the same prompts through LLM.generate, then through the HTTP server at
concurrency 16, on ONE engine in one process; prints both and the ratio (the goal is online >= 90%).

    python examples/bench_online.py                      # default model, 64 prompts x 64 tokens
    python examples/bench_online.py --num-prompts 128 --max-tokens 128 --concurrency 16
    python examples/bench_online.py --url http://127.0.0.1:8000   # online only, against a running server

Fairness: both phases use the same engine and the same prompts, every request generates exactly
max_tokens tokens (ignore_eos), the engine batches at most --concurrency requests (so offline cannot
batch wider than the online clients can), and the prefix cache is off by default (`--cache naive`),
so the second phase gets no cache hits from the first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx

TOPICS = ["the sea", "a robot", "mountains", "a city at night", "a lost key", "the moon", "a garden", "trains"]


def make_prompts(n: int) -> list[str]:
    return [f"Request {i}: write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


async def _one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, sem: asyncio.Semaphore) -> int:
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    async with sem, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        tokens = 0
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
        return tokens


def online(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[int, float]:
    """(completion tokens, seconds) for all prompts streamed with `concurrency` requests in flight."""

    async def run() -> list[int]:
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(timeout=None, limits=limits) as http:
            return await asyncio.gather(*(_one(http, url, p, max_tokens, sem) for p in prompts))

    t0 = time.perf_counter()
    counts = asyncio.run(run())
    return sum(counts), time.perf_counter() - t0


def offline(llm, prompts: list[str], max_tokens: int) -> tuple[int, float]:
    from minisgl_cli.types import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model (default: the bundled SmolLM2-135M-Instruct).")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--cache", default="naive", help="Prefix cache for both phases (naive: no reuse).")
    ap.add_argument("--url", default=None, help="Bench this running server (online only).")
    args = ap.parse_args()
    prompts = make_prompts(args.num_prompts)

    if args.url:
        tokens, secs = online(args.url, prompts, args.max_tokens, args.concurrency)
        print(f"online  {tokens} tokens in {secs:.2f}s = {tokens / secs:.1f} tok/s (concurrency {args.concurrency})")
        return

    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.llm import LLM
    from minisgl_cli.server.app import create_app

    llm = LLM(args.model, max_running_requests=args.concurrency, cache=args.cache)
    try:
        offline(llm, prompts[: args.concurrency], 4)  # warm-up: first-call costs stay out of both numbers
        off_tokens, off_secs = offline(llm, prompts, args.max_tokens)
        with BackgroundServer(create_app(llm.client)) as url:
            online(url, prompts[: args.concurrency], 4, args.concurrency)  # warm the HTTP path too
            on_tokens, on_secs = online(url, prompts, args.max_tokens, args.concurrency)
    finally:
        llm.close()
    off_rate, on_rate = off_tokens / off_secs, on_tokens / on_secs
    print(f"model   {llm.client.info.name} on {llm.client.info.device}, {args.num_prompts} prompts x "
          f"{args.max_tokens} tokens, batch <= {args.concurrency}, cache={args.cache}")
    print(f"offline {off_tokens} tokens in {off_secs:.2f}s = {off_rate:.1f} tok/s (LLM.generate)")
    print(f"online  {on_tokens} tokens in {on_secs:.2f}s = {on_rate:.1f} tok/s (HTTP, concurrency {args.concurrency})")
    print(f"ratio   online/offline = {on_rate / off_rate:.1%} (goal >= 90%)")


if __name__ == "__main__":
    main()
