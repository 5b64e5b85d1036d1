"""The FP8 DiT attention (kernels/triton/dit_attention.py) at Wan2.1-1.3B's and Z-Image-Turbo's self-attention shapes,
against SDPA in bf16 (cuDNN's and flash's kernels) and, where given, an older copy of the kernel: ms, TFLOPS (4·S²·D
a head), and the cosine to the exact attention; the kernel alone (inputs quantized once) and with its quantization.

    python examples/dit_attention_probe.py [--old .old/dit_attention_old.py] [--configs 128x128x8x3,128x64x4x3w]

A config is BLOCK_MxBLOCK_NxWARPSxSTAGES, a trailing `w` for Triton's warp specialization."""

from __future__ import annotations

import argparse
import functools
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from timing import cuda_ms  # examples/, beside this script

from minisgl_cli.kernels.triton import dit_attention as ours

SHAPES = (("wan 832x480x81", 32760, 12), ("zimage 1024²", 4160, 30))  # (label, tokens, heads), head_dim 128
CONFIGS = "64x128x4x3,64x128x4x2,64x64x4x3,128x128x8x3,128x64x4x3,64x128x4x3w"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="path of an older dit_attention.py to time beside (its fp8_attention)")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    old = None
    if a.old:
        spec = importlib.util.spec_from_file_location("dit_attention_old", a.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | kernel | ms | TFLOPS | with quantization ms | cosine |")
    print("|---|---|---:|---:|---:|---:|")
    for label, s, h in SHAPES:
        probe(label, s, h, old, a.configs.split(","), a.iters)


def probe(label: str, s: int, h: int, old: Any, configs: list[str], iters: int) -> None:
    """The table's rows of one shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    flops = 4 * h * s * s * 128
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float()).transpose(1, 2)

    def row(name: str, ms: float, total: float | None, out: torch.Tensor) -> None:
        cos = F.cosine_similarity(out.float().flatten(), ref.flatten(), dim=0).item()
        tot = "" if total is None else f"{total:.2f}"
        print(f"| {label} | {name} | {ms:.2f} | {flops / ms / 1e9:.0f} | {tot} | {cos:.5f} |", flush=True)

    for name, backend in (("SDPA bf16 cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA bf16 flash",
                                                                           SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            call = functools.partial(F.scaled_dot_product_attention, qt, kt, vt)
            row(name, cuda_ms(call, iters), None, call().transpose(1, 2))
    if old is not None:
        call = functools.partial(old.fp8_attention, q, k, v)
        row("old FP8 kernel", cuda_ms(call, iters), None, call())
    for cfg in configs:
        bm, bn, warps, stages = (int(x) for x in cfg.rstrip("w").split("x"))
        tiles = ours.Tiles(bm, bn, warps, stages, warp_specialize=cfg.endswith("w"))
        try:
            x = ours.quantize_qkv(q, k, v, 128 ** -0.5, bm, bn)
            out = torch.empty_like(q)
            kernel_ms = cuda_ms(functools.partial(ours.attend, x, out, s, tiles), iters)
            total = cuda_ms(functools.partial(ours.fp8_attention, q, k, v, None, tiles), iters)
        except Exception as exc:  # noqa: BLE001 -- a config Triton cannot build is a row, not the end
            print(f"| {label} | FP8 {cfg} | failed: {type(exc).__name__}: {str(exc)[:120]} | | | |", flush=True)
            continue
        row(f"FP8 {cfg}", kernel_ms, total, out)
    call = functools.partial(ours.quantize_qkv, q, k, v, 128 ** -0.5, 128, 128)
    print(f"| {label} | quantize_qkv alone | {cuda_ms(call, iters):.2f} | | | |", flush=True)


if __name__ == "__main__":
    main()
