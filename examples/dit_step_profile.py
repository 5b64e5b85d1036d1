"""Where one DiT call spends its GPU time, for variants of the shipped path (load_pipeline with --load-format dummy:
the pipeline the server runs), by kernel class and the top kernels of a warm call under torch.profiler. Wan2.1-1.3B
at 832x480x81 (32,760 tokens, the text's 512) or Z-Image-Turbo at 1024² (4,096 tokens, a 96-token caption).

    python examples/dit_step_profile.py [--model z-image-turbo] [--variants compile,compile+fp8+fp8attn]

A variant is media_bench.py's tokens (compile, fp8, fp8attn, ...)."""

from __future__ import annotations

import argparse
import gc

import torch
from media_bench import parse  # examples/, beside this script
from media_profile import profile_call


def inputs(model: str) -> tuple:
    """A denoiser call's arguments at the model's size, seeded."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    if model.startswith("wan"):
        return randn(1, 16, 21, 60, 104), torch.tensor([500], device="cuda"), randn(1, 512, 4096)
    return [randn(16, 1, 128, 128)], torch.tensor([0.5], device="cuda"), [randn(96, 2560)]


def run(model: str, variant: str) -> None:
    from minisgl_cli.media.jobs import ModelSpec
    from minisgl_cli.media.pipelines import load_pipeline, unload_all

    opts = parse(variant)
    unload_all()
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    kind = "video" if model.startswith("wan") else "image"
    spec = ModelSpec.create(kind, model, None, device="cuda", load_format="dummy",
                            compile=opts["compile"], attention_backend=opts["attention_backend"],
                            quantization=opts["quantization"], media_cache=None, cuda_graphs=opts["cuda_graphs"])
    dit = load_pipeline(spec).pipe.transformer
    args = inputs(model)

    def call() -> None:
        with torch.inference_mode():
            dit(*args, return_dict=False)

    for _ in range(2):  # the compile, then a warm call
        call()
    torch.cuda.synchronize()
    r = profile_call(call)
    classes = ", ".join(f"{k} {v:.1f}" for k, v in r["class_ms"].items())
    print(f"## {model} {variant}: wall {r['wall_ms']:.1f} ms, GPU busy {r['busy_ms']:.1f} ms, {r['kernels']} kernels; "
          f"ms by class: {classes}", flush=True)
    for name, ms, n in r["top"]:
        print(f"  {ms:8.2f} ms  {n:5d}x  {name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="wan2.1-t2v-1.3b", choices=["wan2.1-t2v-1.3b", "z-image-turbo"])
    ap.add_argument("--variants", default="compile,compile+fp8+fp8attn")
    a = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for variant in a.variants.split(","):
        run(a.model, variant)


if __name__ == "__main__":
    main()
