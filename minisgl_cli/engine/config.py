"""EngineConfig: every knob of one engine instance, with defaults chosen per device.

A knob that is also a command-line option says so in its field's `metadata`: `flags` (the option's
names), `help`, and optionally `env` (its environment variable), `min`, `max`. commands/common.py
builds the Typer options from that, so an option is declared once, here (or on SchedulerConfig).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from minisgl_cli import env

if TYPE_CHECKING:  # torch loads with the engine, not with `minisgl --help`
    import torch

LoadFormat = Literal["auto", "dummy"]
EngineImpl = Literal["auto", "torch", "sgl", "hf", "mlx"]
ENGINES: tuple[str, ...] = ("auto", "torch", "sgl", "hf", "mlx")
# How linear weights are held (layers/quant.py's METHODS); auto picks from the checkpoint and the device.
Quantization = Literal["auto", "none", "int4", "int8", "fp8"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# The KV pool's element type (kvcache/pool.py); auto is the engine dtype.
KVCacheDtype = Literal["auto", "bf16", "fp8_e4m3"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KVCacheDtype)
TorchCompile = Literal["auto", "on", "off"]
TORCH_COMPILES: tuple[str, ...] = get_args(TorchCompile)
DecodeStep = Literal["off", "load", "build"]  # EngineConfig.decode_step
SAMPLERS: tuple[str, ...] = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KeepFree:
    """Memory of one device that another process takes after this engine has sized its KV pool: `serve`'s media
    worker loads its pipeline on the first image request (media/memory.py says how much)."""

    device: str  # "cuda" (= cuda:0), "cuda:1"
    nbytes: int
    what: str  # who keeps it, for the start-up line: "the media worker (z-image-turbo: ...)"
    remedy: str  # what to change when the device cannot hold both


@dataclass
class EngineConfig:
    model: str | None = field(default=None, metadata=dict(  # None = the default model
        flags=("--model", "-m"), env="MODEL_NAME",
        help="Built-in alias, HF dir, .gguf file or hub id (default: SmolLM2-135M-Instruct)."))
    # What runs the model (the reference stack's BACKEND_IMPL). On EngineConfig, not RuntimeConfig: `sgl` is a
    # choice of kernels inside our engine, so it travels with the config to every scheduler process.
    engine: EngineImpl = field(default="auto", metadata=dict(
        flags=("--engine",), env="BACKEND_IMPL",
        help="torch (ours), sgl (ours + sgl_kernel ops), hf (transformers), mlx (mlx-lm), auto."))
    load_format: LoadFormat = field(default="auto", metadata=dict(
        flags=("--load-format",), help="auto (real weights) or dummy (random weights)."))
    device: str = field(default="auto", metadata=dict(
        flags=("--device",), env="MINISGL_DEVICE", help="auto, cpu, cuda, cuda:N."))
    dtype: str = field(default="auto", metadata=dict(
        flags=("--dtype",), help="auto, float32, bfloat16, float16 (auto: bf16 on CUDA, fp32 on CPU)."))
    quantization: Quantization = field(default="auto", metadata=dict(
        flags=("--quantization",),
        help="Linear weights: auto, none, int4, int8 (CPU), fp8 (CUDA 8.9+ or CPU)."))
    kv_cache_dtype: KVCacheDtype = field(default="auto", metadata=dict(
        flags=("--kv-cache-dtype",),
        help="KV cache: auto (= --dtype), bf16, fp8_e4m3 (half the bytes)."))
    attention_backend: str = field(default="auto", metadata=dict(
        flags=("--attention-backend",), env="MINISGL_ATTENTION_BACKEND",
        help="auto, torch, triton, flashinfer (auto: by device)."))
    page_size: int = field(default=1, metadata=dict(
        flags=("--page-size",), min=1, help="KV page size in tokens."))
    max_total_tokens: int | None = field(default=None, metadata=dict(  # None = from the memory budget
        flags=("--max-total-tokens",), min=1, help="KV pool size in tokens (default: from memory)."))
    kv_cache_gib: float = field(default=1.0, metadata=dict(
        flags=("--kv-cache-gib",), min=0.001, help="CPU: memory for the KV pool, GiB."))
    mem_fraction: float | None = field(default=None, metadata=dict(  # of the free memory left after the weights
        flags=("--mem-fraction",), min=0.01, max=1.0,
        help="CUDA: fraction of free memory for the KV pool (default: 0.85, of what is left once serve keeps room for "
             "a media pipeline on the same GPU)."))
    max_running_requests: int = field(default=64, metadata=dict(
        flags=("--max-running-requests",), min=1, help="Requests decoded together at most."))
    disable_cuda_graph: bool = field(default=False, metadata=dict(
        flags=("--disable-cuda-graph",), help="Run decode eagerly on CUDA."))
    cuda_graph_max_bs: int | None = field(default=None, metadata=dict(  # capped by max_running_requests
        flags=("--cuda-graph-max-bs",), min=1,
        help="CUDA: largest decode batch run as a graph (default: by memory)."))
    torch_compile: TorchCompile = field(default_factory=env.torch_compile, metadata=dict(
        flags=("--torch-compile",), env="MINISGL_TORCH_COMPILE",
        help="CPU decode through a compiled step, stored once built (auto: int4 / int8, built in the background by "
             "serve, chat and bench, loaded by every engine; on: also built by the Python API; off: eager)."))
    deterministic: bool = field(default=False, metadata=dict(
        flags=("--deterministic",), env="MINISGL_DETERMINISTIC",
        help="CPU: a greedy request answers alike cold, with its prompt cached and in any batch, in every mode: the "
             "decode runs eagerly (no --torch-compile, whose kernels round unlike the eager ones it stands in for) and "
             "fp32 GEMMs through one kernel at every row count (MINISGL_CPU_GEMM=invariant). The int4 / int8 CPU "
             "modes promise it already where the decode is not compiled (the README's Models section says what "
             "stays out). Refused on CUDA."))
    # Knobs of the Python API only (no flag):
    compile_in_process: bool = False  # auto builds the compiled decode of an in-process engine too (chat, bench)
    max_context_len: int | None = None  # None = the model's max positions (capped by the pool)
    seed: int = 0  # dummy weights
    num_threads: int | None = None  # CPU: torch intra-op threads (None = torch's default)
    kv_cache_scale: float | None = None  # FP8 KV: one fixed scale for every head instead of the first prefill's
    keep_free: KeepFree | None = None  # CUDA: memory a process beside this engine takes later (engine/kv_budget.py)
    # Kernel choices (layers/kernel_choice.py's Kernels), by default from the environment:
    disable_fused_ops: bool = field(default_factory=env.disable_fused_ops)  # CUDA: torch ops, not fused Triton ones
    disable_pdl: bool = field(default_factory=env.disable_pdl)  # CUDA: no programmatic dependent launch
    fused_decode: bool = field(default_factory=env.fused_decode)  # CUDA: the fused GEMVs of 1-4 row decode steps
    cpu_gemm: str = field(default_factory=env.cpu_gemm)  # CPU: GEMM policy (auto, invariant, mkl, fp16)
    sampler: str = field(default_factory=env.sampler)  # auto (triton on CUDA where it imports), torch, triton

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, not {self.engine!r}")
        if self.torch_compile not in TORCH_COMPILES:
            raise ValueError(f"--torch-compile must be one of {', '.join(TORCH_COMPILES)}, not {self.torch_compile!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"MINISGL_SAMPLER must be one of {', '.join(SAMPLERS)}, not {self.sampler!r}")
        if self.kv_cache_scale is not None and not self.kv_cache_scale > 0:
            raise ValueError(f"kv_cache_scale must be positive, got {self.kv_cache_scale}")
        if self.deterministic:
            self._make_deterministic()

    def _make_deterministic(self) -> None:
        """--deterministic: refuse what it cannot keep; take the GEMM policy that is (layers/cpu_gemm.py)."""
        if self.resolved_device().type != "cpu":
            raise ValueError("--deterministic runs on the CPU (the CUDA kernels pick their arithmetic by batch size)")
        if self.torch_compile == "on":
            raise ValueError("--deterministic decodes eagerly; drop --torch-compile on")
        if self.cpu_gemm not in ("auto", "invariant"):
            raise ValueError(f"--deterministic takes MINISGL_CPU_GEMM=invariant, not {self.cpu_gemm!r}")
        self.cpu_gemm = "invariant"

    def resolved_quantization(self, native: str | None = None) -> str:
        """The linear method (a key of layers/quant.py's METHODS): `quantization`, or for auto the checkpoint's
        own (`native`: a GGUF's int4 / int8 blocks, a block-wise FP8 checkpoint's fp8-block) where its method runs
        on this device, else none."""
        from minisgl_cli.layers.quant import METHODS

        device = self.resolved_device()
        if self.quantization == "auto":
            if native == "fp8-block" and device.type == "cuda" and not _fp8_capable(device):
                return "none"  # dequantized at load (layers/quant.py)
            return native if native and device.type in METHODS[native].devices else "none"
        if self.quantization not in METHODS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
        if device.type not in METHODS[self.quantization].devices:
            raise ValueError(f"--quantization {self.quantization} does not run on {device.type}; "
                             f"use --quantization none")
        if self.quantization == "fp8":
            _require_fp8(device, "--quantization fp8")
        return self.quantization

    def decode_step(self, quantization: str, kv_dtype: torch.dtype, tp_size: int, own_process: bool,
                    eager_only: bool = False) -> DecodeStep:
        """How the engine decodes on the CPU (cpu_step/compiled.py): `off` eagerly, `load` through a stored compiled
        step where there is one, `build` also building it (in the background) where there is none. auto takes the
        int4 / int8 CPU modes at TP 1 of a dense full-attention model (`eager_only`: a MoE model, whose experts' CPU
        loop reads each step's row counts back, which no exported step holds; or one with sliding-window or sink
        layers, which no stored step has been built and checked for yet), and builds in a scheduler process
        (`own_process`) or where compile_in_process says; on raises where it cannot run."""
        if self.deterministic:  # __post_init__ refused on
            return "off"
        import torch

        runs = (self.resolved_device().type == "cpu" and tp_size == 1 and quantization in ("int4", "int8")
                and kv_dtype != torch.float8_e4m3fn and not eager_only)
        if self.torch_compile == "on" and not runs:
            raise ValueError("--torch-compile on runs the CPU's int4 / int8 modes at TP 1 over a 16-bit KV cache, "
                             "dense full-attention models only (CUDA decodes through CUDA graphs; MoE experts read "
                             "row counts back)")
        if self.torch_compile == "off" or not runs:
            return "off"
        return "build" if self.torch_compile == "on" or own_process or self.compile_in_process else "load"

    def resolved_kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV pool's element type: the engine dtype (`dtype`), bf16, or e4m3."""
        import torch

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV cache dtype {self.kv_cache_dtype!r}; "
                             f"choose one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8_e4m3":
            _require_fp8(self.resolved_device(), "--kv-cache-dtype fp8_e4m3")
        return {"auto": dtype, "bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}[self.kv_cache_dtype]

    def resolved_dtype(self, quantized: bool = False) -> torch.dtype:
        """The activation / KV dtype. auto: bf16 on CUDA; on CPU fp32, or bf16 for quantized weights (`quantized`)
        where the CPU runs bf16 natively (AVX-512 BF16): their kernels take bf16 anyway, and the dense GEMMs of
        prefill and big batches run twice as fast (docs/benchmarks.md)."""
        import torch

        if self.dtype == "auto":
            if self.resolved_device().type == "cuda":
                return torch.bfloat16
            return torch.bfloat16 if quantized and torch.cpu._is_avx512_bf16_supported() else torch.float32
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype not in names:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(names)}")
        return names[self.dtype]


def _fp8_capable(device: torch.device) -> bool:
    """FP8 on CUDA needs e4m3 tensor cores and conversions (compute capability 8.9+: Ada, Hopper); the CPU
    simulates it."""
    import torch

    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def _require_fp8(device: torch.device, what: str) -> None:
    import torch

    if not _fp8_capable(device):
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"{what} needs a GPU of compute capability 8.9+ (Ada, Hopper); {name} is not one")
