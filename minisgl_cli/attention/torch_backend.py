"""The torch attention backend: SDPA over gathered paged KV; runs on CPU and is the GPU kernels' reference.

Reads go through `KVPool.read`, which dequantizes an FP8 pool: on the CPU this is the FP8 KV cache itself
(stored as e4m3 codes), and on the GPU the reference the Triton kernels are checked against."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.core.batch import ForwardBatch
from minisgl_cli.kvcache.pool import KVPool

_PAD = 16  # the CPU's fp32 vector width (AVX-512; twice AVX2's): see TorchBackend.prepare


@dataclass
class TorchDecodeMeta:
    slots: torch.Tensor  # [B * L] KV slots, row-major, padded with the scratch slot 0
    max_len: int
    mask: torch.Tensor  # [B, 1, 1, L] additive: 0 where a position is real, -inf on padding


@dataclass
class TorchExtendMeta:
    starts: list[int]  # row offsets of each request in the flat batch
    slots: list[torch.Tensor | None]  # per request: [seq_len] KV slots; None when nothing is cached
    masks: list[torch.Tensor | None]  # per request: [extend, seq_len] causal mask; None = plain causal


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 serial_decode: bool = False):
        """`serial_decode`: decode attention on one thread (--deterministic). torch's CPU SDPA splits its work by
        the batch and the thread count, and a row then rounds by the rows beside it (on 2 threads a lone row
        unlike the same row among others: batch 1 against a verify step's rows); on one thread it does not."""
        super().__init__(pool, num_heads, num_kv_heads, head_dim, scale)
        self.serial_decode = serial_decode

    @property
    def split_last(self) -> bool:
        """Whether a request's last extend row attends alone (attend): on the CPU, over a 16-bit pool."""
        return self.pool.device.type == "cpu" and not self.pool.quantized

    def prepare(self, batch: ForwardBatch) -> None:
        table = self.pool.page_table
        if batch.is_decode:
            # Padded to a multiple of _PAD: a request's softmax sums then take the same vector lanes and tail
            # whatever the longest request beside it (masked positions add exact zeros to full lanes), so its
            # decode rounds alike in any batch.
            max_len = min(-(-max(batch.seq_lens_cpu) // _PAD) * _PAD, table.shape[1])
            slots = table[batch.req_slots, :max_len].long()
            pad = torch.arange(max_len, device=slots.device)[None, :] >= batch.seq_lens[:, None]
            # Additive float mask, built once per step: SDPA would convert a bool mask in every layer.
            # (In the pool dtype, which is the model's unless it is FP8: then _decode converts it once.)
            dtype = torch.float32 if self.pool.quantized else self.pool.shape.dtype
            mask = torch.zeros(pad.shape, dtype=dtype, device=slots.device)
            mask.masked_fill_(pad, float("-inf"))
            batch.attn_meta = TorchDecodeMeta(slots.reshape(-1), max_len, mask[:, None, None, :])
            return
        kv_slots: list[torch.Tensor | None] = []
        masks: list[torch.Tensor | None] = []
        rows = batch.req_slots.tolist()
        for row, seq_len, ext in zip(rows, batch.seq_lens_cpu, batch.extend_lens_cpu):
            prefix = seq_len - ext
            if prefix == 0 and not self.pool.quantized:  # nothing cached: this step's own k/v, no gather
                kv_slots.append(None)
                masks.append(None)
                continue
            kv_slots.append(table[row, :seq_len].long())
            q_pos = torch.arange(prefix, seq_len, device=table.device)[:, None]
            masks.append(torch.arange(seq_len, device=table.device)[None, :] <= q_pos)
        batch.attn_meta = TorchExtendMeta(batch.qo_indptr.tolist(), kv_slots, masks)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = batch.attn_meta
        if isinstance(meta, TorchDecodeMeta):
            return self._decode(q, layer_id, meta)
        outs = []
        for i, (slots, mask) in enumerate(zip(meta.slots, meta.masks)):
            a, b = meta.starts[i], meta.starts[i + 1]
            ki, vi = (k[a:b], v[a:b]) if slots is None else self.pool.read(layer_id, slots, q.dtype)
            # A request's last row (the token it samples) attends alone, over all its keys: SDPA rounds a row by
            # the rows it runs with, and this row must come out the same whether the prompt is prefilled cold
            # or extended by its last token after a prefix hit. The rows before it attend over the keys before it.
            # Only where that promise is made (the CPU's modes with a 16-bit pool): as the GPU kernels' reference
            # and as the FP8 KV simulation, every row attends in one call, as the kernels compute it.
            if not self.split_last:
                outs.append(self._sdpa(q[a:b], ki, vi, mask))
                continue
            if b - a > 1:
                outs.append(self._sdpa(q[a : b - 1], ki[:-1], vi[:-1], None if mask is None else mask[:-1, :-1]))
            outs.append(self._sdpa(q[b - 1 : b], ki, vi, None, causal=False))
        return torch.cat(outs, dim=0)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              causal: bool = True) -> torch.Tensor:
        """One request's rows [T, H, D] over its keys [L, Hkv, D]: under `mask`, else causal (or all keys)."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            is_causal=causal and mask is None, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, layer_id: int, meta: TorchDecodeMeta):
        bsz, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        group = self.num_heads // hkv
        shape = (bsz, meta.max_len, hkv, d)
        k_all, v_all = self.pool.read(layer_id, meta.slots, q.dtype)
        if meta.mask.dtype != q.dtype:
            meta.mask = meta.mask.to(q.dtype)
        # [B, Hkv, L, D] as strided views: SDPA reads them in place, a .contiguous() copy costs more.
        keys = k_all.view(shape).transpose(1, 2)
        values = v_all.view(shape).transpose(1, 2)
        # GQA without copying K/V per query head: a KV head's query heads act as its query rows.
        with one_thread() if self.serial_decode else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q.reshape(bsz, hkv, group, d), keys, values, attn_mask=meta.mask,
                                                 scale=self.scale)
        return out.reshape(bsz, self.num_heads, d)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
