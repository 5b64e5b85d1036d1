"""Probe: one DiT denoise step of Z-Image-Turbo (1024²) and Wan2.1-1.3B (832x480x81) at full size with random
weights, under each attention kernel, regional compile and FP8 weights (ours through torch._scaled_mm, torchao's).

    python examples/media_probe.py [--only zimage|wan] [--tiny]

Prints one line a variant: ms a step (median of the timed calls) and the first call's seconds (compile)."""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from torch import nn


class Fp8Linear(nn.Module):
    """A linear whose weight is FP8 e4m3 with one scale an output row; activations scaled per token at run time."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w = lin.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        self.weight = nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(scale.t().contiguous(), requires_grad=False)  # (1, N)
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach(), requires_grad=False)
        self.out_features = lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        xs = x2.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
        xq = (x2 / xs).to(torch.float8_e4m3fn)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=self.scale, bias=self.bias,
                               out_dtype=x.dtype)
        return out.reshape(*shape[:-1], self.out_features)


def to_fp8(model: nn.Module, blocks_attr: list[str]) -> int:
    n = 0
    for attr in blocks_attr:
        for block in getattr(model, attr):
            for mod in list(block.modules()):
                for cname, child in list(mod.named_children()):
                    if isinstance(child, nn.Linear) and child.in_features % 16 == 0 and child.out_features % 16 == 0:
                        setattr(mod, cname, Fp8Linear(child))
                        n += 1
    return n


def timed(fn, warm: int = 2, reps: int = 5) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(warm - 1):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, first


def zimage(tiny: bool) -> tuple[nn.Module, callable]:
    from diffusers import ZImageTransformer2DModel

    cfg = dict(dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30, cap_feat_dim=2560,
               axes_lens=[1536, 512, 512])
    if tiny:
        cfg.update(dim=256, n_layers=2, n_heads=2, n_kv_heads=2, cap_feat_dim=64, axes_dims=[32, 48, 48])
    with torch.device("cuda"):
        model = ZImageTransformer2DModel(**cfg).to(torch.bfloat16).eval()
    lat = [torch.randn(16, 1, 128, 128, device="cuda", dtype=torch.bfloat16)]
    cap = [torch.randn(96, cfg["cap_feat_dim"], device="cuda", dtype=torch.bfloat16)]
    t = torch.tensor([0.5], device="cuda")

    def step():
        with torch.inference_mode():
            return model(lat, t, cap, return_dict=False)[0][0]

    return model, step


def wan(tiny: bool) -> tuple[nn.Module, callable]:
    from diffusers import WanTransformer3DModel

    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6)
    if tiny:
        cfg.update(num_layers=2, num_attention_heads=2, ffn_dim=256, text_dim=64)
    with torch.device("cuda"):
        model = WanTransformer3DModel(**cfg).to(torch.bfloat16).eval()
    x = torch.randn(1, 16, 21, 60, 104, device="cuda", dtype=torch.bfloat16)
    ctx = torch.randn(1, 512, cfg["text_dim"], device="cuda", dtype=torch.bfloat16)
    t = torch.tensor([500], device="cuda")

    def step():
        with torch.inference_mode():
            return model(x, t, ctx, return_dict=False)[0]

    return model, step


def sage() -> None:
    """SageAttention alone at Wan's and Z-Image's self-attention shapes, against SDPA (bf16); our FP8 kernel's figures
    at the same shapes: examples/dit_attention_probe.py."""
    import torch.nn.functional as F
    from sageattention import sageattn

    for label, s, h in (("wan 832x480x81", 32760, 12), ("zimage 1024", 4224, 30)):
        q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        ms_ref, _ = timed(functools.partial(F.scaled_dot_product_attention, qt, kt, vt))
        out = sageattn(q, k, v, tensor_layout="NHD")
        ms, first = timed(functools.partial(sageattn, q, k, v, tensor_layout="NHD"))
        cos = F.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0).item()
        print(f"{label}: sdpa {ms_ref:.2f} ms, sage {ms:.2f} ms (first {first:.1f} s), cosine {cos:.5f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["zimage", "wan"])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--sage", action="store_true",
                    help="time SageAttention 1.x (Triton, INT8 QK) alone against SDPA")
    args = ap.parse_args()
    if args.sage:
        return sage()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for name in ("torchao", "cache_dit", "diffusers"):
        try:
            mod = __import__(name)
            print(f"{name} {getattr(mod, '__version__', '?')} imports", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"{name} does not import: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    from diffusers.models.attention_dispatch import attention_backend

    for label, build, blocks in (("zimage", zimage, ["layers", "noise_refiner", "context_refiner"]),
                                 ("wan", wan, ["blocks"])):
        if args.only and args.only != label:
            continue
        model, step = build(args.tiny)
        ref = step().float()
        for backend in ("native", "_native_cudnn", "_native_flash", "_native_efficient", "flex"):
            try:
                with attention_backend(backend):
                    ms, first = timed(step, reps=3)
                    err = (step().float() - ref).abs().max().item()
                print(f"{label} eager attn={backend}: {ms:.1f} ms/step (max |diff| {err:.3g})", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"{label} eager attn={backend}: fails {type(exc).__name__}: {str(exc)[:160]}", flush=True)
        for backend in ("native", "_native_cudnn"):
            torch._dynamo.reset()
            model.compile_repeated_blocks(fullgraph=True)
            with attention_backend(backend):
                ms, first = timed(step)
            print(f"{label} regional compile attn={backend}: {ms:.1f} ms/step (first call {first:.1f} s)", flush=True)
        n = to_fp8(model, blocks)
        torch._dynamo.reset()
        with attention_backend("_native_cudnn"):
            ms, first = timed(step, reps=3)
            err = (step().float() - ref).abs().max().item()
            print(f"{label} fp8 eager ({n} linears): {ms:.1f} ms/step (max |diff| vs bf16 {err:.3g})", flush=True)
            model.compile_repeated_blocks(fullgraph=True)
            ms, first = timed(step)
            print(f"{label} fp8 + regional compile: {ms:.1f} ms/step (first call {first:.1f} s)", flush=True)
        del model, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
