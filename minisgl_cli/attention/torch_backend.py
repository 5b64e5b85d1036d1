"""The torch attention backend: SDPA over gathered paged KV; runs on CPU and is the GPU kernels' reference."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.engine.batch import ForwardBatch


@dataclass
class TorchDecodeMeta:
    slots: torch.Tensor  # [B, L] KV slots, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, L] True where a position is real


@dataclass
class TorchExtendMeta:
    slots: list[torch.Tensor]  # per request: [seq_len] KV slots
    masks: list[torch.Tensor | None]  # per request: [extend, seq_len] causal mask, None if plain causal


class TorchBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        table = self.pool.page_table
        if batch.is_decode:
            max_len = max(batch.seq_lens_cpu)
            slots = table[batch.req_slots, :max_len].long()
            arange = torch.arange(max_len, device=slots.device)
            mask = arange[None, :] < batch.seq_lens[:, None]
            batch.attn_meta = TorchDecodeMeta(slots=slots, mask=mask[:, None, None, :])
            return
        slots, masks = [], []
        rows = batch.req_slots.tolist()
        for row, seq_len, ext in zip(rows, batch.seq_lens_cpu, batch.extend_lens_cpu):
            slots.append(table[row, :seq_len].long())
            prefix = seq_len - ext
            if prefix == 0:
                masks.append(None)
            else:  # query i (position prefix+i) sees keys 0..prefix+i
                q_pos = torch.arange(prefix, seq_len, device=table.device)[:, None]
                masks.append(torch.arange(seq_len, device=table.device)[None, :] <= q_pos)
        batch.attn_meta = TorchExtendMeta(slots=slots, masks=masks)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        self.pool.store(layer_id, batch.out_cache_loc, k, v)
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        gqa = self.num_heads != self.num_kv_heads
        meta = batch.attn_meta
        if isinstance(meta, TorchDecodeMeta):
            keys = k_cache[meta.slots].transpose(1, 2)  # [B, Hkv, L, D]
            values = v_cache[meta.slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, values, attn_mask=meta.mask, scale=self.scale, enable_gqa=gqa
            )  # [B, H, 1, D]
            return out[:, :, 0, :]
        outs = []
        starts = batch.qo_indptr.tolist()
        for i, (slots, mask) in enumerate(zip(meta.slots, meta.masks)):
            qi = q[starts[i] : starts[i + 1]].transpose(0, 1)[None]  # [1, H, E, D]
            ki = k_cache[slots].transpose(0, 1)[None]
            vi = v_cache[slots].transpose(0, 1)[None]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=gqa
            )
            outs.append(oi[0].transpose(0, 1))
        return torch.cat(outs, dim=0)
