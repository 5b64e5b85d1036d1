"""Steady-state decode throughput of the engine at several concurrency levels, one process, one run.

    python examples/bench_concurrency.py [--levels 1 4 16] [--new-tokens 64] [--repeat 2]

Each level submits `level` chat prompts at once with ignore_eos, so every request decodes exactly
--new-tokens tokens and the batch stays full (unlike the reference suite, where EOS drains it).
Prints output tok/s per level (best of --repeat: the least disturbed run on a noisy machine).
"""

from __future__ import annotations

import argparse
import time

from minisgl_cli import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    with LLM() as llm:
        llm.generate("warm-up", SamplingParams(max_new_tokens=4))
        print(f"{'concurrency':>12}{'output tok/s':>14}")
        for level in args.levels:
            prompts = [[{"role": "user", "content": f"Tell me a story about the number {i}."}] for i in range(level)]
            params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
            best = 0.0
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                best = max(best, sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
            print(f"{level:>12}{best:>14.1f}", flush=True)


if __name__ == "__main__":
    main()
