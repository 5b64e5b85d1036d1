"""The torch attention backend: SDPA over gathered paged KV; runs on CPU and is the GPU kernels' reference.

Reads go through `KVPool.read`, which dequantizes an FP8 pool: on the CPU this is the FP8 KV cache itself
(stored as e4m3 codes), and on the GPU the reference the Triton kernels are checked against."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.core.batch import ForwardBatch

# A row's attention must round alike whatever computes it (a cold prefill, an extend after a prefix hit, a
# chunk): SDPA rounds a row by the rows it runs with and by how many keys it reads. So extend rows run in blocks
# of _BLOCK rows at fixed positions (a block's missing rows zero), and keys count in multiples of _PAD, the CPU's
# fp32 vector width (AVX-512; twice AVX2's): masked keys past a row's own then add exact zeros to full vector
# lanes, whatever their number. Decode rows (one per request) read their keys padded alike.
_PAD = 16
_BLOCK = 32  # SDPA's own query block on the CPU: one per call


def _padded(n: int, limit: int) -> int:
    return min(-(-n // _PAD) * _PAD, limit)


@dataclass
class _Block:
    """Query rows [start, start + _BLOCK) of a request, of which this step has `rows` (at `at` in the block)."""

    rows: slice  # of the request's rows in this step
    at: slice  # where they sit in the block
    keys: int  # the keys the block reads (its last position's, padded)
    mask: torch.Tensor  # [_BLOCK, keys] bool: row r sees the keys up to position start + r


@dataclass
class TorchDecodeMeta:
    slots: torch.Tensor  # [B * L] KV slots, row-major, padded with the scratch slot 0
    max_len: int
    mask: torch.Tensor  # [B, 1, 1, L] additive: 0 where a position is real, -inf on padding


@dataclass
class TorchExtendMeta:
    starts: list[int]  # row offsets of each request in the flat batch
    slots: list[torch.Tensor | None]  # per request: its KV slots (padded); None: nothing cached, this step's k/v
    blocks: list[list[_Block]]  # per request: its rows' query blocks


class TorchBackend(AttentionBackend):
    name = "torch"

    def prepare(self, batch: ForwardBatch) -> None:
        table = self.pool.page_table
        if batch.is_decode:
            max_len = _padded(max(batch.seq_lens_cpu), table.shape[1])  # whatever the longest request beside
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
        blocks: list[list[_Block]] = []
        masks: dict[tuple[int, int], torch.Tensor] = {}  # by (block start, keys): shared by requests alike
        for row, seq_len, ext in zip(batch.req_slots.tolist(), batch.seq_lens_cpu, batch.extend_lens_cpu):
            prefix, limit = seq_len - ext, _padded(seq_len, table.shape[1])
            # Nothing cached: this step's own k/v (zero-padded in attend), no gather.
            kv_slots.append(None if prefix == 0 and not self.pool.quantized else table[row, :limit].long())
            mine = []
            for start in range(prefix - prefix % _BLOCK, seq_len, _BLOCK):
                lo, hi = max(start, prefix), min(start + _BLOCK, seq_len)
                keys = _padded(start + _BLOCK, limit)
                if (start, keys) not in masks:
                    pos = torch.arange(start, start + _BLOCK, device=table.device)[:, None]
                    masks[start, keys] = torch.arange(keys, device=table.device)[None, :] <= pos
                mine.append(_Block(slice(lo - prefix, hi - prefix), slice(lo - start, hi - start), keys,
                                   masks[start, keys]))
            blocks.append(mine)
        batch.attn_meta = TorchExtendMeta(batch.qo_indptr.tolist(), kv_slots, blocks)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = batch.attn_meta
        if isinstance(meta, TorchDecodeMeta):
            return self._decode(q, layer_id, meta)
        outs = []
        gqa = self.num_heads != self.num_kv_heads
        for i, (slots, blocks) in enumerate(zip(meta.slots, meta.blocks)):
            a, b = meta.starts[i], meta.starts[i + 1]
            if slots is None:  # this step's own k/v, zero-padded to the keys its last block reads
                pad = (0, 0, 0, 0, 0, blocks[-1].keys - (b - a))
                ki, vi = F.pad(k[a:b], pad), F.pad(v[a:b], pad)
            else:
                ki, vi = self.pool.read(layer_id, slots, q.dtype)
            qi = q[a:b]
            for blk in blocks:
                if blk.at.stop - blk.at.start == _BLOCK:
                    qb = qi[blk.rows]
                else:
                    qb = qi.new_zeros(_BLOCK, *qi.shape[1:])
                    qb[blk.at] = qi[blk.rows]
                out = F.scaled_dot_product_attention(
                    qb.transpose(0, 1)[None], ki[: blk.keys].transpose(0, 1)[None],
                    vi[: blk.keys].transpose(0, 1)[None], attn_mask=blk.mask, scale=self.scale, enable_gqa=gqa,
                )
                outs.append(out[0].transpose(0, 1)[blk.at])
        return torch.cat(outs, dim=0)

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
        out = F.scaled_dot_product_attention(q.reshape(bsz, hkv, group, d), keys, values, attn_mask=meta.mask,
                                             scale=self.scale)
        return out.reshape(bsz, self.num_heads, d)
