"""One pipeline call for a batch of compatible jobs: each image its own seeded generator, one result per job.

`minisgl image` / `minisgl video` run it with one job; the media worker with the jobs it batched. Image i of a job is
drawn from the seed `seed + i` (diffusers' `randn_tensor` draws row i from generator i), so every image is
reproducible alone (n=1, that seed) and comes out the same whether its job ran alone or batched with others.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from minisgl_cli.media.jobs import Cancelled, ImageJob, ImageResult, VideoJob, VideoResult
from minisgl_cli.media.limits import check_job, prompt_kwargs
from minisgl_cli.media.pipelines import LoadedPipeline, StepHook

Job = ImageJob | VideoJob


def batch_key(job: Job) -> tuple:
    """Jobs with equal keys run in one call: same kind, size, steps, guidance, frames and negative-prompt-ness."""
    frames = job.num_frames if isinstance(job, VideoJob) else 0
    return (type(job).__name__, job.width, job.height, job.steps, job.guidance_scale, frames,
            job.negative_prompt is not None)


def rows(job: Job) -> int:
    """The batch rows a job takes: its images (a video is one)."""
    return job.num_images if isinstance(job, ImageJob) else 1


def spans(jobs: list[Job]) -> list[slice]:
    """Each job's rows of the batch, in order."""
    out, start = [], 0
    for job in jobs:
        out.append(slice(start, start + rows(job)))
        start += rows(job)
    return out


def generate(loaded: LoadedPipeline, jobs: list[Job], on_step: StepHook | None = None) -> list[Any]:
    """Run `jobs` (equal `batch_key`s) as one pipeline call: an ImageResult or VideoResult per job, in order.
    `on_step(done, total, latents)` after each step; a `Cancelled` it raises propagates out of the call."""
    import torch

    first = jobs[0]
    assert all(batch_key(j) == batch_key(first) for j in jobs), "generate() takes compatible jobs only"
    parallel = loaded.spec.media_parallel
    for job in jobs:  # a size or frame count past the pipeline's tables: a MediaError, not a traceback inside it
        check_job(loaded.pipe, job)
        if parallel is not None:
            from minisgl_cli.media.parallel import check_job as check_split

            check_split(loaded.pipe, parallel, loaded.spec.media_parallel_size, job)
    if loaded.ranks is not None:  # rank 0 of a media group: the other ranks make the same call
        loaded.ranks.submit(jobs)
    prompts, negatives, generators = [], [], []
    for job in jobs:
        assert job.seed is not None  # the job's __post_init__ resolved it
        for i in range(rows(job)):
            prompts.append(job.prompt)
            negatives.append(job.negative_prompt)
            # A CPU generator gives the same noise for a seed on every device.
            generators.append(torch.Generator("cpu").manual_seed(job.seed + i))
    kwargs: dict[str, Any] = {
        "prompt": prompts,
        "negative_prompt": negatives if first.negative_prompt is not None else None,
        "height": first.height,
        "width": first.width,
        "num_inference_steps": first.steps,
        "guidance_scale": first.guidance_scale,
        "generator": generators,
        **prompt_kwargs(loaded.pipe),
    }
    if isinstance(first, ImageJob):
        kwargs |= {"num_images_per_prompt": 1, "output_type": "pt"}  # made 8-bit on the device: rgb_images
    else:
        kwargs |= {"num_frames": first.num_frames, "output_type": "pt"}  # made 8-bit on the device: uint8_frames
    loaded.tile_vae_for(first.width, first.height, first.num_frames if isinstance(first, VideoJob) else 1)
    start = time.perf_counter()
    out = loaded.run(kwargs, first.steps, on_step)
    # The call returns with the VAE's kernels still queued (CUDA, MPS): they are its time too.
    if loaded.device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(loaded.device))
    elif loaded.device == "mps":
        torch.mps.synchronize()
    elapsed_s = time.perf_counter() - start
    if loaded.rank > 0:  # a media group's other rank: rank 0 hands back the results
        return []
    results: list[Any] = []
    for job, span in zip(jobs, spans(jobs), strict=True):
        assert job.seed is not None
        if isinstance(job, ImageJob):
            images = rgb_images(out.images[span])
            results.append(ImageResult(images, job.seed, elapsed_s, loaded.model_dir))
        else:
            results.append(VideoResult(uint8_frames(out.frames[span.start]), job.fps, job.seed, elapsed_s,
                                       loaded.model_dir))
    return results


