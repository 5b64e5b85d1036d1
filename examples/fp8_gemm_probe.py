"""FP8 GEMMs at a DiT's shapes: bf16 `mm` against `torch._scaled_mm` with row-wise scales (what
media/fp8.py runs) and with one scale a tensor, TFLOPS of each (CUDA events over a warm loop).

    python examples/fp8_gemm_probe.py                       # Z-Image-Turbo's linears at 1024² (4,096 + 64 tokens)
    python examples/fp8_gemm_probe.py --tokens 32760 --shapes 1536x1536,1536x8960,8960x1536   # Wan2.1-1.3B's
"""

from __future__ import annotations

import argparse

import torch
from timing import cuda_ms  # examples/, beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4160)
    ap.add_argument("--shapes", default="3840x3840,3840x10240,10240x3840", help="KxN of each linear")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    e4m3 = torch.float8_e4m3fn
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, M = {a.tokens}")
    print("| K x N | bf16 ms (TFLOPS) | FP8 row-wise ms (TFLOPS) | FP8 tensor-wise ms (TFLOPS) |")
    print("|---|---:|---:|---:|")
    for shape in a.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        x = torch.randn(a.tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
        xq, wq = x.to(e4m3), w.to(e4m3)
        sa, sb = torch.ones(a.tokens, 1, device="cuda"), torch.ones(1, n, device="cuda")
        one = torch.ones((), device="cuda")
        flops = 2 * a.tokens * k * n
        calls = [lambda x=x, w=w: x @ w.t(),
                 lambda xq=xq, wq=wq, sa=sa, sb=sb: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb,
                                                                      out_dtype=torch.bfloat16),
                 lambda xq=xq, wq=wq, one=one: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                                 out_dtype=torch.bfloat16)]
        rows = [cuda_ms(call, a.iters) for call in calls]
        cells = " | ".join(f"{ms:.3f} ({flops / ms / 1e9:.0f})" for ms in rows)
        print(f"| {k} x {n} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
