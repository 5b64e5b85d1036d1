"""EngineConfig: every knob of one engine instance, with defaults chosen per device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LoadFormat = Literal["auto", "dummy"]


@dataclass
class EngineConfig:
    model: str | None = None  # name, HF dir, .gguf file, or (dummy) a built-in config name; None = default
    load_format: LoadFormat = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    attention_backend: str = "auto"
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens; None = from the memory budget
    kv_cache_gib: float = 1.0  # CPU memory budget for the KV pool
    mem_fraction: float = 0.85  # CUDA: fraction of free memory (after weights) for the KV pool
    max_running_requests: int = 64
    max_context_len: int | None = None  # None = the model's max positions (capped by the pool)
    tp_size: int = 1
    seed: int = 0  # dummy weights
    cuda_graph_max_bs: int | None = None  # None = by free memory (256 on a big card), capped by max_running_requests
    disable_cuda_graph: bool = False
    disable_fused_ops: bool = False  # CUDA: use the plain torch ops instead of the fused Triton kernels
    num_threads: int | None = None  # CPU: torch intra-op threads (None = torch's default)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.resolved_device().type == "cuda" else torch.float32
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype not in names:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(names)}")
        return names[self.dtype]
