"""The one-row GEMV's block shapes judged end to end: one engine's batch-1 decode tok/s with some layers' shapes
overridden (`gemv.pick_config` wrapped in this process), variant after variant, the picks first and last.

`gpu_bench.py --only gemv --sweep` times a GEMV after a copy of itself. In a decode step a GEMV follows other kernels
(o_proj the attention, qkv and gate-up a norm), and under programmatic dependent launch its programs load their
first chunk of weights while that kernel still runs: a shape that asks for more of its weight up front can win there
and lose back to back.

    python examples/gemv_e2e.py --model llama-3.1-8b --variant o=4096x4096:1,4096,4 \
        --variant "o+qkv=4096x4096:1,4096,4;6144x4096:2,4096,8"

A variant is NAME=LAYER:CONFIG[;LAYER:CONFIG...]; LAYER is NxK (weight rows x columns), NxKa for a down projection
(the SiLU-and-mul on its input); CONFIG is gemv.Config's tuple (a 5-tuple applies to FP8 weights only, a 3-tuple to
16-bit ones: an FP8 model keeps some layers 16-bit). Each variant recaptures the graphs, decodes 16 tokens to warm,
then --repeats times one request of a 128-token prompt and --tokens new tokens (greedy, overlap).
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from gpu_bench import make_engine, run_requests  # examples/, beside this script

Override = dict[tuple[int, int, bool], tuple[int, ...]]


def parse(spec: str) -> tuple[str, Override]:
    name, _, body = spec.partition("=")
    out: Override = {}
    for part in filter(None, body.split(";")):
        layer, _, cfg = part.partition(":")
        act = layer.endswith("a")
        n, k = (int(v) for v in layer.rstrip("a").split("x"))
        out[(n, k, act)] = tuple(int(v) for v in cfg.split(","))
    return name, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--variant", action="append", default=[], help="NAME=NxK:CONFIG[;...] (repeatable)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemv_e2e.py times the one-row GEMV's CUDA kernels, and this machine has no CUDA device")

    from minisgl_cli.kernels.triton import gemv as G

    picks = G.pick_config
    override: Override = {}

    def pick(n: int, k: int, act_mul: bool = False, itemsize: int = 2) -> tuple[int, ...]:
        cfg = override.get((n, k, act_mul))
        fits = cfg is not None and (len(cfg) == 5) == (itemsize == 1)  # FP8's tensor-core shapes: e4m3 weights only
        return cfg if cfg is not None and fits else picks(n, k, act_mul, itemsize)

    G.pick_config = pick
    e = make_engine(args.model, quantization=args.quantization, max_running_requests=8, cuda_graph_max_bs=8,
                    max_total_tokens=32_768)
    g = random.Random(0)
    prompt = [[g.randint(0, 10000) for _ in range(128)]]
    variants = [("picks", {}), *(parse(v) for v in args.variant), ("picks again", {})]
    print(f"\n{torch.cuda.get_device_name()}, {args.model} ({e.quantization}), batch 1, {args.tokens} new tokens")
    print(f"{'variant':<24}{'tok/s':>9}{'runs':>20}  overrides")
    base = None
    for name, ov in variants:
        override.clear()
        override.update(ov)
        e.capture_graphs()
        run_requests(e, prompt, [16], overlap=True)
        runs = []
        for _ in range(args.repeats):
            st = run_requests(e, prompt, [args.tokens], overlap=True)
            runs.append((st.tokens - 1) / (st.last_tok - st.first_tok))
        tps = statistics.median(runs)
        base = base or tps
        shown = "; ".join(f"{n}x{k}{'a' if a else ''}:{','.join(map(str, c))}" for (n, k, a), c in ov.items())
        print(f"{name:<24}{tps:>9.1f}{' / '.join(f'{r:.1f}' for r in runs):>20}  {tps / base:.3f}x  {shown}",
              flush=True)


if __name__ == "__main__":
    with torch.no_grad():
        main()
