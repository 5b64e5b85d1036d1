"""Loading diffusers pipelines from a model dir (fetched once from the hub if allowed), cached per
(model dir, device, dtype, options) so a server pays the load on first use only."""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_cli import env
from minisgl_cli.device import pick_device, pick_dtype
from minisgl_cli.media.jobs import MediaError, ModelNotFoundError, ModelSpec

# CLI name -> diffusers attention-dispatch backend name.
ATTENTION_BACKENDS = {"sdpa": "native", "flash2": "flash", "flash3": "_flash_3"}

StepCallback = Callable[[int, int], None]  # (steps done, steps total)
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

    def call_params(self) -> set[str] | None:
        """Names `pipe.__call__` accepts; None when it takes **kwargs (accepts anything)."""
        params = inspect.signature(self.pipe.__call__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return None
        return set(params)

    def run(self, kwargs: dict[str, Any], total_steps: int, on_step: StepHook | None) -> Any:
        """One pipeline call with `kwargs` (those it does not take dropped); `on_step` after each denoise step,
        handed the latents (it may raise to end the call there)."""
        accepted = self.call_params()
        kwargs = {k: v for k, v in kwargs.items() if v is not None and (accepted is None or k in accepted)}
        if on_step is not None and (accepted is None or "callback_on_step_end" in accepted):

            def step_end(pipe: Any, i: int, t: Any, callback_kwargs: dict) -> dict:
                on_step(i + 1, total_steps, callback_kwargs.get("latents"))
                return callback_kwargs

            kwargs["callback_on_step_end"] = step_end
            if accepted is None or "callback_on_step_end_tensor_inputs" in accepted:
                kwargs["callback_on_step_end_tensor_inputs"] = ["latents"]
        import torch

        with self.lock, torch.inference_mode():
            return self.pipe(**kwargs)


_cache: dict[tuple, LoadedPipeline] = {}
_cache_lock = threading.Lock()


def _env_for(spec: ModelSpec) -> str:
    return env.IMAGE_MODEL_DIR if spec.kind == "image" else env.VIDEO_MODEL_DIR


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()


def _first_line(exc: Exception, limit: int = 120) -> str:
    """Library errors run to paragraphs; our messages stay one line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


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
        reason = _first_line(exc)
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


def _configure(pipe: Any, spec: ModelSpec, device: str) -> None:
    if spec.attention_backend not in ATTENTION_BACKENDS:
        raise MediaError(
            f"unknown attention backend {spec.attention_backend!r}: use one of {', '.join(ATTENTION_BACKENDS)}",
            "attention_backend",
        )
    if spec.cpu_offload:
        if not device.startswith("cuda"):
            raise MediaError(f"--cpu-offload needs a CUDA device, this run uses {device}", "cpu_offload")
        pipe.enable_model_cpu_offload()
    else:
        pipe.to(device)
    denoiser = _denoiser(pipe)
    if spec.attention_backend != "sdpa":
        if not device.startswith("cuda"):
            raise MediaError(f"--attention-backend {spec.attention_backend} needs CUDA (use sdpa)", "attention_backend")
        if not hasattr(denoiser, "set_attention_backend"):
            raise MediaError(
                f"{type(pipe).__name__} does not support choosing the attention backend", "attention_backend"
            )
        try:
            denoiser.set_attention_backend(ATTENTION_BACKENDS[spec.attention_backend])
        except Exception as exc:  # e.g. flash-attn not installed or GPU too old
            raise MediaError(
                f"--attention-backend {spec.attention_backend} unavailable: {exc}", "attention_backend"
            ) from None
    if spec.compile:
        if denoiser is None:
            raise MediaError(f"{type(pipe).__name__} has no transformer/unet to compile", "compile")
        denoiser.compile()  # in place, so the pipeline keeps its registered module
    # Fronts show their own progress through step callbacks; diffusers' tqdm would garble it.
    pipe.set_progress_bar_config(disable=True)


def load_pipeline(spec: ModelSpec) -> LoadedPipeline:
    """The cached pipeline for `spec`, loading it on first use."""
    device = pick_device(spec.device)
    dtype = pick_dtype(device)
    model_dir = ensure_model_dir(spec)
    key = (str(model_dir.resolve()), device, str(dtype), spec.cpu_offload, spec.compile, spec.attention_backend,
           spec.quantization, spec.media_cache)
    # One lock for all loads: loads are rare, and two first requests must not load the weights twice.
    with _cache_lock:
        if key in _cache:
            _check_kind(_cache[key].pipe, spec)  # the key names a dir, not what it was loaded for
            return _cache[key]
        from diffusers import DiffusionPipeline

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # `torch_dtype` renamed `dtype` in newer diffusers
            try:
                pipe = DiffusionPipeline.from_pretrained(str(model_dir), torch_dtype=dtype)
            except (OSError, ValueError) as exc:
                raise ModelNotFoundError(
                    f"cannot load a diffusers pipeline from {model_dir}: {_first_line(exc) or type(exc).__name__}",
                    "model",
                ) from None
        _check_kind(pipe, spec)
        _configure(pipe, spec, device)
        loaded = LoadedPipeline(pipe, spec, model_dir, device, dtype, threading.Lock())
        _cache[key] = loaded
        return loaded