def warm_up(loaded: LoadedPipeline, like: Job, max_rows: int = 3, idle: Callable[[], bool] = lambda: True) -> bool:
    """Compile a compiled pipeline's batched graphs ahead of need: four 1-step calls of a few rows shaped like `like`.
    torch.compile specializes a batch of one, so the first batched call would compile the DiT's blocks and the VAE
    decode again (seconds with the stored compile, tens of seconds cold), and each variant a batch brings after it:
    captions of unequal length (a padding mask), n > 1 of one prompt (none), other batch sizes and caption lengths.
    These calls meet them once. The worker runs this while idle: once `idle()` turns false (a job arrived, a stop)
    it gives way after the step or compile under way; returns whether it ran to the end."""
    short = dataclasses.replace(like, prompt="warm-up", steps=1, negative_prompt=like.negative_prompt and "warm-up")
    if isinstance(short, ImageJob):
        short = dataclasses.replace(short, num_images=1)
    long = dataclasses.replace(short, prompt="a longer warm-up prompt " * 8)

    def give_way(*_: Any) -> None:
        if not idle():
            raise Cancelled

    # Each variant (masked or not) seen at two batch sizes: after the second its batch dimension is symbolic.
    for jobs in ([short, long], [short, long, long], [long, long], [long, long, long]):
        try:
            give_way()
            generate(loaded, jobs[:max_rows], give_way)
        except Cancelled:
            return False
    return True


def uint8_frames(video: Any) -> list[Any]:
    """One video of a pipeline's `.frames` as 8-bit H x W x C arrays. From its "pt" output (F x C x H x W in [0, 1])
    made 8-bit on the video's device as rgb_images does (Wan's 81 frames at 832x480: 97 MB cross to the host, not
    388 MB of floats then a float pass there); a float array in [0, 1], a uint8 array or PIL images as they come."""
    import numpy as np
    import torch

    if isinstance(video, torch.Tensor):
        return list(_to_uint8_hwc(video))
    if isinstance(video, (list, tuple)) and video and not isinstance(video[0], np.ndarray):
        return [np.asarray(f.convert("RGB")) for f in video]  # PIL images
    arr = np.asarray(video)
    if arr.dtype != np.uint8:
        arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
    return list(arr)


def _to_uint8_hwc(x: Any) -> Any:
    """N x C x H x W in [0, 1] -> N x H x W x C uint8 numpy: diffusers' own 8-bit step (x * 255 in float32, rounded
    half to even, as its numpy postprocess rounds) on x's device, then one copy to the host."""
    import torch

    return (x.float() * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().cpu().numpy()


def preview(loaded: LoadedPipeline, latents: Any, span: slice) -> list[Any]:
    """The images `latents[span]` would decode to now (PIL, RGB), through the pipeline's VAE: a job's partial images.
    Pipelines whose latents the VAE reads as they are (Z-Image, SD-style): scaled back, shifted, decoded."""
    pipe = loaded.pipe
    vae = pipe.vae
    lat = latents[span].to(vae.dtype) / vae.config.scaling_factor + (getattr(vae.config, "shift_factor", None) or 0.0)
    image = vae.decode(lat, return_dict=False)[0]
    return rgb_images(pipe.image_processor.postprocess(image, output_type="pt"))


def rgb_images(images: Any) -> list[Any]:
    """A pipeline's images as RGB PIL images. From its "pt" output (N x C x H x W in [0, 1]) the 8-bit step is
    diffusers' own (x * 255 in float32, rounded half to even) done on the images' device: the same bytes as its "pil"
    output, with a quarter of the float copy's bytes crossing to the host and no float pass over them there."""
    import numpy as np
    import torch
    from PIL import Image

    if not isinstance(images, torch.Tensor):  # a pipeline that gave PIL images anyway
        return [im.convert("RGB") for im in images]
    pixels = _to_uint8_hwc(images)
    return [Image.fromarray(np.repeat(p, 3, axis=2) if p.shape[2] == 1 else p[:, :, :3]) for p in pixels]
