"""The torch attention backend: SDPA over gathered paged KV; runs on CPU and is the GPU kernels' reference.

Reads go through `KVPool.read`, which dequantizes an FP8 pool: on the CPU this is the FP8 KV cache itself
(stored as e4m3 codes), and on the GPU the reference the Triton kernels are checked against. CPU decode over a 16-bit
pool runs minisgl's own kernel where it is built (`minisgl::decode_attn`, kernels/cpu/csrc/): it reads the
pool in place and rounds a row alike in any batch, which SDPA over a batch's padded keys does not."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kernels.cpu import library as cpu_library
from minisgl_cli.kvcache.pool import KVPool

_PAD = 16  # the CPU's fp32 vector width (AVX-512; twice AVX2's): see TorchBackend.prepare
_ROWS = 32  # prefill rows attend in blocks of this many positions (TorchBackend._blocks): SDPA's own row block
_GROUP = 8  # decode: a KV head's query rows padded to a multiple of this (TorchBackend.decode)


@dataclass
class TorchDecodeMeta:
    slots: torch.Tensor  # [B * L] KV slots, row-major, padded with the scratch slot 0
    max_len: int
    lens: torch.Tensor  # [B] int64: each row's keys (its position + 1)
    mask: torch.Tensor | None  # [B, 1, 1, L] additive, 0 where a position is real, -inf on padding; None: own kernel


def decode_mask(lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's additive mask [B, 1, 1, max_len] of decode rows with `lens` keys each."""
    pad = torch.arange(max_len, device=lens.device)[None, :] >= lens[:, None]
    return torch.zeros(pad.shape, dtype=dtype, device=lens.device).masked_fill_(pad, float("-inf"))[:, None, None, :]


