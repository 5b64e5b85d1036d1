"""One image or video generated over several devices (`--media-parallel`): CFG-parallel or Ulysses sequence parallel
over torch.distributed, one process a device; the caller's process is rank 0 and the only one that hands back frames.

- **cfg**: two ranks. In each denoise step of a guided call, rank 0 runs the conditional transformer pass and rank 1
  the unconditional one, then they swap outputs (an all-gather), so both ranks take the same scheduler step. Pipelines
  that make the two passes as two transformer calls, cond then uncond (Wan), are split; `CFG_SPLIT_PIPELINES` names
  them. A small wrapper around the transformer's forward does it: the pipeline's own loop runs unchanged.
- **ulysses**: N ranks through diffusers' context parallelism (`enable_parallelism(ContextParallelConfig(
  ulysses_degree=N))`, the transformer's own `_cp_plan`): the sequence is sharded across ranks and each attention
  runs on 1/N of the heads after an all-to-all. Needs the heads and each job's tokens divisible by N.
- **auto**: cfg when the job is guided (CFG on) and there are two ranks, else ulysses.

Every rank runs the same pipeline call with the same jobs and seeds (rank 0 hands them over a queue); at each step's
end the ranks agree whether to go on (rank 0 may stop the call: a cancel, a shutdown), so none is left waiting in a
collective. Ranks > 0 skip the VAE decode. This module is what runs inside each rank; media/ranks.py starts them.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from minisgl_cli.media.jobs import Cancelled, ImageJob, MediaError, ModelSpec, VideoJob, first_line

MODES = ("cfg", "ulysses", "auto")
CFG_SPLIT_PIPELINES = ("WanPipeline",)  # two transformer calls a guided step: cond, then uncond


def guided(guidance_scale: float) -> bool:
    """Whether a job runs CFG (two transformer passes a step): diffusers' rule for Wan and most pipelines."""
    return guidance_scale > 1.0


def resolve_mode(mode: str, guidance_scale: float, size: int) -> str:
    """`auto` made concrete: cfg for a guided job on two ranks, else ulysses; cfg and ulysses as they are."""
    if mode not in MODES:
        raise MediaError(f"unknown --media-parallel {mode!r}: use one of {', '.join(MODES)}", "media_parallel")
    if mode == "auto":
        return "cfg" if guided(guidance_scale) and size == 2 else "ulysses"
    if mode == "cfg" and not guided(guidance_scale):
        raise MediaError(f"--media-parallel cfg splits the two CFG passes of a step; guidance {guidance_scale:g} "
                         "runs one (CFG is on above 1): use ulysses", "media_parallel")
    return mode


# --- checks before any weights load ------------------------------------------------------------------------------
def check_spec(spec: ModelSpec, device: str) -> None:
    """The parallel options valid for this device and the other options (a clear error, nothing spawned)."""
    mode, size = spec.media_parallel, spec.media_parallel_size
    if mode is None:
        return
    if mode not in ("cfg", "ulysses"):
        raise MediaError(f"unknown --media-parallel {mode!r}: use one of {', '.join(MODES)}", "media_parallel")
    if size < 2:
        raise MediaError(f"--media-parallel needs 2 or more ranks, got --media-parallel-size {size}",
                         "media_parallel_size")
    if mode == "cfg" and size != 2:
        raise MediaError(f"--media-parallel cfg splits the two CFG passes over exactly 2 ranks, got "
                         f"--media-parallel-size {size} (use ulysses for more)", "media_parallel_size")
    import torch

    if device.startswith("cuda"):
        import torch.distributed as dist

        # Rank r runs on the r-th GPU after rank 0's: the group's first GPU is this one less this rank's place.
        first = int(device.partition(":")[2] or 0) - (dist.get_rank() if dist.is_initialized() else 0)
        have = torch.cuda.device_count()
        if first + size > have:
            raise MediaError(f"--media-parallel-size {size} needs {size} GPUs from {device}, this machine has {have}",
                             "media_parallel_size")
    elif device.startswith("cpu"):
        cores = os.cpu_count() or 1
        if size > cores:
            raise MediaError(f"--media-parallel-size {size} is more ranks than this machine's {cores} CPU cores",
                             "media_parallel_size")
    else:
        raise MediaError(f"--media-parallel runs on CUDA (or CPU, gloo), not {device}", "media_parallel")
    if spec.cpu_offload:
        raise MediaError("--media-parallel and --cpu-offload do not combine", "media_parallel")
    if spec.media_cache is not None:
        raise MediaError("--media-parallel and --media-cache do not combine yet", "media_parallel")
    if mode == "ulysses" and spec.compile:  # dynamo fails the first call inside diffusers' hook (inspect.signature)
        raise MediaError("--media-parallel ulysses and --compile do not combine: torch.compile cannot trace diffusers' "
                         "context-parallel hooks (use cfg, or --no-compile)", "compile")
    if mode == "ulysses" and spec.attention_backend == "fp8":
        raise MediaError("--media-parallel ulysses needs an attention backend with context parallelism "
                         "(auto, sdpa, cudnn, flash2, flash3), not fp8", "media_parallel")


