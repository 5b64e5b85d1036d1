"""The media speed options on a CUDA GPU (skipped without one): the FP8 DiT linear's `_scaled_mm` against the
fp32 emulation the CPU tests check, the default path (regional compile, auto attention) and FP8 + step cache on
the tiny pipelines, and the full-size dummy builds. Speed is examples/media_bench.py's; these check the paths run
and stay near the exact one.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("diffusers")

from minisgl_cli.media.image import generate_images  # noqa: E402
from minisgl_cli.media.jobs import ImageJob, ModelSpec  # noqa: E402
from minisgl_cli.media.pipelines import load_pipeline, unload_all  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
FP8_OK = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def _spec(**kw) -> ModelSpec:
    return ModelSpec.create("image", "tiny-z-image", None, device="cuda", load_format="dummy", **kw)


def _image(spec: ModelSpec) -> np.ndarray:
    out = generate_images(load_pipeline(spec), ImageJob("a fox in snow", 64, 64, steps=4, seed=3))
    return np.asarray(out.images[0]).astype(np.float64)


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.skipif(not FP8_OK, reason="FP8 GEMMs need compute capability 8.9+")
def test_fp8_linear_scaled_mm_matches_the_emulation():
    from minisgl_cli.media.fp8 import Fp8Linear

    torch.manual_seed(0)
    dense = torch.nn.Linear(256, 512, bias=True).to("cuda", torch.bfloat16)
    layer = Fp8Linear.of(dense)
    x = torch.randn(3, 77, 256, device="cuda", dtype=torch.bfloat16)
    y = layer(x)
    emulated = layer.to("cpu")(x.cpu()).cuda()  # the CPU branch: quantize / dequantize in fp32
    rel = ((y.double() - emulated.double()).norm() / emulated.double().norm()).item()
    assert y.shape == (3, 77, 512) and y.dtype == torch.bfloat16 and rel < 1e-2, rel


def test_default_cuda_path_compiles_and_matches_eager():
    unload_all()
    eager = _image(_spec(compile=False, attention_backend="sdpa"))
    torch._dynamo.reset()
    default = _image(_spec())  # compile on, auto attention (cuDNN on Hopper)
    assert _psnr(default, eager) > 30


@pytest.mark.skipif(not FP8_OK, reason="FP8 GEMMs need compute capability 8.9+")
def test_fp8_and_step_cache_run_near_the_exact_path():
    unload_all()
    exact = _image(_spec(compile=False))
    fp8 = _image(_spec(compile=False, quantization="fp8"))
    torch._dynamo.reset()
    fast = _image(_spec(quantization="fp8", media_cache="fbcache"))
    print(f"PSNR vs exact: fp8 {_psnr(fp8, exact):.1f} dB, compile+fp8+fbcache {_psnr(fast, exact):.1f} dB")
    assert np.isfinite(fast).all() and _psnr(fp8, exact) > 15


@pytest.mark.parametrize("name,params", [("z-image-turbo", 6.155e9), ("wan2.1-t2v-1.3b", 1.419e9)])
def test_full_size_dummy_builds_on_the_device(name, params):
    from minisgl_cli.media.configs import build_dummy_pipeline

    unload_all()
    torch.cuda.empty_cache()
    start = time.perf_counter()
    pipe = build_dummy_pipeline(name, "cuda", torch.bfloat16)
    torch.cuda.synchronize()
    took = time.perf_counter() - start
    n = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"{name}: built in {took:.1f} s, DiT {n / 1e9:.3f}B")
    assert abs(n - params) / params < 1e-3 and next(pipe.transformer.parameters()).is_cuda
    del pipe
    torch.cuda.empty_cache()
