"""Loading diffusers pipelines from a model dir (fetched once from the hub if allowed) or a built-in config
(`load_format="dummy"`), with their speed-ups applied, cached per (model, device, dtype, options) so a server pays
the load on first use only.

The speed-ups, in the order they apply: FP8 DiT linears (media/fp8.py), the attention kernels, regional compile of
the DiT's blocks and the image VAE's decode (media/compile.py), cache-dit's step cache (media/step_cache.py), CUDA
graphs of the DiT's block stacks and the text encoder (media/graphs.py; on CUDA), the prompt encoded on its own tokens
(media/text_encoder.py) and the text-embedding cache (media/prompt_cache.py): the last three are exact. VAE tiling
switches on per job past TILE_PIXELS (an image) or TILE_VOXELS (a video's frames x pixels).
"""

from __future__ import annotations

import inspect
import json
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_cli import env
from minisgl_cli.device import pick_device, pick_dtype
from minisgl_cli.media.jobs import MediaError, ModelNotFoundError, ModelSpec, first_line

# CLI name -> diffusers attention-dispatch backend name. "auto": cuDNN's fused attention through SDPA on Hopper
# and later where it runs (exact; SDPA alone falls back to its slower memory-efficient kernel under Z-Image's
# caption mask), PyTorch's SDPA choice elsewhere. "fp8": our Triton kernel with both dots in e4m3
# (media/fp8_attention.py; approximate, opt-in).
ATTENTION_BACKENDS = {"auto": "", "sdpa": "native", "cudnn": "_native_cudnn", "flash2": "flash", "flash3": "_flash_3",
                      "fp8": "fp8"}
TILE_PIXELS = 2048 * 2048  # an image VAE decodes in tiles above this (memory; 1024^2 decodes whole in 87 ms)
TILE_VOXELS = 1280 * 720 * 81  # a video VAE above this many frames x pixels

StepHook = Callable[[int, int, Any], None]  # (steps done, steps total, the latents after that step)


