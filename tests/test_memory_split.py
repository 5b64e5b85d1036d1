"""Room for the media worker on a GPU it shares with the text engine: the worker's memory estimate (media/memory.py)
and the KV pool's split of the free memory (engine/kv_budget.py), as functions of the numbers a GPU would give."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from minisgl_cli.engine.config import EngineConfig, KeepFree
from minisgl_cli.engine.kv_budget import Split, shares_device, split
from minisgl_cli.media.memory import REMEDY, estimate, keep_free, loadable
from minisgl_cli.media.settings import MediaSettings

GIB = 1 << 30
MEDIA = KeepFree("cuda", 30 * GIB, "the media worker (z-image-turbo)", REMEDY)


def test_z_image_turbo_estimate_is_its_dit_encoder_and_vae_in_bf16():
    pytest.importorskip("diffusers")
    from minisgl_cli.media.configs import parameter_counts

    counts = parameter_counts("z-image-turbo")
    assert round(counts["transformer"] / 1e9, 2) == 6.15  # the 6.15B DiT of the public checkpoint
    assert round(counts["text_encoder"] / 1e9, 2) == 4.02  # Qwen3-4B, no LM head
    assert 80e6 < counts["vae"] < 90e6  # the FLUX VAE
    media = estimate(MediaSettings(image_model="z-image-turbo", load_format="dummy"), ["image"])
    assert media.weights == {"z-image-turbo": 2 * sum(counts.values())}  # ~20.5 GB
    # Four 1024x1024 images a call (--media-max-batch 4): their VAE decode, with margin, and the worker's overhead;
    # the CUDA graphs' pool and buffers (media/graphs.py) on top unless they are off.
    assert media.describe() == "z-image-turbo 19.1 GiB of weights + 14.5 GiB for a batch of 4 images of 1024x1024"
    eager = estimate(MediaSettings(image_model="z-image-turbo", load_format="dummy", cuda_graphs=False), ["image"])
    assert 9 * GIB < eager.activations < 10 * GIB and media.activations - eager.activations == 5 * GIB
    # a step cache keeps the blocks eager (media/pipelines.py's block_stacks): nothing for their graphs
    cached = estimate(MediaSettings(image_model="z-image-turbo", load_format="dummy", media_cache="fbcache"), ["image"])
    assert cached.activations == eager.activations


def test_activations_scale_with_the_batch_cap_and_fp8_halves_the_dit():
    pytest.importorskip("diffusers")
    from minisgl_cli.media.configs import parameter_counts

    plain = estimate(MediaSettings(image_model="tiny-z-image", load_format="dummy", max_batch=2), ["image"])
    single = estimate(MediaSettings(image_model="tiny-z-image", load_format="dummy", max_batch=1), ["image"])
    assert plain.activations - single.activations == single.activations - 2 * GIB  # a row each, past the overhead
    fp8 = estimate(MediaSettings(image_model="tiny-z-image", load_format="dummy", quantization="fp8"), ["image"])
    dit = parameter_counts("tiny-z-image")["transformer"] * 2
    assert plain.weights["tiny-z-image"] - fp8.weights["tiny-z-image"] == dit // 2


def test_a_pipeline_dir_is_counted_from_its_safetensors_at_the_load_dtype(tiny_models):
    from safetensors import safe_open

    numel = 0
    for path in tiny_models["z-image"].rglob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            numel += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    media = estimate(MediaSettings(image_model_dir=tiny_models["z-image"]), ["image"])
    assert list(media.weights.values()) == [2 * numel]  # saved in fp32, held in bf16


def test_the_worker_is_sized_for_the_pipelines_it_would_load(tiny_models, tmp_path):
    # A built-in config under dummy weights: the image one named, not the default video hub id (no such config).
    assert loadable(MediaSettings(image_model="z-image-turbo", load_format="dummy")) == ["image"]
    assert loadable(MediaSettings(image_model_dir=tiny_models["z-image"], video_model_dir=tiny_models["wan"])) == [
        "image", "video"]
    assert loadable(MediaSettings(image_model_dir=tmp_path, video_model_dir=tmp_path)) == []  # nothing on disk
    # CPU (and MPS): the text engine sizes its pool as before.
    assert keep_free(MediaSettings(image_model="z-image-turbo", load_format="dummy"), "cpu") is None
    assert EngineConfig().keep_free is None and EngineConfig().mem_fraction is None


def test_default_split_keeps_the_media_estimate_first():
    s = split(100 * GIB, MEDIA, min_pool=GIB)
    assert (s.keep, s.kv_bytes, s.warning) == (MEDIA, int(70 * GIB * 0.85), None)
    assert s.line(1_234_567, s.kv_bytes) == (
        "kept 30.0 GiB of cuda for the media worker (z-image-turbo); the KV pool has 1,234,567 tokens in its 59.5 GiB")
    alone = split(100 * GIB, None)  # no media worker on this GPU: 0.85 of the free memory, as before
    assert (alone.kv_bytes, alone.line(1000, alone.kv_bytes)) == (int(85 * GIB), None)


def test_explicit_mem_fraction_or_max_total_tokens_wins_with_a_warning_past_the_estimate():
    assert split(100 * GIB, MEDIA, mem_fraction=0.6) == Split(60 * GIB, device="cuda")  # leaves 40: no warning
    tight = split(100 * GIB, MEDIA, mem_fraction=0.9)
    assert tight.kv_bytes == int(90 * GIB) and tight.line(1000, tight.kv_bytes) is None
    assert tight.warning == (
        "--mem-fraction 0.9 leaves 10.0 GiB of cuda beside the KV pool, and the media worker (z-image-turbo) needs "
        "30.0 GiB: its first job may run out of memory (leave --mem-fraction out to split the GPU between them)")
    pool = split(100 * GIB, MEDIA, pool_bytes=80 * GIB)
    assert pool.kv_bytes == 80 * GIB and pool.warning is not None and pool.warning.startswith("--max-total-tokens ")
    assert split(100 * GIB, MEDIA, pool_bytes=50 * GIB).warning is None


def test_a_card_too_small_for_both_fails_at_start_naming_the_fix():
    with pytest.raises(ValueError) as exc:
        split(34 * GIB, MEDIA, min_pool=4 * GIB, device="cuda:0")
    assert str(exc.value) == (
        "cuda:0 has 34.0 GiB free after the text model's weights: the media worker (z-image-turbo) needs 30.0 GiB of "
        "it and the KV pool at least 4.0 GiB (4,096 tokens): serve a smaller text or media model, lower "
        "--media-max-batch, or size the KV pool with --mem-fraction or --max-total-tokens (media jobs may then run "
        "out of memory)")
    assert split(36 * GIB, MEDIA, min_pool=4 * GIB).kv_bytes >= 4 * GIB  # just enough for both


def test_only_the_media_gpu_keeps_room():
    assert shares_device(MEDIA, "cuda:0") is MEDIA and shares_device(MEDIA, "cuda") is MEDIA
    assert shares_device(MEDIA, "cuda:1") is None  # another rank or replica: its whole GPU for the KV pool
    assert shares_device(KeepFree("cuda:1", GIB, "", ""), "cuda:1") is not None
    assert shares_device(None, "cuda") is None


@pytest.mark.gpu
def test_the_engine_leaves_the_kept_memory_free_on_its_gpu():
    """On a CUDA GPU (skipped without one): the KV pool sizes itself around a KeepFree on its device, and a device
    too small for both refuses the start with the KeepFree's remedy."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from minisgl_cli.engine.engine import Engine

    base = dict(model="qwen3-0.6b", load_format="dummy", device="cuda", disable_cuda_graph=True)
    free = torch.cuda.mem_get_info()[0]
    keep = KeepFree("cuda:0", free // 2, "a neighbour", "a remedy")
    before = torch.cuda.memory_reserved()
    engine = Engine(EngineConfig(**base, keep_free=keep))
    assert engine.split is not None and engine.split.keep is keep
    # What this process took (weights, pool, workspaces) left the kept half: counted in this process, as other
    # processes may share the GPU (pytest -n).
    assert torch.cuda.memory_reserved() - before <= free - keep.nbytes
    del engine
    torch.cuda.empty_cache()
    too_much = KeepFree("cuda:0", torch.cuda.mem_get_info()[0], "a neighbour", "a remedy")
    with pytest.raises(ValueError, match="needs .* GiB of it and the KV pool at least .*: a remedy$"):
        Engine(EngineConfig(**base, keep_free=too_much))
    torch.cuda.empty_cache()
