"""The FP8 DiT linears' activation quantization at Wan's and Z-Image's shapes: what a compiled block runs for "bias +
GELU / SiLU-and-mul / nothing, then e4m3 codes and a scale a token" (the input of the next FP8 GEMM), ms and GB/s
(bytes in + out), and how many codes differ from inductor's.

    python examples/fp8_act_quant_probe.py

Candidates: inductor's fusion of kernels/fp8.py's torch ops (what media/fp8.py shipped before its Fp8MLP; a
multi-pass reduction on wide rows), the same with inductor's multi-kernel choice (persistent or looped reduction
picked by timing), the activation in eager torch then the engine's quant_rows, the engine's quant_rows with the
activation fused, dividing by the scale (IEEE, torch's codes) or multiplying by its reciprocal (what Fp8MLP runs).
"""

from __future__ import annotations

import functools

import torch
from timing import cuda_ms  # examples/, beside this script

from minisgl_cli.kernels import fp8

SHAPES = (("wan FFN (GELU-tanh)", 32760, 8960, "gelu_tanh"), ("z-image FFN (SiLU-and-mul)", 4160, 10240, "silu_mul"),
          ("wan norm output", 32760, 1536, "none"), ("z-image norm output", 4160, 3840, "none"))


def act(kind: fp8.Act, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """kind's activation of x (+ b); silu_mul: x is [gate | up]."""
    return fp8.activate(x if b is None else x + b, kind)


def torch_path(kind: fp8.Act, x: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8.quantize_rows(act(kind, x, b))


def eager_then_engine(kind: fp8.Act, x: torch.Tensor, b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from minisgl_cli.kernels.triton.fp8 import quant_rows

    return quant_rows(act(kind, x, b), pdl=False)


def engine_fused(exact: bool, kind: fp8.Act, x: torch.Tensor,
                 b: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    from minisgl_cli.kernels.triton.fp8 import quant_rows

    return quant_rows(x, kind, b, exact, pdl=False)


def main() -> None:
    import torch._inductor.config as inductor_config

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | path | ms | GB/s | codes unlike inductor's |")
    print("|---|---|---:|---:|---:|")
    for label, m, k, kind in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(m, 2 * k if kind == "silu_mul" else k, device="cuda", dtype=torch.bfloat16, generator=g)
        u = torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=g) if kind == "gelu_tanh" else None  # bias
        nbytes = h.numel() * 2 + m * k
        torch._dynamo.reset()
        inductor_config.triton.multi_kernel = 0
        ref = torch.compile(functools.partial(torch_path, kind))
        want = ref(h, u)[0]
        paths = [("inductor (before)", ref)]
        for name, fn in (("inductor multi-kernel", None), ("eager act + engine quant_rows", eager_then_engine),
                         ("engine quant_rows, act fused, IEEE division", functools.partial(engine_fused, True)),
                         ("engine quant_rows, act fused, reciprocal (Fp8MLP)", functools.partial(engine_fused, False))):
            if fn is None:
                torch._dynamo.reset()
                inductor_config.triton.multi_kernel = 1
                fn = torch.compile(functools.partial(torch_path, kind))
                fn(h, u)
                inductor_config.triton.multi_kernel = 0
            else:
                fn = functools.partial(fn, kind)
            paths.append((name, fn))
        for name, fn in paths:
            try:
                ms = cuda_ms(functools.partial(fn, h, u), 20)
                differ = (fn(h, u)[0].view(torch.uint8) != want.view(torch.uint8)).float().mean().item()
            except Exception as exc:  # noqa: BLE001 -- a candidate that does not build is a row
                print(f"| {label} | {name} | failed: {type(exc).__name__}: {str(exc)[:100]} | | |", flush=True)
                continue
            print(f"| {label} | {name} | {ms:.3f} | {nbytes / ms / 1e6:.0f} | {differ:.2%} |", flush=True)


if __name__ == "__main__":
    main()