def check_model(spec: ModelSpec, pipeline_class: str, transformer_class: str, transformer: dict[str, Any]) -> None:
    """The pipeline can be split this way: cfg knows its two calls a step, ulysses has a plan and divisible heads."""
    mode, size = spec.media_parallel, spec.media_parallel_size
    if mode == "cfg" and pipeline_class not in CFG_SPLIT_PIPELINES:
        raise MediaError(f"--media-parallel cfg splits the two transformer calls of a guided step "
                         f"({', '.join(CFG_SPLIT_PIPELINES)}); {pipeline_class} does not make them so",
                         "media_parallel")
    if mode == "ulysses":
        import diffusers

        if getattr(getattr(diffusers, transformer_class, None), "_cp_plan", None) is None:
            raise MediaError(f"--media-parallel ulysses: {transformer_class} has no context-parallel plan in "
                             f"diffusers {diffusers.__version__}", "media_parallel")
        heads = transformer.get("num_attention_heads") or transformer.get("n_heads")
        if heads and heads % size:
            raise MediaError(f"--media-parallel ulysses splits the attention heads: {transformer_class}'s {heads} "
                             f"heads do not divide over {size} ranks", "media_parallel_size")


def check_model_dir(spec: ModelSpec, model_dir: Path) -> None:
    """check_model from a pipeline dir's config files (model_index.json, transformer/config.json)."""
    index = json.loads((model_dir / "model_index.json").read_text())
    cfg_path = model_dir / "transformer" / "config.json"
    transformer = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    check_model(spec, index.get("_class_name", "?"), transformer.get("_class_name", "?"), transformer)


