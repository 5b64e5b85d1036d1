"""The FlashInfer attention backend: paged decode/prefill wrappers over our pool, imported lazily.

Our pool keeps per layer `k[layer]` of shape [num_slots, Hkv, D] with num_slots = (num_pages+1) *
page_size and slot = page * page_size + offset, i.e. exactly FlashInfer's NHD paged layout
[num_pages+1, page_size, Hkv, D] once viewed so (page 0 is our scratch page and simply never listed).
FlashInfer addresses KV by page, so this backend assumes what the pool's allocator guarantees: position
p of a request lives in the request's (p // page_size)-th page at offset p % page_size. The page list of
a request is then `page_table[row, 0:seq_len:page_size] // page_size`.

Written against flashinfer-python's documented 0.2+/0.3+ wrapper API (`plan(...)` once per step,
`run(q, (k_cache, v_cache))` per layer); see `FlashInferBackend` for the CUDA-graph protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kvcache.pool import KVPool

_WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's split-KV scratch; its docs use 128 MiB


@dataclass
class FlashInferMeta:
    wrapper: Any  # the planned decode or prefill wrapper whose run() every layer calls


class FlashInferBackend(AttentionBackend):
    """Paged attention through FlashInfer; same pool, same semantics as `TorchBackend`.

    `prepare(batch)` builds the per-step page lists (indptr / indices / last_page_len) and calls the
    matching wrapper's `plan` once; `attend` calls `run` per layer (the base `forward` stores K/V first).

    CUDA graphs (decode only), same protocol as `TritonBackend`:
    `init_cuda_graph_state(max_bs)` once; per captured `bs`, `prepare_for_capture(bs, batch)` (sets
    `batch.attn_meta`; plans a graph-mode wrapper of `bs` rows over one dummy page per row), an eager
    warm-up forward, then capture; per replay, `prepare_for_replay(real_batch, bs)` re-plans that
    wrapper with the real page lists (padding rows point at scratch page 0, one token each) -- plan runs
    on the host and copies into the wrapper's static buffers, which the captured kernels read.
    """

    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(pool, num_heads, num_kv_heads, head_dim, scale)
        if pool.quantized:  # its FP8 KV kernels take one K and one V scale per layer; ours are per head
            raise ValueError("--kv-cache-dtype fp8_e4m3 is not supported by the flashinfer attention backend "
                             "(it scales FP8 KV per layer, this pool per head): use --attention-backend triton")
        import flashinfer  # lazy: optional dependency, CUDA only

        if pool.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA KV pool")
        self._fi = flashinfer
        self.page_size = pool.page_size
        self.dtype = pool.shape.dtype
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=pool.device)
        # Grouped heads: FlashInfer's CUDA-core decode kernel is specialised for small groups; past 4
        # query heads per KV head its tensor-core (prefill-kernel) path is the faster one.
        self.decode_tensor_cores = num_heads // num_kv_heads > 4
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores
        )
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self._graph_wrappers: dict[int, Any] = {}
        self._graph_bufs: dict[str, torch.Tensor] | None = None
        self._graph_max_bs = 0

    # --- page lists ------------------------------------------------------------------------------
    def _paged_kv(
        self, req_rows: torch.Tensor, seq_lens_cpu: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr [B+1] int32 on the host, page indices [total] int32 on the device, last_page_len [B] int32 host)."""
        ps = self.page_size
        pages = torch.tensor([-(-s // ps) for s in seq_lens_cpu], dtype=torch.int32)
        indptr = torch.zeros(len(seq_lens_cpu) + 1, dtype=torch.int32)
        torch.cumsum(pages, 0, out=indptr[1:])
        last = torch.tensor(seq_lens_cpu, dtype=torch.int32) - (pages - 1) * ps
        total = int(indptr[-1])
        dev = self.pool.device
        # Flat (request, page j) pairs built on the device; output_size avoids a host sync.
        req = torch.repeat_interleave(
            torch.arange(len(seq_lens_cpu), device=dev), pages.to(dev, non_blocking=True), output_size=total
        )
        starts = indptr[:-1].to(dev, non_blocking=True).long()
        j = torch.arange(total, device=dev) - starts[req]
        first_slot = self.pool.page_table[req_rows.long()[req], j * ps]
        return indptr, (first_slot // ps).to(torch.int32), last

    def _kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (-1, self.page_size, self.num_kv_heads, self.head_dim)
        return self.pool.k[layer_id].view(shape), self.pool.v[layer_id].view(shape)

    def _plan_decode(self, wrapper: Any, indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor) -> None:
        wrapper.plan(
            indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            pos_encoding_mode="NONE", q_data_type=self.dtype, kv_data_type=self.dtype, sm_scale=self.scale,
        )

    # --- per step --------------------------------------------------------------------------------
    def prepare(self, batch: ForwardBatch) -> None:
        indptr, indices, last = self._paged_kv(batch.req_rows, batch.seq_lens_cpu)
        if batch.is_decode:
            self._plan_decode(self.decode_wrapper, indptr, indices, last)
            batch.attn_meta = FlashInferMeta(self.decode_wrapper)
            return
        qo_indptr = torch.zeros(batch.batch_size + 1, dtype=torch.int32)
        torch.cumsum(torch.tensor(batch.extend_lens_cpu, dtype=torch.int32), 0, out=qo_indptr[1:])
        # causal=True aligns the mask to the end of each sequence: query i of an extend of length E over
        # a KV of length L sits at position L - E + i, which is exactly "cached prefix + causal".
        self.prefill_wrapper.plan(
            qo_indptr, indptr, indices, last,
            self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
            causal=True, sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )
        batch.attn_meta = FlashInferMeta(self.prefill_wrapper)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        window: int = 0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window or sinks is not None:  # create_backend refuses such models; a direct caller learns it here
            raise ValueError("the flashinfer backend runs neither sliding windows nor sinks here")
        q = q.contiguous()
        return batch.attn_meta.wrapper.run(q, self._kv_cache(layer_id))

    # --- CUDA graphs -----------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        dev = self.pool.device
        max_pages = -(-self.pool.max_context_len // self.page_size)
        self._graph_bufs = {
            "indptr": torch.zeros(max_bs + 1, dtype=torch.int32, device=dev),
            "indices": torch.zeros(max_bs * max_pages, dtype=torch.int32, device=dev),
            "last": torch.ones(max_bs, dtype=torch.int32, device=dev),
        }
        self._graph_max_bs = max_bs

    def _graph_wrapper(self, bs: int) -> Any:
        if self._graph_bufs is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) first")
        if not 1 <= bs <= self._graph_max_bs:
            raise ValueError(f"graph batch size {bs} outside 1..{self._graph_max_bs}")
        if bs not in self._graph_wrappers:
            g = self._graph_bufs
            # Graph sizes are replayed one at a time, so they may share the static buffers.
            self._graph_wrappers[bs] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                paged_kv_indptr_buffer=g["indptr"][: bs + 1],
                paged_kv_indices_buffer=g["indices"],
                paged_kv_last_page_len_buffer=g["last"][:bs],
            )
        return self._graph_wrappers[bs]

    def prepare_for_capture(self, bs: int, batch: ForwardBatch | None = None) -> FlashInferMeta:
        wrapper = self._graph_wrapper(bs)
        indptr = torch.arange(bs + 1, dtype=torch.int32)  # one page per row: scratch page 0, one token
        indices = torch.zeros(bs, dtype=torch.int32, device=self.pool.device)
        last = torch.ones(bs, dtype=torch.int32)
        self._plan_decode(wrapper, indptr, indices, last)
        meta = FlashInferMeta(wrapper)
        if batch is not None:
            batch.attn_meta = meta
        return meta

    def prepare_for_replay(self, batch: ForwardBatch, bs: int) -> None:
        wrapper = self._graph_wrapper(bs)
        n = batch.batch_size
        if n > bs:
            raise ValueError(f"batch of {n} does not fit a graph of {bs}")
        indptr, indices, last = self._paged_kv(batch.req_rows, batch.seq_lens_cpu)
        if n < bs:  # padding rows: one token on scratch page 0
            pad = bs - n
            indptr = torch.cat([indptr, indptr[-1] + torch.arange(1, pad + 1, dtype=torch.int32)])
            indices = torch.cat([indices, torch.zeros(pad, dtype=torch.int32, device=indices.device)])
            last = torch.cat([last, torch.ones(pad, dtype=torch.int32)])
        self._plan_decode(wrapper, indptr, indices, last)
