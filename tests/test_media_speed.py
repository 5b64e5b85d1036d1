"""The media engine's speed options on tiny real pipelines (CPU): each applied, or refused in one clear line.

What a CPU can check: the built-in dummy pipelines build and run; the text-embedding cache gives bit-identical
pixels; cache-dit's step cache skips steps (its own stats say which); the FP8 module swap and its numbers (the
quantize / dequantize emulation of the CUDA `_scaled_mm` path); VAE tiling switches on by size; the compile
policy; regional compile itself (slow). The CUDA kernels' speed is examples/media_bench.py's, on the GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import tiny_models  # noqa: E402,F401  (the fixture)

pytest.importorskip("diffusers")

from minisgl_cli.app import app  # noqa: E402
from minisgl_cli.media.image import generate_images  # noqa: E402
from minisgl_cli.media.jobs import ImageJob, MediaError, ModelSpec, VideoJob  # noqa: E402
from minisgl_cli.media.pipelines import compiles, load_pipeline  # noqa: E402
from minisgl_cli.media.video import generate_video  # noqa: E402

runner = CliRunner()
SMALL = ("--height", "32", "--width", "32", "--steps", "2", "--device", "cpu")


def fails_with(args: list[str], *words: str) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code != 0, result.output
    text = result.stderr if result.exit_code == 1 else result.output
    assert all(w in text for w in words), text
    return text


def image_spec(model_dir: Path | None = None, **kw) -> ModelSpec:
    if model_dir is None:
        return ModelSpec.create("image", "tiny-z-image", None, device="cpu", load_format="dummy", **kw)
    return ModelSpec.create("image", str(model_dir), model_dir, device="cpu", **kw)


# --- dummy pipelines -----------------------------------------------------------------------------


def test_dummy_image_and_video_build_from_the_builtin_registry(tmp_path):
    out = runner.invoke(app, ["image", "--load-format", "dummy", "--model", "tiny-z-image", "--output-dir",
                              str(tmp_path), "--seed", "3", *SMALL])
    assert out.exit_code == 0, (out.output, out.exception)
    (path,) = [Path(p) for p in out.stdout.split()]
    assert path.is_file() and path.suffix == ".png"
    out = runner.invoke(app, ["video", "-p", "waves", "--load-format", "dummy", "--model", "tiny-wan", "--num-frames",
                              "5", "--format", "frames", "--output-dir", str(tmp_path), *SMALL])
    assert out.exit_code == 0, (out.output, out.exception)
    assert len(list(Path(out.stdout.split()[-1]).glob("*.png"))) == 5


def test_dummy_builds_are_the_same_weights_every_time():
    from minisgl_cli.media.configs import build_dummy_pipeline

    a, b = (build_dummy_pipeline("tiny-z-image", "cpu", __import__("torch").float32) for _ in range(2))
    for (name, x), (_, y) in zip(a.transformer.state_dict().items(), b.transformer.state_dict().items()):
        assert (x == y).all(), name


def test_dummy_unknown_or_wrong_kind_config_is_one_line():
    fails_with(["image", "--load-format", "dummy", "--model", "no-such-model", *SMALL], "built-in config",
               "z-image-turbo", "wan2.1-t2v-1.3b")
    fails_with(["image", "--load-format", "dummy", "--model", "tiny-wan", *SMALL], "minisgl video")


# --- text-embedding cache ------------------------------------------------------------------------


def test_prompt_cache_hit_gives_the_same_pixels_as_no_cache(tiny_models):  # noqa: F811
    import torch
    from diffusers import DiffusionPipeline

    loaded = load_pipeline(image_spec(tiny_models["z-image"]))
    job = dict(prompt="a red fox in snow", width=32, height=32, steps=2, seed=11)
    first = np.asarray(generate_images(loaded, ImageJob(**job)).images[0])
    hits = loaded.pipe.prompt_cache.hits
    second = np.asarray(generate_images(loaded, ImageJob(**job)).images[0])
    assert loaded.pipe.prompt_cache.hits == hits + 1  # the text encoder did not run again
    plain = DiffusionPipeline.from_pretrained(str(tiny_models["z-image"]), torch_dtype=torch.float32)
    plain.set_progress_bar_config(disable=True)
    ref = plain(prompt=job["prompt"], width=32, height=32, num_inference_steps=2, guidance_scale=0.0,
                generator=torch.Generator("cpu").manual_seed(11)).images[0]
    assert (first == second).all() and (np.asarray(ref.convert("RGB")) == second).all()


def test_prompt_cache_keys_on_the_negative_prompt_too(tiny_models):  # noqa: F811
    spec = ModelSpec.create("video", str(tiny_models["wan"]), tiny_models["wan"], device="cpu")
    loaded = load_pipeline(spec)
    job = dict(prompt="waves", width=32, height=32, num_frames=5, steps=2, guidance_scale=5.0, seed=2)
    a = generate_video(loaded, VideoJob(**job, negative_prompt="blur")).frames
    b = generate_video(loaded, VideoJob(**job, negative_prompt="rain")).frames
    c = generate_video(loaded, VideoJob(**job, negative_prompt="blur")).frames
    assert not all((x == y).all() for x, y in zip(a, b))
    assert all((x == y).all() for x, y in zip(a, c))


def test_prompt_cache_evicts_past_its_byte_cap():
    import torch

    from minisgl_cli.media.prompt_cache import PromptCache

    cache = PromptCache(max_bytes=2 * 4 * 100)
    for key in "abc":
        cache.get_or_encode(key, lambda: torch.zeros(100))
    assert list(cache.entries) == ["b", "c"] and cache.bytes == 800


# --- step cache (cache-dit) ----------------------------------------------------------------------


def test_media_cache_skips_steps_and_stays_near_the_exact_video():
    from minisgl_cli.media import step_cache

    job = dict(prompt="waves", width=32, height=32, num_frames=5, steps=12, seed=5)
    exact = generate_video(load_pipeline(ModelSpec.create("video", "tiny-wan", None, device="cpu",
                                                          load_format="dummy")), VideoJob(**job)).frames
    cached = load_pipeline(ModelSpec.create("video", "tiny-wan", None, device="cpu", load_format="dummy",
                                            media_cache="fbcache"))
    frames = generate_video(cached, VideoJob(**job)).frames
    assert step_cache.cached_steps(cached.pipe)  # cache-dit reused its cache on some steps
    assert not all((x == y).all() for x, y in zip(exact, frames))  # ... so the run changed


def test_media_cache_on_z_image(tiny_models):  # noqa: F811
    """Z-Image through cache-dit's adapter; the tiny DiT's residuals move a lot, so a loose threshold."""
    from diffusers import DiffusionPipeline

    from minisgl_cli.media import step_cache

    pipe = DiffusionPipeline.from_pretrained(str(tiny_models["z-image"]))
    pipe.set_progress_bar_config(disable=True)
    step_cache.enable(pipe, "taylorseer:threshold=10,order=2", "image")
    pipe(prompt="a fox", width=32, height=32, num_inference_steps=8, guidance_scale=0.0)
    assert step_cache.cached_steps(pipe)


def test_unknown_media_cache_is_refused():
    fails_with(["image", "--media-cache", "teacache", *SMALL], "teacache")
    with pytest.raises(MediaError, match="dbcache, fbcache, taylorseer"):
        load_pipeline(image_spec(media_cache="teacache"))


def test_media_cache_options_parse_and_bad_ones_are_refused():
    from minisgl_cli.media.step_cache import CacheSpec, parse

    assert parse("fbcache") == CacheSpec("fbcache")
    assert parse("dbcache: threshold=0.24, max-continuous=3,warmup=2,front=4,back=1,max-cached=10") == CacheSpec(
        "dbcache", threshold=0.24, max_continuous=3, warmup=2, front=4, back=1, max_cached=10)
    assert parse("taylorseer:order=2").order == 2
    assert parse("fbcache:scm=fast,scm-policy=static") == CacheSpec("fbcache", scm="fast", scm_policy="static")
    for bad, says in [("fbcache:thresh=1", "'thresh=1' is not an option"), ("fbcache:threshold", "not an option"),
                      ("fbcache:threshold=0", "must be a number > 0"), ("fbcache:warmup=x", "must be an integer"),
                      ("fbcache:max-continuous=0", "-1 or an integer >= 1"), ("fbcache:order=2", "TaylorSeer's"),
                      ("taylorseer:order=3", "1 or 2"), ("fbcache:front=0", ">= 1"),
                      ("fbcache:scm=turbo", "slow or medium or fast or ultra"),
                      ("fbcache:scm=fast,scm-policy=always", "dynamic or static"),
                      ("fbcache:scm-policy=static", "scm-policy needs a mask")]:
        with pytest.raises(MediaError, match=says):
            parse(bad)
    fails_with(["image", "--media-cache", "fbcache:threshold=-1", *SMALL], "threshold", "> 0")
    fails_with(["video", "--media-cache", "dbcache:speed=9", *SMALL], "speed=9")
    with pytest.raises(MediaError, match="front \\+ back = 5 blocks"):  # tiny-wan has 2
        load_pipeline(ModelSpec.create("video", "tiny-wan", None, device="cpu", load_format="dummy",
                                       media_cache="dbcache:front=4,back=1"))


def test_media_cache_options_change_what_is_cached():
    """Each knob moves the cached steps of one tiny-wan run: a threshold nothing passes caches nothing, a loose one
    every step past the warmup, max-cached caps them, max-continuous breaks up runs of them."""
    from minisgl_cli.media import step_cache

    def cached(value: str) -> list[int]:
        loaded = load_pipeline(ModelSpec.create("video", "tiny-wan", None, device="cpu", load_format="dummy",
                                                media_cache=value))
        generate_video(loaded, VideoJob("waves", 32, 32, num_frames=5, steps=10, seed=5))
        return step_cache.cached_steps(loaded.pipe)

    assert cached("fbcache:threshold=1e-9,warmup=2") == []
    loose = cached("fbcache:threshold=1e9,warmup=2")
    assert loose == list(range(2, 10))  # every step past the first two
    assert len(cached("fbcache:threshold=1e9,warmup=2,max-cached=3")) == 3
    broken = cached("fbcache:threshold=1e9,warmup=2,max-continuous=1")
    assert broken and all(b - a > 1 for a, b in zip(broken, broken[1:]))  # never two cached steps in a row
    assert cached("fbcache:threshold=1e9,warmup=5")[0] == 5


def test_media_cache_step_mask_follows_each_calls_step_count():
    """scm=PRESET: the mask is drawn for each call's steps; `static` caches exactly the masked-off steps even where
    no residual passes the threshold, `dynamic` (the default) only those that pass it; a step count the presets do
    not cover computes every step."""
    import cache_dit

    from minisgl_cli.media import step_cache

    def cached(value: str, steps: int) -> list[int]:
        loaded = load_pipeline(ModelSpec.create("video", "tiny-wan", None, device="cpu", load_format="dummy",
                                                media_cache=value))
        generate_video(loaded, VideoJob("waves", 32, 32, num_frames=5, steps=steps, seed=5))
        return step_cache.cached_steps(loaded.pipe)

    def skipped(steps: int) -> list[int]:
        return [i for i, m in enumerate(cache_dit.steps_mask(total_steps=steps, mask_policy="fast")) if m == 0]

    static = "fbcache:threshold=1e-9,scm=fast,scm-policy=static"
    assert skipped(20) != skipped(10)
    for steps in (20, 10, 20):  # one pipeline, a new mask each call
        assert cached(static, steps) == skipped(steps)
    assert cached("fbcache:threshold=1e-9,scm=fast", 20) == []  # dynamic: nothing passes this threshold
    assert set(cached("fbcache:threshold=1e9,scm=fast", 20)) == set(skipped(20))  # ... and everything passes this
    assert cached(static, 5) == []  # fast has no 5-step mask
    assert cached(static, 4) == skipped(4) != []  # ... and has a 4-step one (distilled models)


# --- FP8 ---------------------------------------------------------------------------------------


def _small_dit(kind: str):
    """A DiT whose sides _scaled_mm takes (multiples of 16) and a seeded call of it."""
    import torch

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if kind == "z-image":  # tiny-z-image's MLP is 85 wide
        from diffusers import ZImageTransformer2DModel

        dit = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=48, n_layers=2,
                                       n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
                                       axes_dims=[8, 8, 8], axes_lens=[256, 64, 64]).eval()
        args = ([torch.randn(4, 1, 16, 16, generator=g)], torch.tensor([0.5]), [torch.randn(7, 32, generator=g)])
    else:
        from diffusers import WanTransformer3DModel

        dit = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16,
                                    out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2,
                                    rope_max_seq_len=32).eval()
        args = (torch.randn(1, 16, 2, 8, 8, generator=g), torch.tensor([500]), torch.randn(1, 7, 32, generator=g))
    return dit, args


@pytest.mark.parametrize("kind,act,prefixes", [
    ("z-image", "silu_mul", ("layers.", "noise_refiner.", "context_refiner.")), ("wan", "gelu_tanh", ("blocks.",))])
def test_fp8_swaps_the_block_linears_and_stays_near_bf16(kind, act, prefixes):
    import torch

    from minisgl_cli.media.fp8 import Fp8Linear, Fp8MLP, quantize_denoiser

    dit, args = _small_dit(kind)
    with torch.no_grad():
        ref = dit(*args, return_dict=False)[0]
        swapped = quantize_denoiser(dit)
        out = dit(*args, return_dict=False)[0]
    ref, out = (r[0] if isinstance(r, list) else r for r in (ref, out))
    fp8_names = [n for n, m in dit.named_modules() if isinstance(m, Fp8Linear)]
    assert swapped == len(fp8_names) > 0
    assert not any("adaLN" in n or "scale_shift" in n for n in fp8_names)  # modulation and embedders stay dense
    assert all(n.startswith(prefixes) for n in fp8_names)
    mlps = [m for m in dit.modules() if isinstance(m, Fp8MLP)]  # every block's MLP, activation and all
    assert len(mlps) == sum(1 for n, _ in dit.named_modules() if n.endswith((".feed_forward", ".ffn")))
    assert mlps and all(m.act == act for m in mlps)
    rel = (out - ref).norm() / ref.norm()
    assert 0 < rel < 0.1, rel  # e4m3 is ~2 significant digits: close, not equal


def test_fp8_is_refused_off_cuda():
    fails_with(["image", "--quantization", "fp8", *SMALL], "fp8", "CUDA")
    fails_with(["image", "--attention-backend", "fp8", *SMALL], "needs CUDA")


# --- VAE tiling, compile ---------------------------------------------------------------------------


def test_vae_tiles_large_images_only():
    loaded = load_pipeline(image_spec())
    assert not loaded.tile_vae_for(1024, 1024) and not loaded.pipe.vae.use_tiling
    assert loaded.tile_vae_for(4096, 4096) and loaded.pipe.vae.use_tiling
    loaded.tile_vae_for(1024, 1024)


def test_compile_defaults_on_for_cuda_only():
    spec = image_spec()
    assert compiles(spec, "cuda:0") and not compiles(spec, "cpu") and not compiles(spec, "mps")
    assert compiles(image_spec(compile=True), "cpu") and not compiles(image_spec(compile=False), "cuda")


def test_cuda_graphs_default_on_for_cuda_and_off_with_offload_or_the_flag():
    from minisgl_cli.media.pipelines import graphs_on

    assert graphs_on(image_spec(), "cuda:0") and not graphs_on(image_spec(), "cpu")
    assert not graphs_on(image_spec(), "mps") and not graphs_on(image_spec(cpu_offload=True), "cuda")
    assert not graphs_on(image_spec(cuda_graphs=False), "cuda")


def test_the_block_stacks_graphed_follow_the_dit_class_and_the_options(tmp_path):
    """Z-Image's three stacks, known from a built-in config or a dir's model_index.json before anything loads; no
    other DiT's; none with a step cache or a split over ranks (both rewrite the blocks' calls), nor off CUDA."""
    import json

    from minisgl_cli.media.pipelines import block_stacks, denoiser_class

    z = ("noise_refiner", "context_refiner", "layers")
    assert denoiser_class(image_spec()) == "ZImageTransformer2DModel"
    assert block_stacks(image_spec(), "cuda", denoiser_class(image_spec())) == z
    assert block_stacks(image_spec(), "cpu", "ZImageTransformer2DModel") == ()
    assert block_stacks(image_spec(media_cache="fbcache"), "cuda", "ZImageTransformer2DModel") == ()
    assert block_stacks(image_spec(media_parallel="cfg"), "cuda", "ZImageTransformer2DModel") == ()
    assert denoiser_class(image_spec(tmp_path)) is None  # not on disk yet: counted as the default model's
    assert block_stacks(image_spec(tmp_path), "cuda", None) == z
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline",
                                                           "transformer": ["diffusers", "FluxTransformer2DModel"]}))
    assert denoiser_class(image_spec(tmp_path)) == "FluxTransformer2DModel"
    assert block_stacks(image_spec(tmp_path), "cuda", "FluxTransformer2DModel") == ()


def test_graphed_blocks_keep_the_modules_and_run_them_in_order():
    """media/graphs.py's block stack, as the DiT's forward meets it (its first call of a shape runs eager, on any
    device): the same state dict under the same names, one step when iterated, the same output as the blocks."""
    import torch

    from minisgl_cli.media.configs import build_dummy_pipeline
    from minisgl_cli.media.graphs import Graphed, Pool, install_blocks
    from minisgl_cli.media.pipelines import BLOCK_STACKS

    dit = build_dummy_pipeline("tiny-z-image", "cpu", torch.float32).transformer
    x = [torch.randn(dit.config.in_channels, 1, 8, 8, generator=torch.Generator().manual_seed(1))]
    caption = [torch.randn(7, dit.config.cap_feat_dim, generator=torch.Generator().manual_seed(2))]
    t = torch.tensor([0.25])
    names = list(dit.state_dict())
    with torch.inference_mode():
        want = dit(x, t, caption, return_dict=False)[0][0]
        pool = Pool()
        stacks = install_blocks(dit, pool, BLOCK_STACKS[type(dit).__name__])
        got = dit(x, t, caption, return_dict=False)[0][0]
    assert [s.graphed.name.split(".")[-1] for s in stacks] == ["noise_refiner", "context_refiner", "layers"]
    assert list(dit.state_dict()) == names and pool.members == [s.graphed for s in stacks]
    assert all(len(list(s)) == 1 and isinstance(next(iter(s)), Graphed) for s in stacks)
    assert torch.equal(got, want)


def test_graphed_passes_remember_a_bounded_number_of_shapes(monkeypatch):
    """A pass asked for ever new shapes keeps MAX_KEYS of them as seen, the oldest forgotten (a first call of each
    runs eager, on any device)."""
    import torch

    from minisgl_cli.media import graphs

    monkeypatch.setattr(graphs, "MAX_KEYS", 2)
    g = graphs.Graphed(lambda x: x * 2, graphs.Pool(), "double")
    for n in (1, 2, 3):
        assert torch.equal(g(torch.ones(n)), torch.full((n,), 2.0))
    assert [key[0][0] for key in g.seen] == [(2,), (3,)] and g.captures == 0


@pytest.mark.slow
def test_regional_compile_matches_eager_and_stores_its_cache(tiny_models, tmp_path):  # noqa: F811
    """`minisgl image --compile` of a checkpoint on disk (the saved tiny Z-Image) in a fresh process: the eager
    pipeline's pixels, and its kernels stored. (The dummy weights' compile: the warm-up test above.)"""
    import subprocess

    import torch
    from PIL import Image

    from minisgl_cli.media.compile import compile_denoiser

    eager = load_pipeline(image_spec(tiny_models["z-image"]))
    ref = np.asarray(generate_images(eager, ImageJob(prompt="a fox", width=32, height=32, steps=2, seed=4)).images[0])
    # A fresh process, as a user's start: inductor reads its cache dir once a process, and a graph an earlier test
    # compiled would be a cache hit that writes nothing.
    cache = tmp_path / "inductor"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache))
    cli = [sys.executable, "-m", "minisgl_cli.app", "image", "-p", "a fox", "--model-dir", str(tiny_models["z-image"]),
           "--compile", "--seed", "4", "--output-dir", str(tmp_path), *SMALL]
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (path,) = [Path(p) for p in done.stdout.split()]
    out = np.asarray(Image.open(path).convert("RGB")).astype(int)
    assert np.abs(out - ref.astype(int)).max() <= 2
    assert any(f.is_file() for f in cache.rglob("*"))  # the kernels stored for the next start
    torch._dynamo.reset()
    assert compile_denoiser(torch.nn.Linear(4, 4)) == "whole"  # no repeated blocks: the module compiles whole


def test_serve_settings_take_the_speed_options_from_the_environment(monkeypatch):
    from minisgl_cli.media.settings import MediaSettings

    for var, value in {"MINISGL_IMAGE_MODEL": "tiny-z-image", "MINISGL_MEDIA_LOAD_FORMAT": "dummy",
                       "MINISGL_MEDIA_CACHE": "fbcache", "MINISGL_MEDIA_QUANTIZATION": "fp8",
                       "MINISGL_MEDIA_COMPILE": "off", "MINISGL_MEDIA_ATTENTION": "sdpa",
                       "MINISGL_MEDIA_NO_GRAPHS": "1"}.items():
        monkeypatch.setenv(var, value)
    settings = MediaSettings.from_env()
    spec = settings.spec("image")
    assert (spec.model, spec.load_format, spec.media_cache, spec.quantization, spec.compile,
            spec.attention_backend, spec.cuda_graphs) == ("tiny-z-image", "dummy", "fbcache", "fp8", False, "sdpa",
                                                          False)
    assert settings.available("image")  # a built-in config needs no dir on disk
    monkeypatch.setenv("MINISGL_MEDIA_COMPILE", "auto")
    assert MediaSettings.from_env().compile is None


def test_media_settings_defaults_where_no_variable_is_set_and_the_caps_parse(monkeypatch):
    from minisgl_cli.media.settings import MediaSettings

    for var in ("MINISGL_IMAGE_MODEL", "MINISGL_VIDEO_MODEL", "Z_IMAGE_MODEL_DIR", "MINISGL_VIDEO_MODEL_DIR",
                "MINISGL_DEVICE", "MINISGL_MEDIA_COMPILE", "MINISGL_MEDIA_ATTENTION", "MINISGL_MEDIA_QUANTIZATION",
                "MINISGL_MEDIA_CACHE", "MINISGL_MEDIA_LOAD_FORMAT", "MINISGL_MEDIA_NO_GRAPHS",
                "MINISGL_MEDIA_MAX_QUEUE",
                "MINISGL_MEDIA_MAX_BATCH", "MINISGL_MEDIA_MAX_WORK"):
        monkeypatch.delenv(var, raising=False)
    assert MediaSettings.from_env() == MediaSettings()
    monkeypatch.setenv("MINISGL_MEDIA_MAX_QUEUE", "3")
    monkeypatch.setenv("MINISGL_MEDIA_MAX_WORK", "12.5")
    settings = MediaSettings.from_env()
    assert (settings.max_queue, settings.max_batch, settings.max_work) == (3, MediaSettings.max_batch, 12.5)
    monkeypatch.setenv("MINISGL_MEDIA_MAX_BATCH", "four")
    with pytest.raises(ValueError, match="MINISGL_MEDIA_MAX_BATCH='four' is not an integer"):
        MediaSettings.from_env()


@pytest.mark.slow
def test_warm_up_compiles_the_batched_graphs_so_no_later_batch_size_compiles():
    import torch
    import torch._dynamo.utils as dynamo_utils

    from minisgl_cli.media.batch import generate, warm_up
    from minisgl_cli.media.pipelines import unload_all

    def job(prompt: str, n: int = 1) -> ImageJob:
        return ImageJob(prompt=prompt, width=32, height=32, steps=2, seed=4, num_images=n)

    def graphs_for(*jobs: ImageJob) -> int:
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        generate(loaded, list(jobs))
        return dynamo_utils.counters["stats"]["unique_graphs"] - before

    for warm in (True, False):
        unload_all()
        torch._dynamo.reset()
        loaded = load_pipeline(image_spec(compile=True))
        assert graphs_for(job("a fox")) > 0  # the first call compiles (a batch of one)
        if warm:
            warm_up(loaded, job("a fox"))
            # What a server batches next: two users' prompts (three rows), n = 3 of one prompt, a single image.
            assert graphs_for(job("a fox"), job("a cat in the snow at dusk", 2)) == 0
            assert graphs_for(job("a fox", 3)) == 0 and graphs_for(job("a dog")) == 0
        else:  # the negative control: without the warm-up, the first batch compiles
            assert graphs_for(job("a fox"), job("a cat in the snow at dusk", 2)) > 0
    unload_all()
    torch._dynamo.reset()


def test_warm_up_gives_way_to_a_job_between_its_steps():
    """The worker's warm-up stops once it is no longer idle (a job arrived, a stop): after the step under way."""
    from minisgl_cli.media.batch import warm_up

    loaded = load_pipeline(image_spec())
    job = ImageJob(prompt="a fox", width=32, height=32, steps=2, seed=4)
    checks: list[int] = []

    def idle_for(n: int):
        def idle() -> bool:
            checks.append(1)
            return len(checks) <= n
        return idle

    assert warm_up(loaded, job, idle=idle_for(10**6)) is True
    ran = len(checks)  # each call checks before it and after its one step
    checks.clear()
    assert warm_up(loaded, job, idle=idle_for(3)) is False and len(checks) == 4 < ran


def test_z_image_encodes_a_prompt_on_its_own_tokens_as_diffusers_does_on_512(tiny_models):  # noqa: F811
    """media/text_encoder.py: the rows of a batch of prompts of unequal length, encoded without the 512-token padding
    and its mask, equal diffusers' own encoding (fp32 on a CPU: to rounding); a pipeline that is not Z-Image keeps
    its own method."""
    import torch
    from diffusers import DiffusionPipeline

    from minisgl_cli.media import text_encoder

    pipe = DiffusionPipeline.from_pretrained(str(tiny_models["z-image"]), torch_dtype=torch.float32)
    prompts = ["a red fox in snow", "a lighthouse on a cliff at dusk, waves below, gulls over the foam", "x"]
    with torch.inference_mode():
        want = pipe._encode_prompt(list(prompts), device="cpu")
        assert text_encoder.install(pipe) and not text_encoder.install(object())
        got = pipe._encode_prompt(list(prompts), device="cpu")
    assert [g.shape for g in got] == [w.shape for w in want] and len({w.shape[0] for w in want}) == 3
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