def check_job(pipe: Any, mode: str, size: int, job: ImageJob | VideoJob) -> None:
    """Ulysses shards each job's tokens evenly: a size whose token count does not divide is refused up front."""
    if mode != "ulysses":
        return
    denoiser = getattr(pipe, "transformer", None)
    patch = tuple(getattr(getattr(denoiser, "config", None), "patch_size", None) or (1, 1, 1))
    pt, ph, pw = patch if len(patch) == 3 else (1, patch[0], patch[0])
    spatial = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8
    temporal = getattr(pipe, "vae_scale_factor_temporal", None) or 1
    frames = ((job.num_frames - 1) // temporal + 1) if isinstance(job, VideoJob) else 1
    tokens = (frames // pt) * (job.height // spatial // ph) * (job.width // spatial // pw)
    if tokens % size:
        what = f"{job.width}x{job.height}" + (f"x{job.num_frames}" if isinstance(job, VideoJob) else "")
        raise MediaError(f"--media-parallel ulysses shards the sequence evenly: {what} is {tokens} tokens, not a "
                         f"multiple of {size} ranks (pick another size or frame count)", "size")


# --- inside a pipeline call --------------------------------------------------------------------------------------
def _denoisers(pipe: Any) -> list[Any]:
    return [m for m in (getattr(pipe, "transformer", None), getattr(pipe, "transformer_2", None)) if m is not None]


@contextlib.contextmanager
def _one_device_a_rank() -> Iterator[None]:
    """diffusers places rank r on accelerator `r % device_count()`, which divides by zero where there is none (a CPU
    group over gloo): count the CPU as one device while it does."""
    import torch

    count = torch.accelerator.device_count
    if count() > 0:
        yield
        return
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = count


def apply(pipe: Any, mode: str, device: str) -> None:
    """Make this rank's pipeline run its part of `mode` (the process group is up)."""
    import torch.distributed as dist

    if mode == "ulysses":
        from diffusers import ContextParallelConfig
        from torch.distributed.device_mesh import init_device_mesh

        # diffusers' CP hooks call a renamed torch collective: its deprecation note, once per call, says nothing here
        warnings.filterwarnings("ignore", message=".*all_gather_tensor.* is deprecated", category=FutureWarning)
        size = dist.get_world_size()
        kind = "cuda" if device.startswith("cuda") else "cpu"
        for denoiser in _denoisers(pipe):
            mesh = init_device_mesh(kind, (1, size), mesh_dim_names=("ring", "ulysses"))
            try:
                with _one_device_a_rank():
                    denoiser.enable_parallelism(config=ContextParallelConfig(ulysses_degree=size, mesh=mesh))
            except (ValueError, RuntimeError) as exc:
                raise MediaError(f"--media-parallel ulysses: {first_line(exc, 200)}", "media_parallel") from None
    else:
        for denoiser in _denoisers(pipe):
            CfgSplit(denoiser, pipe, dist.get_rank())


class CfgSplit:
    """Wraps a transformer's forward so that, in a guided call, rank 0 computes the cond pass and rank 1 the uncond
    one; after the second call the two outputs are exchanged. Rank 1 answers the first call with a buffer that the
    exchange fills before the pipeline reads it (it combines the two only after both calls)."""

    def __init__(self, denoiser: Any, pipe: Any, rank: int):
        self.forward, self.pipe, self.rank = denoiser.forward, pipe, rank
        self.out_channels = denoiser.config.get("out_channels") or denoiser.config.get("in_channels")
        self.calls = 0
        self.first: Any = None  # this rank's output of the step's first call (rank 1: the buffer)
        denoiser.forward = self

    def reset(self) -> None:
        self.calls, self.first = 0, None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch
        import torch.distributed as dist

        if not self.pipe.do_classifier_free_guidance:  # one call a step: every rank makes it
            return self.forward(*args, **kwargs)
        second, self.calls = self.calls % 2 == 1, self.calls + 1
        return_dict = kwargs.get("return_dict", True)
        if not second:
            if self.rank == 0:
                out = self.forward(*args, **kwargs)
                self.first = out[0] if not return_dict else out.sample
                return out
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            self.first = torch.empty((hidden.shape[0], self.out_channels, *hidden.shape[2:]), dtype=hidden.dtype,
                                     device=hidden.device)
            return self._wrap(self.first, return_dict)
        mine = self.first
        if self.rank == 1:
            out = self.forward(*args, **kwargs)
            mine = out[0] if not return_dict else out.sample
            if mine.shape != self.first.shape or mine.dtype != self.first.dtype:
                raise RuntimeError(f"cfg split: the uncond output is {tuple(mine.shape)} {mine.dtype}, the cond "
                                   f"buffer {tuple(self.first.shape)} {self.first.dtype}")
        parts = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(parts, mine.contiguous())
        if self.rank == 1:
            self.first.copy_(parts[0])
        self.first = None
        return self._wrap(parts[1], return_dict)

    @staticmethod
    def _wrap(sample: Any, return_dict: bool) -> Any:
        if not return_dict:
            return (sample,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=sample)


def start_call(pipe: Any) -> None:
    """Before each pipeline call: the CFG split counts its calls from zero."""
    for denoiser in _denoisers(pipe):
        if isinstance(denoiser.forward, CfgSplit):
            denoiser.forward.reset()


def agreed_step(on_step: Callable[[int, int, Any], None] | None, device: str) -> Callable[[int, int, Any], None]:
    """A step hook every rank runs: rank 0's `on_step` may end the call (raise); the ranks then all end it there,
    after one small all-reduce a step, so none waits in a collective for a step that never comes."""
    import torch
    import torch.distributed as dist

    where = torch.device(device if device.startswith("cuda") else "cpu")

    def hook(done: int, total: int, latents: Any) -> None:
        stop: BaseException | None = None
        if on_step is not None:
            try:
                on_step(done, total, latents)
            except BaseException as exc:  # noqa: BLE001 - re-raised below, once the others know
                stop = exc
        flag = torch.tensor([1 if stop is not None else 0], dtype=torch.int32, device=where)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if stop is not None:
            raise stop
        if int(flag.item()):
            raise Cancelled

    return hook
