"""Radix-cache hit rate and throughput of each --scheduler-mode over --dp replicas, in one run.

The workload is the one cache-aware routing is for: chats that each start with one of K distinct system prompts
(drawn at random, seeded) and end in a short question. Each replica's KV pool holds about two of the prompts,
so a mode that spreads every prompt over every replica (rr, random, fsfs) keeps evicting them, while
cache_aware keeps each prompt on one replica. Every mode runs on the same replicas with its own fresh prompts;
`--dp 1` (one replica of the same size) runs the same workload for scale.

    python examples/dp_routing.py                                  # default model on the CPU
    python examples/dp_routing.py --model qwen3-0.6b --load-format dummy --max-total-tokens 20000 --prefix-words 4000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from minisgl_cli.client.protocol import complete
from minisgl_cli.dispatch import DISPATCH_POLICIES
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.runtime.launch import launch
from minisgl_cli.runtime.pool import EnginePool
from minisgl_cli.scheduler.config import SchedulerConfig
from minisgl_cli.types import GenerateRequest, SamplingParams

WORDS = ("library book shelf loan reader catalogue index author title chapter page margin note archive "
         "binding spine cover edition volume series").split()


def workload(seed: int, prefixes: int, words: int, requests: int) -> list[list[dict]]:
    rng = random.Random(seed)
    systems = [f"You are assistant {seed}-{k}. " + " ".join(rng.choice(WORDS) for _ in range(words))
               for k in range(prefixes)]
    return [[{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": f"Question {q}?"}]
            for q in range(requests)]


def run(client, replicas, chats: list[list[dict]], concurrency: int, new_tokens: int) -> dict:
    before = [r.stats() for r in replicas]
    queue = list(chats)

    async def worker() -> int:
        tokens = 0
        while queue:
            msgs = queue.pop(0)
            done = await complete(client, GenerateRequest(
                messages=msgs, params=SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))
            tokens += len(done.token_ids)
        return tokens

    async def all_workers() -> int:
        return sum(await asyncio.gather(*(worker() for _ in range(concurrency))))

    t0 = time.perf_counter()
    tokens = asyncio.run(all_workers())
    wall = time.perf_counter() - t0
    after = [r.stats() for r in replicas]
    hit = sum(a.cache_hit_tokens - b.cache_hit_tokens for a, b in zip(after, before))
    miss = sum(a.cache_miss_tokens - b.cache_miss_tokens for a, b in zip(after, before))
    routed = [a.finished_requests - b.finished_requests for a, b in zip(after, before)]
    return {"hit_rate": hit / max(hit + miss, 1), "routed": routed, "tok_s": tokens / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--max-total-tokens", type=int, default=1200, help="KV tokens per replica")
    ap.add_argument("--prefixes", type=int, default=4, help="distinct system prompts")
    ap.add_argument("--prefix-words", type=int, default=380)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--modes", nargs="+", default=list(DISPATCH_POLICIES))
    args = ap.parse_args()
    engine = EngineConfig(model=args.model, load_format=args.load_format, device=args.device,
                          max_total_tokens=args.max_total_tokens)
    rows = []
    for dp in (1, args.dp):
        pool = launch(engine, SchedulerConfig(), RuntimeConfig(dp_size=dp), progress=print)
        replicas = pool.replicas if isinstance(pool, EnginePool) else [pool]
        try:  # a few untimed chats first: the first steps of a process pay for lazy initialisation
            run(pool, replicas, workload(1, args.prefixes, 8, 4 * dp), args.concurrency, 2)
            modes = ["rr"] if dp == 1 else args.modes
            for seed, mode in enumerate(modes, start=dp * 100):
                client = EnginePool(replicas, mode) if dp > 1 else pool
                chats = workload(seed, args.prefixes, args.prefix_words, args.requests)
                rows.append((dp, mode if dp > 1 else "-", run(client, replicas, chats, args.concurrency,
                                                              args.max_new_tokens)))
        finally:
            pool.close()
    base = rows[0][2]["tok_s"]
    print(f"\n{args.requests} chats, {args.prefixes} system prompts of ~{args.prefix_words} words, "
          f"{args.max_new_tokens} new tokens, concurrency {args.concurrency}, {args.max_total_tokens} KV tokens "
          "per replica")
    print(f"{'dp':>3} {'mode':<12} {'radix hit rate':>15} {'requests per replica':>22} {'out tok/s':>10} "
          f"{'vs dp 1':>8}")
    for dp, mode, r in rows:
        print(f"{dp:>3} {mode:<12} {r['hit_rate']:>15.1%} {' / '.join(map(str, r['routed'])):>22} "
              f"{r['tok_s']:>10.1f} {r['tok_s'] / base:>8.2f}")


if __name__ == "__main__":
    main()