@dataclass
class TorchExtendMeta:
    starts: list[int]  # row offsets of each request in the flat batch
    slots: list[torch.Tensor | None]  # per request: [seq_len] KV slots; None when nothing is cached
    masks: list[torch.Tensor | None]  # per request: [extend, seq_len] causal mask; None = plain causal, or band
    prefixes: list[int]  # per request: its cached tokens (the position of its first row)
    # [_ROWS, L] additive, 0 where key j <= L - _ROWS + row: the causal mask of the block ending at e is its last e
    # columns (TorchBackend._blocks); None where a request's rows attend in one call (not row_invariant)
    band: torch.Tensor | None


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 serial_decode: bool = False):
        """`serial_decode`: decode attention on one thread (--deterministic)."""
        super().__init__(pool, num_heads, num_kv_heads, head_dim, scale)
        self.serial_decode = serial_decode
        # minisgl::decode_attn's cases (its checks): where it cannot run, SDPA does
        self.own_decode = (self.row_invariant and pool.shape.dtype in (torch.bfloat16, torch.float32)
                           and head_dim in (32, 64, 96, 128, 256) and num_heads // num_kv_heads <= 16
                           and cpu_library.missing("decode_attn") is None)

    @property
    def row_invariant(self) -> bool:
        """Whether a row rounds alike whatever rows share its call (prefill rows in position-aligned blocks, decode
        query rows padded): on the CPU over a 16-bit pool, where a greedy answer must not depend on the cache or the
        batch. As the GPU kernels' reference and as the FP8 KV simulation, rows attend as the kernels compute them."""
        return self.pool.device.type == "cpu" and not self.pool.quantized

    def prepare(self, batch: ForwardBatch) -> None:
        table = self.pool.page_table
        if batch.is_decode:
            # Keys padded to a multiple of _PAD (the compiled step's key dimension). SDPA still rounds a row by the
            # padding now and then (examples/bench_cpu_attention.py), which is why minisgl::decode_attn takes each
            # row's own length and never reads the padding.
            max_len = min(-(-max(batch.seq_lens_cpu) // _PAD) * _PAD, table.shape[1])
            slots = table[batch.req_rows, :max_len].long()
            lens = batch.seq_lens.long()
            # Additive float mask, built once per step: SDPA would convert a bool mask in every layer.
            # (In the pool dtype, which is the model's unless it is FP8: then _decode converts it once.)
            dtype = torch.float32 if self.pool.quantized else self.pool.shape.dtype
            mask = None if self.own_decode else decode_mask(lens, max_len, dtype)
            batch.attn_meta = TorchDecodeMeta(slots.reshape(-1), max_len, lens, mask)
            return
        kv_slots: list[torch.Tensor | None] = []
        masks: list[torch.Tensor | None] = []
        prefixes = [seq_len - ext for seq_len, ext in zip(batch.seq_lens_cpu, batch.extend_lens_cpu)]
        rows = batch.req_rows.tolist()
        for row, seq_len, prefix in zip(rows, batch.seq_lens_cpu, prefixes):
            if prefix == 0 and not self.pool.quantized:  # nothing cached: this step's own k/v, no gather
                kv_slots.append(None)
                masks.append(None)
                continue
            kv_slots.append(table[row, :seq_len].long())
            if self.row_invariant:  # their masks come from the band
                masks.append(None)
                continue
            q_pos = torch.arange(prefix, seq_len, device=table.device)[:, None]
            masks.append(torch.arange(seq_len, device=table.device)[None, :] <= q_pos)
        band = None
        if self.row_invariant:
            width = -(-max(batch.seq_lens_cpu) // _ROWS) * _ROWS
            keys = torch.arange(width, device=table.device)[None, :]
            last_keys = torch.arange(width - _ROWS, width, device=table.device)[:, None]
            band = torch.zeros(_ROWS, width, device=table.device).masked_fill_(keys > last_keys, float("-inf"))
        batch.attn_meta = TorchExtendMeta(batch.qo_indptr.tolist(), kv_slots, masks, prefixes, band)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch
    ) -> torch.Tensor:
        meta = batch.attn_meta
        if isinstance(meta, TorchDecodeMeta):
            return self.decode(q, layer_id, meta)
        outs = []
        for i, (slots, mask) in enumerate(zip(meta.slots, meta.masks)):
            a, b = meta.starts[i], meta.starts[i + 1]
            ki, vi = (k[a:b], v[a:b]) if slots is None else self.pool.read(layer_id, slots, q.dtype)
            if meta.band is None:  # not row_invariant: in one call
                outs.append(self._sdpa(q[a:b], ki, vi, mask))
            else:
                outs.append(self._blocks(q[a:b], ki, vi, meta.prefixes[i], meta))
        return torch.cat(outs, dim=0)

    def _blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                meta: TorchExtendMeta) -> torch.Tensor:
        """One request's rows [T, H, D] at positions prefix.. over its keys [prefix + T, Hkv, D], causal, each row
        computed in a call of the same shapes wherever it runs: SDPA rounds a row by the rows of its call (their
        count, its place among them), so a row attends in the block of _ROWS positions holding it (absent rows:
        zeros) over the keys up to the block's end (absent keys: zeros, masked). Its KV, and so a greedy answer,
        then comes out alike whether the prompt is prefilled cold, extended after a prefix hit or in chunks (and
        _ROWS rows keep each thread's scratch aligned whatever the thread count: see _decode)."""
        end = prefix + q.shape[0]
        first, last = prefix // _ROWS * _ROWS, -(-end // _ROWS) * _ROWS
        q = F.pad(q, (0, 0, 0, 0, prefix - first, last - end))
        if last > end:
            k, v = (F.pad(t, (0, 0, 0, 0, 0, last - end)) for t in (k, v))
        assert meta.band is not None
        if meta.band.dtype != q.dtype:
            meta.band = meta.band.to(q.dtype)
        width = meta.band.shape[1]
        outs = [self._sdpa(q[s - first : s - first + _ROWS], k[: s + _ROWS], v[: s + _ROWS],
                           meta.band[:, width - s - _ROWS :]) for s in range(first, last, _ROWS)]
        return torch.cat(outs)[prefix - first : end - first]

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """One request's rows [T, H, D] over its keys [L, Hkv, D]: under `mask`, else causal."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
            is_causal=mask is None, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out[0].transpose(0, 1)

    def decode(self, q: torch.Tensor, layer_id: int, meta: TorchDecodeMeta) -> torch.Tensor:
        """One decode row a request of layer `layer_id` over its cached keys (`meta`): minisgl::decode_attn where
        `own_decode`, else SDPA over the gathered keys (bench_cpu_attention.py times both)."""
        bsz, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        if self.own_decode:
            return torch.ops.minisgl.decode_attn(q.reshape(bsz, self.num_heads, d).contiguous(),
                                                 self.pool.k[layer_id], self.pool.v[layer_id],
                                                 meta.slots.view(bsz, meta.max_len), meta.lens, self.scale)
        assert meta.mask is not None  # prepare builds it where SDPA attends
        group = self.num_heads // hkv
        shape = (bsz, meta.max_len, hkv, d)
        k_all, v_all = self.pool.read(layer_id, meta.slots, q.dtype)
        if meta.mask.dtype != q.dtype:
            meta.mask = meta.mask.to(q.dtype)
        # [B, Hkv, L, D] as strided views: SDPA reads them in place, a .contiguous() copy costs more.
        keys = k_all.view(shape).transpose(1, 2)
        values = v_all.view(shape).transpose(1, 2)
        # GQA without copying K/V per query head: a KV head's query heads act as its query rows. torch's CPU flash
        # attention lays each thread's scratch after the previous one's, (query rows) x (keys + head dim + 2) floats
        # and (query rows) x keys 16-bit values: with 3 query rows (SmolLM2) a thread's starts off a 64-byte line,
        # its GEMMs round otherwise, and a (request, KV head) rounded by the thread its batch size handed it to
        # (batch 1 against batch 2 on 2 threads). Padded to a multiple of _GROUP rows (keys are to _PAD) every
        # thread's scratch starts aligned: a row rounds alike in any batch, on any thread count, eager or compiled.
        rows = q.reshape(bsz, hkv, group, d)
        if self.row_invariant and group % _GROUP:
            rows = F.pad(rows, (0, 0, 0, _GROUP - group % _GROUP))
        with one_thread() if self.serial_decode else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=meta.mask, scale=self.scale)
        return out[:, :, :group].reshape(bsz, self.num_heads, d)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
