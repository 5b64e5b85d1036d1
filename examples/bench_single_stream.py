"""Single-stream decode tok/s and start-up time (first and cached) of minisgl vs HF transformers, one run.

    python examples/bench_single_stream.py [--new-tokens 128] [--repeat 3]

Start-up: `first` converts the bundled GGUF into a fresh cache dir (what a new install pays once);
`cached` loads from that cache. Decode: greedy, ignore EOS, one request at a time, same prompt and
weights for both engines; tok/s counts generated tokens over decode time (after the first token).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch


def startup_s(cache_dir: str) -> float:
    """Wall time of a fresh process building the engine (imports included)."""
    code = (
        "from minisgl_cli.engine.engine import Engine; from minisgl_cli.engine.config import EngineConfig; "
        "Engine(EngineConfig())"
    )
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "MINISGL_CACHE_DIR": cache_dir})
    return time.perf_counter() - t0


def hf_startup_s(gguf_dir: str, gguf_file: str) -> float:
    code = ("import torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            f"AutoTokenizer.from_pretrained({gguf_dir!r}, gguf_file={gguf_file!r}); "
            f"AutoModelForCausalLM.from_pretrained({gguf_dir!r}, gguf_file={gguf_file!r}, dtype=torch.float32)")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from minisgl_cli import LLM, SamplingParams
    from minisgl_cli.loader.resolve import default_gguf_path, resolve_model

    gguf = default_gguf_path()
    with tempfile.TemporaryDirectory() as cache:
        first, cached = startup_s(cache), startup_s(cache)
    hf_start = hf_startup_s(str(gguf.parent), gguf.name)

    model_dir = resolve_model(None).path
    messages = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    n = args.new_tokens
    with LLM() as llm:
        ids = llm.client.tokenizer.apply_chat_template(messages)
        params = SamplingParams(max_new_tokens=n, ignore_eos=True)
        llm.generate(ids, SamplingParams(max_new_tokens=8))  # warm-up
        ours = []
        for _ in range(args.repeat):
            s = llm.generate(ids, params)[0].stats
            ours.append(s.decode_tok_s)

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    theirs = []
    with torch.no_grad():
        hf.generate(x, max_new_tokens=8, do_sample=False)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            hf.generate(x, max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            t2 = time.perf_counter()
            theirs.append((n - 1) / ((t2 - t1) - (t1 - t0)))

    best = lambda xs: max(xs)  # noqa: E731  (best of N: the least disturbed run on a noisy machine)
    print(f"threads={torch.get_num_threads()} prompt_tokens={len(ids)} new_tokens={n} repeat={args.repeat}")
    print(f"{'':28}{'minisgl':>10}{'HF':>10}{'ratio':>8}")
    print(f"{'decode tok/s (batch 1)':28}{best(ours):>10.1f}{best(theirs):>10.1f}{best(ours) / best(theirs):>8.2f}")
    print(f"{'start-up s, first (convert)':28}{first:>10.1f}{hf_start:>10.1f}")
    print(f"{'start-up s, cached':28}{cached:>10.1f}{hf_start:>10.1f}")


if __name__ == "__main__":
    main()
