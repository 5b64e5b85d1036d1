"""Options every engine-backed command shares (model, device, backend, KV, scheduler), flags and env vars."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Annotated, Any, Optional

import typer

Model = Annotated[
    Optional[str],
    typer.Option("--model", "-m", envvar="MODEL_NAME",
                 help="Model: built-in alias (default SmolLM2-135M-Instruct, bundled GGUF), HF dir, .gguf file, "
                      "hub id; with --load-format dummy a built-in config (qwen3-0.6b, llama-3.1-8b, ...)."),
]
ModelLocalDir = Annotated[
    Optional[str],
    typer.Option("--model-local-dir", envvar="MODEL_LOCAL_DIR", help="A pre-downloaded model dir; overrides --model."),
]
LoadFormat = Annotated[str, typer.Option("--load-format", help="auto (real weights) or dummy (random weights).")]
Device = Annotated[str, typer.Option("--device", envvar="MINISGL_DEVICE", help="auto, cpu, cuda, cuda:N.")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.")]
AttentionBackend = Annotated[
    str, typer.Option("--attention-backend", "--backend", envvar="BACKEND_IMPL",
                      help="auto, torch, triton, flashinfer (auto: flashinfer or triton on CUDA, torch on CPU).")
]
PageSize = Annotated[int, typer.Option("--page-size", min=1, help="KV page size in tokens.")]
MaxTotalTokens = Annotated[Optional[int], typer.Option("--max-total-tokens", min=1, help="KV pool size in tokens (default: from memory).")]
KVCacheGiB = Annotated[float, typer.Option("--kv-cache-gib", min=0.001, help="CPU: memory for the KV pool, GiB.")]
MemFraction = Annotated[float, typer.Option("--mem-fraction", min=0.01, max=1.0, help="CUDA: fraction of free memory for the KV pool.")]
MaxRunning = Annotated[int, typer.Option("--max-running-requests", min=1, help="Requests decoded together at most.")]
MaxPrefill = Annotated[int, typer.Option("--max-prefill-tokens", min=1, help="Token budget of one prefill step (chunk size).")]
Cache = Annotated[str, typer.Option("--cache", help="Prefix cache: radix or naive (no reuse).")]
Policy = Annotated[str, typer.Option("--policy", envvar="SCHEDULE_POLICY", help="prefill-first or decode-first.")]
DisableCudaGraph = Annotated[bool, typer.Option("--disable-cuda-graph", help="Run decode eagerly on CUDA.")]
CudaGraphMaxBs = Annotated[
    Optional[int], typer.Option("--cuda-graph-max-bs", min=1,
                                help="CUDA: largest decode batch captured in a graph (default: 256 / 128 / 32 by "
                                     "free memory); bigger batches run eagerly.")
]
DisableOverlap = Annotated[
    bool, typer.Option("--disable-overlap", envvar="MINISGL_DISABLE_OVERLAP_SCHEDULING",
                       help="CUDA: read each step's tokens before launching the next (no overlap scheduling).")
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="INFO logs narrating prefill, decode steps and chunks.")]


@dataclass
class EngineOptions:
    """The shared options, collected so a command passes one object to its front."""

    model: str | None = None
    model_local_dir: str | None = None
    load_format: str = "auto"
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str = "auto"
    page_size: int = 1
    max_total_tokens: int | None = None
    kv_cache_gib: float = 1.0
    mem_fraction: float = 0.85
    max_running_requests: int = 64
    max_prefill_tokens: int = 2048
    cache: str = "radix"
    policy: str = "prefill-first"
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    disable_overlap: bool = False

    @classmethod
    def from_params(cls, params: dict[str, Any], **overrides: Any) -> "EngineOptions":
        """The options among a command's parsed parameters (`ctx.params`; a command lists only those it offers),
        with `overrides` taking precedence."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in params.items() if k in names}, **overrides})

    def engine_config(self):
        from minisgl_cli.engine.config import EngineConfig

        return EngineConfig(
            model=self.model_local_dir or self.model, load_format=self.load_format, device=self.device,
            dtype=self.dtype, attention_backend=self.attention_backend, page_size=self.page_size,
            max_total_tokens=self.max_total_tokens, kv_cache_gib=self.kv_cache_gib, mem_fraction=self.mem_fraction,
            max_running_requests=self.max_running_requests, disable_cuda_graph=self.disable_cuda_graph,
            cuda_graph_max_bs=self.cuda_graph_max_bs,
        )

    def scheduler_config(self):
        from minisgl_cli.scheduler.scheduler import SchedulerConfig

        return SchedulerConfig(max_prefill_tokens=self.max_prefill_tokens, policy=self.policy, cache=self.cache,
                               disable_overlap=self.disable_overlap)

    def client(self):
        """Build the engine client; loader errors become one line on stderr and exit code 1."""
        from minisgl_cli.loader.errors import ModelLoadError

        try:
            from minisgl_cli.client import EngineClient

            return EngineClient(self.engine_config(), self.scheduler_config())
        except (ModelLoadError, ValueError) as exc:
            fail(str(exc))


def fail(message: str, code: int = 1) -> None:
    """Print one line to stderr and exit non-zero: how every command reports bad input."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
