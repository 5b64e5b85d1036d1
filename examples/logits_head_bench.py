"""The quantized models' int8 LM head on the CPU: one 8-bit activation row against two (codes, then remainder).

Times `Int8LogitsMethod.apply` (two 8-bit rows a row, as shipped) beside the one-row form it replaced, at the default
model's head shape (SmolLM2: 49,152 x 576), with one outlier feature in each activation row as real hidden states
have, and prints each form's largest error against the exact product with the same int8 weights.

    PYTHONPATH=. python examples/logits_head_bench.py [--rows 1,4] [--outlier 60]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from minisgl_cli.layers import quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--outlier", type=float, default=60.0, help="one feature's value in every row (0: none)")
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    q = quant.quantize_int8(torch.randn(args.vocab, args.hidden) * 0.05)
    head: Any = SimpleNamespace()  # what Int8LogitsMethod.finish leaves on a layer
    head.fbgemm = quant._fbgemm_pack(F.pad(q.q, (0, quant._ANCHORS.shape[1])), q.scale[:, 0])
    if head.fbgemm is None:
        head.qweight_t, head.qscale = q.q.t(), q.scale[:, 0]

    def one_row(x: torch.Tensor) -> torch.Tensor:
        """The form before: each activation row as one 8-bit row, fbgemm's range anchored at +-127."""
        s = x.abs().amax(-1, keepdim=True).clamp_(min=1e-12) / 127
        if head.fbgemm is not None:
            xa = torch.cat([(x / s).clamp_(-127, 127), torch.tensor([[127.0, -127.0]]).expand(x.shape[0], -1)], dim=1)
            return torch.ops.quantized.linear_dynamic(xa, head.fbgemm, False) * s
        return torch._int_mm((x / s).round_().to(torch.int8), head.qweight_t) * s * head.qscale

    def two_rows(x: torch.Tensor) -> torch.Tensor:
        return quant.Int8LogitsMethod().apply(head, x, None)

    forms: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [("one 8-bit row", one_row),
                                                                     ("two 8-bit rows", two_rows)]
    print(f"kernel: {'fbgemm' if head.fbgemm is not None else 'torch._int_mm'}, head {args.vocab} x {args.hidden}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, args.hidden)
        x[:, 7] = args.outlier
        exact = x @ (q.q.float() * q.scale).t()
        for name, form in forms:
            for _ in range(5):
                form(x)
            t0 = time.perf_counter()
            for _ in range(args.runs):
                y = form(x)
            us = (time.perf_counter() - t0) / args.runs * 1e6
            print(f"rows {rows} {name:15s} {us:8.1f} µs  max |error| {(y - exact).abs().max().item():.4f} "
                  f"(logits up to {exact.abs().max().item():.1f})")


if __name__ == "__main__":
    main()
