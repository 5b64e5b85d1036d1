"""The attention backend interface: prepare metadata for a batch, then store KV and attend per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kernels.fp8 import KVQuant
from minisgl_cli.kvcache.pool import KVPool


class KVBuffers(NamedTuple):
    """One layer's pool tensors for a kernel that stores K/V itself (kernels/triton/ops.py's fused RoPE)."""

    k: torch.Tensor  # [slots, Hkv, D]
    v: torch.Tensor
    loc: torch.Tensor  # [T] slot of each new token
    quant: KVQuant | None  # an FP8 pool's scales and means of this layer; None for 16-bit


class AttentionBackend(ABC):
    """One implementation per kernel family (torch, triton, flashinfer); all share the KV pool layout.

    `prepare` runs once per step before the model forward (it may build index tensors into
    `batch.attn_meta`); `forward` runs once per layer: it writes this step's K/V into the pool at
    `batch.out_cache_loc` (unless a fused RoPE kernel already did) and returns attention over each request's
    whole sequence (causal for extend). A layer may attend through a sliding `window` (a query sees itself and the
    window - 1 positions before it; 0: all) and with `sinks` (a logit per query head that joins the softmax's
    denominator only: gpt-oss); both are per-layer constants, so CUDA graphs capture them as they are. An FP8
    pool's first prefill at each layer sets that layer's scales first (kvcache/pool.py), so that step stores
    through `store`, not through a fused kernel. A pool's window layers (kvcache/pool.py) store and read through its
    `slot_map` (`pool.loc_of`, `pool.slot_map_of`): the page table's slots are the full layers'.
    """

    name: str = "base"

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.pool = pool
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        kv_stored: bool = False, window: int = 0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]. kv_stored: the caller already wrote k/v to the pool;
        window: the layer's sliding window (0: full); sinks: [H] fp32 logits of this rank's heads, or None."""
        if not kv_stored:
            if not batch.is_decode and self.pool.needs_scales(layer_id):
                self.pool.calibrate(layer_id, k, v)
            self.store(layer_id, self.pool.loc_of(layer_id, batch.out_cache_loc), k, v)
        return self.attend(q, k, v, layer_id, batch, window, sinks)

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's K/V into the pool at `loc` (a backend may use its own kernel)."""
        self.pool.store(layer_id, loc, k, v)

    @abstractmethod
    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        window: int = 0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over each request's sequence (its last `window` positions where window > 0; the softmax's
        denominator plus exp(sinks[h]) where given), this step's K/V already in the pool; k/v are this step's own
        rows (a backend may use them instead of reading them back)."""

    def kv_buffers(self, layer_id: int, batch: ForwardBatch) -> KVBuffers | None:
        """Where a fused kernel may store this step's K/V, or None when `forward` must store them itself
        (an FP8 layer whose scales this prefill sets)."""
        pool = self.pool
        if not batch.is_decode and pool.needs_scales(layer_id):
            return None
        return KVBuffers(pool.k[layer_id], pool.v[layer_id], pool.loc_of(layer_id, batch.out_cache_loc),
                         pool.layer_quant(layer_id))

    # CUDA-graph hooks: backends that support graph capture of decode override these.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{self.name} backend does not support CUDA graphs")

    def prepare_for_capture(self, bs: int, batch: ForwardBatch | None = None) -> Any:
        """Decode metadata of static buffers for a graph of `bs` rows; set as `batch.attn_meta` if given."""
        raise NotImplementedError(f"{self.name} backend does not support CUDA graphs")

    def prepare_for_replay(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a real decode batch (batch_size <= bs) into the static metadata captured for `bs`."""
        raise NotImplementedError(f"{self.name} backend does not support CUDA graphs")

    def graph_rows(self, bs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The static page rows [bs] int64 and lengths [bs] int32 graph `bs` reads, where filling them with the
        batch's (padding rows 0 and 1) is all `prepare_for_replay` would do now: the replay writes them in its one
        input launch (kernels/triton/step_inputs.py). None: it calls `prepare_for_replay`."""
        return None
