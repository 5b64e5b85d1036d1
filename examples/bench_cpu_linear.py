"""The CPU GEMM kernels for one decode step of SmolLM2-135M, per kernel and batch size: what layers/quant.py picks from.

    python examples/bench_cpu_linear.py [--rows 1 4 8 16 32 128] [--repeat 10] [--threads N]

Each kernel multiplies `rows` activations by all 30 layers' weights (qkv, o, gate_up, down: 30 copies, so
the 80-540 MB stream from memory as in a real step, not from cache) and by the LM head [49152, 576];
prints the best time of `--repeat` in ms. Kernels (PyTorch's own but int4-minisgl):

  fp32-mkl     F.linear, fp32 (MKL sgemm)
  fp32-onednn  oneDNN with the weight packed once, fp32 (layers/cpu_gemm.py for 2..64 rows)
  bf16-onednn  the same in bf16 (--dtype bfloat16)
  int4         aten._weight_int4pack_mm_for_cpu, groups of 32 with scale and zero, bf16 activations
  int4-minisgl minisgl::int4_mm (kernels/cpu/int4.py), the same groups, AVX512-BF16 pair dot products
  int8         aten._weight_int8pack_mm, int8 per channel, bf16 activations
  int8-int8    torch._int_mm on int8 weights and int8 activations (scaled per row), fp32 out
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
KERNELS = ("fp32-mkl", "fp32-onednn", "bf16-onednn", "int4", "int4-minisgl", "int8", "int8-int8")


def make(kernel: str, n: int, k: int):
    """(weights, function x -> x W^T) for one [n, k] matrix."""
    w = torch.randn(n, k) * 0.02
    if kernel == "fp32-mkl":
        return lambda x: F.linear(x, w)
    if kernel in ("fp32-onednn", "bf16-onednn"):
        packed = torch.ops.mkldnn._reorder_linear_weight(w if kernel == "fp32-onednn" else w.bfloat16(), None)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kernel == "int4-minisgl":
        from minisgl_cli.kernels.cpu import int4 as cpu_int4

        assert cpu_int4.kernel() == "minisgl", "this CPU or build runs ATen's int4 kernel"
        scale = torch.rand(n, k // 32) * 0.01
        q4, sm = cpu_int4.pack(torch.randint(0, 16, (n, k), dtype=torch.uint8), scale, -8 * scale)
        return lambda x: cpu_int4.mm(x, q4, sm)
    if kernel == "int4":
        q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        scale_zero = (torch.rand(k // 32, n, 2) * 0.01).bfloat16()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, q, 32, scale_zero)
    q8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n) * 0.01
    if kernel == "int8":
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q8, scale.bfloat16())

    def int8_int8(x: torch.Tensor) -> torch.Tensor:
        s = x.abs().amax(-1, keepdim=True) / 127
        return torch._int_mm((x / s).round().to(torch.int8), q8.t()) * s * scale

    return int8_int8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 128])
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, "
          f"avx512_bf16={torch.cpu._is_avx512_bf16_supported()}; best of {args.repeat}, ms for all 30 layers + head")
    print(f"{'kernel':12s} {'rows':>5s} {'total':>8s} " + " ".join(f"{n:>8s}" for n in SHAPES))
    with torch.inference_mode():
        for kernel in args.kernels:
            dtype = torch.bfloat16 if kernel in ("bf16-onednn", "int4", "int4-minisgl", "int8") else torch.float32
            fns = {name: [make(kernel, *shape) for _ in range(1 if name == "head" else LAYERS)]
                   for name, shape in SHAPES.items()}
            for rows in args.rows:
                best = {}
                for name, shape in SHAPES.items():
                    x = torch.randn(rows, shape[1]).to(dtype)
                    times = []
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        for fn in fns[name]:
                            fn(x)
                        times.append(time.perf_counter() - t0)
                    best[name] = min(times) * 1e3
                cells = " ".join(f"{v:8.2f}" for v in best.values())
                print(f"{kernel:12s} {rows:5d} {sum(best.values()):8.2f} {cells}", flush=True)


if __name__ == "__main__":
    main()
