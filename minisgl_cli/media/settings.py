"""MediaSettings: which image and video models the media routes serve, where their weights are, how they load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_cli import env
from minisgl_cli.media.jobs import DEFAULT_IMAGE_MODEL, DEFAULT_VIDEO_MODEL, Kind, ModelSpec


@dataclass(frozen=True)
class MediaSettings:
    """Which models the server's media routes use and where their weights are."""

    image_model: str = DEFAULT_IMAGE_MODEL
    image_model_dir: Path | None = None  # None: ~/.cache/mini-sglang/<model>
    video_model: str = DEFAULT_VIDEO_MODEL
    video_model_dir: Path | None = None
    device: str | None = None  # None: mps -> cuda -> cpu
    cpu_offload: bool = False
    compile: bool | None = None  # None: on for CUDA (regional compile of the DiT's blocks), off on CPU / MPS
    attention_backend: str = "auto"  # media/pipelines.py ATTENTION_BACKENDS
    quantization: str | None = None
    media_cache: str | None = None
    load_format: str = "auto"
    cuda_graphs: bool = True  # CUDA graphs of the short passes on CUDA (media/graphs.py)
    # The video pipeline over several GPUs (media/parallel.py): cfg, ulysses or auto (resolved for the default video
    # job's guidance); None: one GPU. The image pipelines (Z-Image) have neither split.
    media_parallel: str | None = None
    media_parallel_size: int = 2
    # A request must never start a multi-GB download: fetch weights with the CLI or point at a dir.
    allow_download: bool = False
    # The media worker's admission caps (media/service.py) and its batches (media/worker.py).
    max_queue: int = 32  # jobs waiting for the worker; past it 429
    max_batch: int = 4  # images in one pipeline call
    # Megapixel-steps (width x height x steps x images, or x frames) admitted and not finished: a request past it
    # alone is a 400, one that would take the total past it a 503 with Retry-After. Wan 832x480x81 x 50 steps is 1617.
    max_work: float = 4096.0

    @classmethod
    def from_env(cls) -> MediaSettings:
        """The variables that are set; a field's default where its variable is not."""
        values: dict[str, Any] = dict(
            image_model=env.image_model(),
            image_model_dir=env.image_model_dir(),
            video_model=env.video_model(),
            video_model_dir=env.video_model_dir(),
            device=env.media_device(),
            compile=env.media_compile(),
            attention_backend=env.media_attention_backend(),
            quantization=env.media_quantization(),
            media_cache=env.media_cache(),
            load_format=env.media_load_format(),
            cuda_graphs=env.media_cuda_graphs(),
            media_parallel=env.media_parallel(),
            media_parallel_size=env.media_parallel_size(),
            max_queue=env.media_max_queue(),
            max_batch=env.media_max_batch(),
            max_work=env.media_max_work(),
        )
        return cls(**{k: v for k, v in values.items() if v is not None})

    def spec(self, kind: Kind) -> ModelSpec:
        model, model_dir = (
            (self.image_model, self.image_model_dir) if kind == "image" else (self.video_model, self.video_model_dir)
        )
        parallel = None
        if kind == "video" and self.media_parallel is not None:
            from minisgl_cli.media.jobs import VideoJob, job_defaults
            from minisgl_cli.media.parallel import resolve_mode

            guidance = job_defaults(VideoJob)["guidance_scale"]
            parallel = resolve_mode(self.media_parallel, guidance, self.media_parallel_size)
        return ModelSpec.create(
            kind, model, model_dir, device=self.device, cpu_offload=self.cpu_offload, compile=self.compile,
            attention_backend=self.attention_backend, allow_download=self.allow_download,
            quantization=self.quantization, media_cache=self.media_cache, load_format=self.load_format,
            cuda_graphs=self.cuda_graphs,
            media_parallel=parallel, media_parallel_size=self.media_parallel_size,
        )

    def available(self, kind: Kind) -> bool:
        """Whether a request for this kind can run: the pipeline is on disk (or may be downloaded)."""
        spec = self.spec(kind)
        return spec.load_format == "dummy" or spec.allow_download or (spec.model_dir / "model_index.json").is_file()

    def serves(self, kind: Kind, requested: str | None) -> bool:
        """Whether a request's `model` names this server's model (any model name if none given)."""
        if not requested:
            return True
        model = self.image_model if kind == "image" else self.video_model
        names = {model, model.rstrip("/").split("/")[-1]}
        if model == DEFAULT_IMAGE_MODEL:
            names |= {"z-image", "z-image-turbo"}
        return requested in names or requested.lower() in {n.lower() for n in names}