@dataclass
class LoadedPipeline:
    pipe: Any
    spec: ModelSpec
    model_dir: Path
    device: str
    dtype: Any
    # Pipelines keep per-call state (scheduler timesteps, progress), so calls on one are serialised.
    lock: threading.Lock
    rank: int = 0  # this process's rank in a media group (spec.media_parallel); ranks > 0 hand back nothing
    ranks: Any = None  # rank 0 of a media group: media/ranks.Ranks, which hands the other ranks each batch
    graphs: Any = None  # media/graphs.Pool of the pipeline's CUDA-graphed passes; None where none are

    def call_params(self) -> set[str] | None:
        """Names `pipe.__call__` accepts; None when it takes **kwargs (accepts anything)."""
        params = inspect.signature(self.pipe.__call__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        return set(params)

    def tile_vae_for(self, width: int, height: int, frames: int = 1) -> bool:
        """Decode in tiles when the job is large (VAE memory grows with its pixels); returns whether it tiles."""
        vae = getattr(self.pipe, "vae", None)
        if vae is None or not hasattr(vae, "enable_tiling"):
            return False
        tile = width * height * frames > (TILE_VOXELS if self.spec.kind == "video" else TILE_PIXELS)
        vae.enable_tiling() if tile else vae.disable_tiling()
        return tile

    def run(self, kwargs: dict[str, Any], total_steps: int, on_step: StepHook | None) -> Any:
        """One pipeline call with `kwargs` (those it does not take dropped); `on_step` after each denoise step,
        handed the latents (it may raise to end the call there)."""
        accepted = self.call_params()
        kwargs = {k: v for k, v in kwargs.items() if v is not None and (accepted is None or k in accepted)}
        if self.spec.media_parallel is not None:  # every rank runs every step's hook: rank 0 may end the call
            from minisgl_cli.media import parallel

            parallel.start_call(self.pipe)
            on_step = parallel.agreed_step(on_step, self.device)
            if self.rank > 0:
                kwargs["output_type"] = "latent"  # rank 0 decodes and hands back the frames
        if on_step is not None and (accepted is None or "callback_on_step_end" in accepted):

            def step_end(pipe: Any, i: int, t: Any, callback_kwargs: dict) -> dict:
                on_step(i + 1, total_steps, callback_kwargs.get("latents"))
                return callback_kwargs

            kwargs["callback_on_step_end"] = step_end
            if accepted is None or "callback_on_step_end_tensor_inputs" in accepted:
                kwargs["callback_on_step_end_tensor_inputs"] = ["latents"]
        import torch

        with self.lock, torch.inference_mode():
            if self.spec.media_cache is not None:  # a step mask is drawn for this call's step count
                from minisgl_cli.media.step_cache import prepare

                prepare(self.pipe, self.spec.media_cache, total_steps)
            return self.pipe(**kwargs)


def quiet_libraries() -> None:
    """Our own bar and messages replace diffusers/transformers' tqdm bars and info logs (in every process that runs a
    pipeline: a front, the media worker, each rank of a media group)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from diffusers.utils import logging as dlog
    from huggingface_hub.utils import logging as hlog
    from transformers.utils import logging as tlog

    for log in (dlog, tlog):
        log.set_verbosity_error()
        log.disable_progress_bar()
    hlog.set_verbosity_error()  # its retry warnings would add lines to the one-line error


_cache: dict[tuple, LoadedPipeline] = {}
_cache_lock = threading.Lock()


def unload_all() -> None:
    """Drop every cached pipeline (a benchmark frees one variant's GPU memory before it builds the next)."""
    with _cache_lock:
        _cache.clear()


def _env_for(spec: ModelSpec) -> str:
    return env.IMAGE_MODEL_DIR if spec.kind == "image" else env.VIDEO_MODEL_DIR


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()


def ensure_model_dir(spec: ModelSpec) -> Path:
    """The dir holding the pipeline (has model_index.json); downloads `spec.model` into it when
    missing and allowed. Every failure is a ModelNotFoundError whose one-line message says the fix."""
    d = spec.model_dir
    if (d / "model_index.json").is_file():
        return d
    fix = (
        f"Fix: pass --model-dir DIR (or set {_env_for(spec)}) to a diffusers pipeline dir, "
        "i.e. one containing model_index.json"
    )
    if d.exists() and not d.is_dir():
        raise ModelNotFoundError(f"{spec.kind} model dir {d} is not a directory. {fix}.", "model")
    if not spec.allow_download or _looks_like_path(spec.model):
        raise ModelNotFoundError(f"{spec.kind} model not found: {d} has no model_index.json. {fix}.", "model")
    try:
        from huggingface_hub import list_repo_files, snapshot_download

        # Repos often ship each weight twice (.bin and .safetensors); fetch only safetensors then.
        has_safetensors = any(f.endswith(".safetensors") for f in list_repo_files(spec.model))
        skip = ["*.bin", "*.ckpt", "*.pt", "*.pth", "*.onnx", "*.msgpack", "*.h5"] if has_safetensors else None
        snapshot_download(repo_id=spec.model, local_dir=d, ignore_patterns=skip)
    except Exception as exc:  # offline, unreachable hub, unknown or gated repo: all end the same way
        reason = first_line(exc)
        raise ModelNotFoundError(
            f"{spec.kind} model not found in {d} and downloading {spec.model} failed "
            f"({type(exc).__name__}{': ' + reason if reason else ''}). {fix}.",
            "model",
        ) from None
    if not (d / "model_index.json").is_file():
        raise ModelNotFoundError(f"{spec.model} downloaded to {d} is not a diffusers pipeline (no model_index.json).")
    return d


def _denoiser(pipe: Any) -> Any:
    return getattr(pipe, "transformer", None) or getattr(pipe, "unet", None)


def _check_kind(pipe: Any, spec: ModelSpec) -> None:
    makes_video = "num_frames" in inspect.signature(pipe.__call__).parameters
    if makes_video != (spec.kind == "video"):
        other = "minisgl video" if makes_video else "minisgl image"
        raise MediaError(
            f"{type(pipe).__name__} in {spec.model_dir} is not a text-to-{spec.kind} pipeline (use `{other}`)", "model"
        )


def check_options(spec: ModelSpec, device: str) -> None:
    """Every option valid for this device, before any weights load: an unknown or unavailable one is a clear error."""
    if spec.attention_backend not in ATTENTION_BACKENDS:
        raise MediaError(
            f"unknown attention backend {spec.attention_backend!r}: use one of {', '.join(ATTENTION_BACKENDS)}",
            "attention_backend",
        )
    if spec.attention_backend not in ("auto", "sdpa") and not device.startswith("cuda"):
        raise MediaError(f"--attention-backend {spec.attention_backend} needs CUDA (use sdpa)", "attention_backend")
    if spec.cpu_offload and not device.startswith("cuda"):
        raise MediaError(f"--cpu-offload needs a CUDA device, this run uses {device}", "cpu_offload")
    if spec.quantization not in (None, "none", "fp8"):
        raise MediaError(f"unknown --quantization {spec.quantization!r}: use fp8 (or none)", "quantization")
    if spec.quantization == "fp8":
        if spec.cpu_offload:
            raise MediaError("--quantization fp8 and --cpu-offload do not combine", "quantization")
        from minisgl_cli.media.fp8 import check_device

        check_device(device)
    if spec.media_cache is not None:
        from minisgl_cli.media.step_cache import check

        check(spec.media_cache)
    if spec.load_format not in ("auto", "dummy"):
        raise MediaError(f"unknown --load-format {spec.load_format!r}: use auto or dummy", "load_format")
    if spec.media_parallel is not None:
        from minisgl_cli.media.parallel import check_spec

        check_spec(spec, device)


def compiles(spec: ModelSpec, device: str) -> bool:
    """--compile / --no-compile, or by default (None) on CUDA only: CPU and MPS run eager, and so does a Ulysses split
    (torch.compile cannot trace diffusers' context-parallel hooks: media/parallel.check_spec refuses --compile)."""
    if spec.compile is None:
        return device.startswith("cuda") and spec.media_parallel != "ulysses"
    return spec.compile


def graphs_on(spec: ModelSpec, device: str) -> bool:
    """CUDA graphs of the short passes (media/graphs.py): on CUDA unless --disable-cuda-graph, or the weights move
    between devices a call (--cpu-offload)."""
    return spec.cuda_graphs and device.startswith("cuda") and not spec.cpu_offload


# The DiT block stacks graphed, by the denoiser's class: the ModuleLists its forward loops over as
# `x = block(x, *rest)` (media/graphs.py's GraphedBlocks). Other DiTs keep their blocks eager (compiled).
BLOCK_STACKS: dict[str, tuple[str, ...]] = {"ZImageTransformer2DModel": ("noise_refiner", "context_refiner", "layers")}


def block_stacks(spec: ModelSpec, device: str, denoiser_class: str | None) -> tuple[str, ...]:
    """The block stacks of a `denoiser_class` DiT graphed under `spec` on `device`: none without the graphs, or
    with --media-cache / --media-parallel (both rewrite the blocks' calls). A class not known yet (None: a pipeline
    not on disk yet) is taken as the default image model's, so that the memory estimate counts what it may take."""
    if not graphs_on(spec, device) or spec.media_cache is not None or spec.media_parallel is not None:
        return ()
    return BLOCK_STACKS.get(denoiser_class or "ZImageTransformer2DModel", ())


def denoiser_class(spec: ModelSpec) -> str | None:
    """The class name of `spec`'s DiT before anything loads: a built-in config's, else its dir's model_index.json
    (None where the dir has none yet)."""
    if spec.load_format == "dummy":
        from minisgl_cli.media.configs import PIPELINES

        entry = PIPELINES.get(spec.model)
        return entry[2]["transformer"][0] if entry and "transformer" in entry[2] else None
    index = spec.model_dir / "model_index.json"
    if not index.is_file():
        return None
    transformer = json.loads(index.read_text()).get("transformer")
    return transformer[1] if isinstance(transformer, list) and len(transformer) == 2 else None


def _auto_attention(device: str) -> str:
    """cuDNN attention on compute capability 9.0+ when it runs a masked bf16 call here; else PyTorch's SDPA choice."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not device.startswith("cuda") or torch.cuda.get_device_capability(torch.device(device)) < (9, 0):
        return "native"
    q = torch.randn(1, 2, 64, 128, device=device, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, 64, device=device, dtype=torch.bool)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    except RuntimeError:
        return "native"
    return "_native_cudnn"


def _set_attention(pipe: Any, denoiser: Any, backend: str, name: str) -> None:
    if not hasattr(denoiser, "set_attention_backend"):
        raise MediaError(f"{type(pipe).__name__} does not support choosing the attention backend", "attention_backend")
    try:
        denoiser.set_attention_backend(backend)
    except Exception as exc:  # e.g. flash-attn / sageattention not installed, or GPU too old
        raise MediaError(f"--attention-backend {name} unavailable: {first_line(exc)}", "attention_backend") from None


def _configure(pipe: Any, spec: ModelSpec, device: str) -> Any:
    """Apply the spec's speed-ups to a built pipeline; returns the graphs' media/graphs.Pool (None: no graphs)."""
    if spec.cpu_offload:  # (check_options refused it off CUDA)
        pipe.enable_model_cpu_offload()
    else:
        pipe.to(device)
    denoiser = _denoiser(pipe)
    if spec.quantization == "fp8":
        from minisgl_cli.media.fp8 import quantize_denoiser

        if denoiser is None:
            raise MediaError(f"{type(pipe).__name__} has no transformer to quantize", "quantization")
        quantize_denoiser(denoiser)
    chosen = ATTENTION_BACKENDS[spec.attention_backend]
    backend = chosen or _auto_attention(device)
    if backend == "fp8":
        from minisgl_cli.media import fp8_attention

        if denoiser is None or not fp8_attention.enable(denoiser, _auto_attention(device)):
            raise MediaError(f"{type(pipe).__name__}'s denoiser routes no attention through diffusers' backends",
                             "attention_backend")
    elif backend != "native":
        try:
            _set_attention(pipe, denoiser, backend, spec.attention_backend)
        except MediaError:
            if chosen:  # asked for by name: say why not; auto keeps PyTorch's SDPA choice
                raise
    if spec.media_parallel is not None:  # this rank's share of each call (the group is up: media/ranks.py)
        from minisgl_cli.media.parallel import apply

        apply(pipe, spec.media_parallel, device)
    if compiles(spec, device):
        from minisgl_cli.media.compile import compile_denoiser, compile_vae_decode

        if denoiser is None:
            raise MediaError(f"{type(pipe).__name__} has no transformer/unet to compile", "compile")
        compile_denoiser(denoiser)
        if getattr(pipe, "vae", None) is not None:
            compile_vae_decode(pipe.vae)
    if spec.media_cache is not None:
        from minisgl_cli.media.step_cache import enable

        enable(pipe, spec.media_cache, spec.kind)
    from minisgl_cli.media import prompt_cache, text_encoder

    pool = None
    if graphs_on(spec, device):
        from minisgl_cli.media.graphs import Pool, install_blocks

        pool = Pool()
        install_blocks(denoiser, pool, block_stacks(spec, device, type(denoiser).__name__))
    text_encoder.install(pipe, pool)
    prompt_cache.install(pipe, prompt_cache.PromptCache())
    # Fronts show their own progress through step callbacks; diffusers' tqdm would garble it.
    pipe.set_progress_bar_config(disable=True)
    return pool


def _from_disk(model_dir: Path, dtype: Any) -> Any:
    from diffusers import DiffusionPipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `torch_dtype` renamed `dtype` in newer diffusers
        try:
            return DiffusionPipeline.from_pretrained(str(model_dir), torch_dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ModelNotFoundError(
                f"cannot load a diffusers pipeline from {model_dir}: {first_line(exc) or type(exc).__name__}",
                "model",
            ) from None


def load_pipeline(spec: ModelSpec) -> LoadedPipeline:
    """The cached pipeline for `spec`, loading (or, for load_format "dummy", building) it on first use."""
    device = pick_device(spec.device)
    dtype = pick_dtype(device)
    check_options(spec, device)
    if spec.load_format == "dummy":
        from minisgl_cli.media.configs import build_dummy_pipeline, builtin_kind

        if builtin_kind(spec.model) != spec.kind:  # an unknown name: builtin_kind's error lists the built-in ones
            other = "minisgl video" if spec.kind == "image" else "minisgl image"
            raise MediaError(f"{spec.model} is not a text-to-{spec.kind} pipeline (use `{other}`)", "model")
        model_dir = Path(f"<dummy:{spec.model}>")
        source = str(model_dir)
    else:
        model_dir = ensure_model_dir(spec)
        source = str(model_dir.resolve())
    key = (source, device, str(dtype), spec.cpu_offload, compiles(spec, device), spec.attention_backend,
           spec.quantization, spec.media_cache, spec.media_parallel, spec.media_parallel_size, spec.cuda_graphs)
    # One lock for all loads: loads are rare, and two first requests must not load the weights twice.
    with _cache_lock:
        if key in _cache:
            _check_kind(_cache[key].pipe, spec)  # the key names a dir, not what it was loaded for
            return _cache[key]
        if spec.load_format == "dummy":  # built where it runs (offload: on the CPU, as from_pretrained leaves it)
            pipe = build_dummy_pipeline(spec.model, "cpu" if spec.cpu_offload else device, dtype)
        else:
            pipe = _from_disk(model_dir, dtype)
        _check_kind(pipe, spec)
        pool = _configure(pipe, spec, device)
        rank = 0
        if spec.media_parallel is not None:
            import torch.distributed as dist

            rank = dist.get_rank()
        loaded = LoadedPipeline(pipe, spec, model_dir, device, dtype, threading.Lock(), rank, graphs=pool)
        _cache[key] = loaded
        return loaded
