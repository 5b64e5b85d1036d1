"""Host cost of a plain request: CPU seconds per generated token on a tiny random model, where the Python work
of scheduling, sampling and output handling (not the matmuls) is most of a step.

Run it once per checkout to compare (A/B, interleaved), e.g. before/after a change to the request path:

    for i in 1 2 3; do for d in /tmp/base /path/to/branch; do
        PYTHONPATH=$d python examples/bench_plain_overhead.py --label $d; done; done

Prints one JSON line: wall tok/s and process CPU ms per token (CPU time is steadier than wall time on a
shared machine), for `--requests` greedy requests of `--tokens` tokens each, all in flight together.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, torch_dtype="float32")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from minisgl_cli import LLM, SamplingParams
    from minisgl_cli.loader.configs import BUILTIN_CONFIGS

    BUILTIN_CONFIGS["bench-tiny"] = TINY
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40000, (16,), generator=g).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    with LLM("bench-tiny", load_format="dummy", max_total_tokens=args.requests * (args.tokens + 32)) as llm:
        llm.generate(prompts[:4], params)  # warm-up
        best_wall, best_cpu = float("inf"), float("inf")
        for _ in range(args.rounds):
            w0, c0 = time.perf_counter(), time.process_time()
            out = llm.generate(prompts, params)
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            best_wall, best_cpu = min(best_wall, wall), min(best_cpu, cpu)
    n = sum(len(o.token_ids) for o in out)
    print(json.dumps({"label": args.label, "tokens": n, "wall_tok_s": round(n / best_wall, 1),
                      "cpu_ms_per_token": round(1000 * best_cpu / n, 3)}))


if __name__ == "__main__":
    main()
