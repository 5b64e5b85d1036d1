"""CPU decode attention as the torch backend runs it: minisgl::decode_attn (each row over its own keys, read in place)
against SDPA over the keys gathered and padded to the batch's longest row (what it replaced; still the path where the
kernel is not built). SmolLM2-135M's shapes (9 query heads over 3 KV heads of 64), a bf16 pool, every row's context
near --context tokens, one layer's call timed and multiplied by the model's 30 layers.

    python examples/bench_cpu_attention.py [--rows 1 4 16] [--context 300] [--threads N]

Then how often SDPA rounds a row by the padding beside it: rows of every length 1..--probe-len, each attended with
its keys padded to a multiple of 16 and then to 16, 32 .. 128 more (a longer row beside it), counting the rows whose
output changes (random data; the kernel's rows never do: tests/test_cpu_decode_attn.py).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from minisgl_cli.attention.torch_backend import TorchBackend, TorchDecodeMeta, decode_mask
from minisgl_cli.kvcache.pool import KVPool, KVShape

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def _timed(fn, args: tuple, repeat: int) -> float:
    for _ in range(5):
        fn(*args)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn(*args)
    return (time.perf_counter() - t0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--probe-len", type=int, default=400)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    pool = KVPool(KVShape(1, KV_HEADS, DIM, torch.bfloat16), num_pages=8192, page_size=1, max_reqs=64,
                  max_context_len=4096, device="cpu")
    pool.k[0].normal_()
    pool.v[0].normal_()
    attn = TorchBackend(pool, HEADS, KV_HEADS, DIM, DIM**-0.5)
    if not attn.own_decode:
        raise SystemExit("minisgl's CPU kernels are not built here (kernels/cpu/library.py)")
    sdpa_attn = copy.copy(attn)  # the same pool, attending as where the kernels are not built
    sdpa_attn.own_decode = False
    print(f"threads={torch.get_num_threads()}, context ~{args.context}; ms a step (x{LAYERS} layers)")
    print(f"{'rows':>5}{'gather + SDPA':>15}{'decode_attn':>13}{'x':>7}")
    for rows in args.rows:
        lens = torch.randint(args.context - 16, args.context + 16, (rows,))
        width = -(-int(lens.max()) // 16) * 16
        slots = 1 + torch.arange(rows * width).view(rows, width)  # each row's keys in a run of slots, as allocated
        q = torch.randn(rows, HEADS, DIM).to(torch.bfloat16)
        own = TorchDecodeMeta(slots.reshape(-1), width, lens, None)
        sdpa = TorchDecodeMeta(slots.reshape(-1), width, lens, decode_mask(lens, width, torch.bfloat16))
        t_sdpa = _timed(sdpa_attn.decode, (q, 0, sdpa), args.repeat)
        t_own = _timed(attn.decode, (q, 0, own), args.repeat)
        print(f"{rows:>5}{t_sdpa * LAYERS * 1e3:>15.2f}{t_own * LAYERS * 1e3:>13.2f}{t_sdpa / t_own:>7.1f}")
    if args.probe_len < 1:
        return
    changed = total = 0
    for n in range(1, args.probe_len + 1):
        q = torch.randn(1, HEADS, DIM).to(torch.bfloat16)
        slots = 1 + torch.arange(-(-n // 16) * 16 + 128)[None]
        outs = []
        for extra in range(0, 129, 16):
            width = -(-n // 16) * 16 + extra
            meta = TorchDecodeMeta(slots[:, :width].reshape(-1), width, torch.tensor([n]),
                                   decode_mask(torch.tensor([n]), width, torch.bfloat16))
            outs.append(sdpa_attn.decode(q, 0, meta))
        total += 1
        changed += any(not torch.equal(o, outs[0]) for o in outs[1:])
    print(f"SDPA: {changed} of {total} rows ({100 * changed / total:.1f}%) change with the padding beside them")


if __name__ == "__main__":
    main()
