"""The torch attention backend: SDPA over gathered paged KV; runs on CPU and is the GPU kernels' reference.

Reads go through `KVPool.read`, which dequantizes an FP8 pool: on the CPU this is the FP8 KV cache itself
(stored as e4m3 codes), and on the GPU the reference the Triton kernels are checked against. CPU decode over a 16-bit
pool runs minisgl's own kernel where it is built (`minisgl::decode_attn`, kernels/cpu/csrc/): it reads the
pool in place and rounds a row alike in any batch, which SDPA over a batch's padded keys does not; it takes a layer's
sliding window (a row's last keys) and sinks (in the denominator) too. Elsewhere a window is SDPA's mask, and sinks
scale SDPA's output by exp(lse) / (exp(lse) + exp(sink)), the log-sum-exp from the CPU flash kernel SDPA runs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kernels.cpu import library as cpu_library
from minisgl_cli.kvcache.pool import KVPool

_PAD = 16  # the CPU's fp32 vector width (AVX-512; twice AVX2's): see TorchBackend.prepare
_ROWS = 32  # prefill rows attend in blocks of this many positions (TorchBackend._blocks): SDPA's own row block
_GROUP = 8  # decode: a KV head's query rows padded to a multiple of this (TorchBackend.decode)
_CUDA_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class TorchDecodeMeta:
    slots: torch.Tensor  # [B * L] KV slots, row-major, padded with the scratch slot 0
    max_len: int
    lens: torch.Tensor  # [B] int64: each row's keys (its position + 1)
    mask: torch.Tensor | None  # [B, 1, 1, L] additive, 0 where a position is real, -inf on padding; None: own kernel
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask, made by the first layer
    window_slots: torch.Tensor | None = None  # `slots` through the pool's slot_map (its window layers'), made once


def decode_mask(lens: torch.Tensor, max_len: int, dtype: torch.dtype, window: int = 0) -> torch.Tensor:
    """SDPA's additive mask [B, 1, 1, max_len] of decode rows with `lens` keys each (the last `window` of them)."""
    keys = torch.arange(max_len, device=lens.device)[None, :]
    pad = keys >= lens[:, None]
    if window:
        pad |= keys < lens[:, None] - window
    return torch.zeros(pad.shape, dtype=dtype, device=lens.device).masked_fill_(pad, float("-inf"))[:, None, None, :]


def window_mask(q_pos: torch.Tensor, seq_len: int, window: int) -> torch.Tensor:
    """[T, seq_len] bool: key j seen by the query at q_pos (causal; within `window` where window > 0)."""
    keys = torch.arange(seq_len, device=q_pos.device)[None, :]
    seen = keys <= q_pos[:, None]
    return seen & (keys > q_pos[:, None] - window) if window else seen


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
         sinks: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """SDPA over [N, H, T, D] queries and [N, Hkv, L, D] keys (GQA where Hkv < H); with `sinks` ([H, T] or
    broadcast to it: one logit per query row) each row's softmax denominator gains exp(sink): the output scaled by
    sigmoid(lse - sink), lse from the CPU flash kernel (the one SDPA runs there; SDPA itself elsewhere)."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None:
        # On CUDA not cuDNN's: it builds a plan per new shape, ~150 ms of host time on an H200 (MLA's prefill, a chunk
        # of a new length each time: examples/mtp_cost.py). The flags it sets are the process's: an engine's forwards
        # run in one thread, and media's cuDNN attention in a process of its own.
        with sdpa_kernel(_CUDA_SDPA) if q.is_cuda else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if q.device.type == "cpu":
        if mask is not None and mask.dtype == torch.bool:  # the flash kernel takes an additive mask of q's dtype
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, attn_mask=mask, scale=scale)
    else:  # the GPU kernels' reference: the log-sum-exp computed in the open
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
        lse = scores.logsumexp(-1)
        out = (scores.softmax(-1) @ v.float()).to(q.dtype)
    return out * torch.sigmoid(lse.float() - sinks.float())[..., None].to(out.dtype)


@dataclass
class TorchExtendMeta:
    starts: list[int]  # row offsets of each request in the flat batch
    slots: list[torch.Tensor | None]  # per request: [seq_len] KV slots; None when nothing is cached
    masks: list[torch.Tensor | None]  # per request: [extend, seq_len] causal mask; None = plain causal, or band
    prefixes: list[int]  # per request: its cached tokens (the position of its first row)
    # [_ROWS, L] additive, 0 where key j <= L - _ROWS + row: the causal mask of the block ending at e is its last e
    # columns (TorchBackend._blocks); None where a request's rows attend in one call (not row_invariant)
    band: torch.Tensor | None
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its band (TorchBackend._band)
    window_slots: list[torch.Tensor | None] | None = None  # `slots` through the pool's slot_map, made once


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 serial_decode: bool = False):
        """`serial_decode`: decode attention on one thread (--deterministic)."""
        super().__init__(pool, num_heads, num_kv_heads, head_dim, scale)
        self.serial_decode = serial_decode
        # minisgl::decode_attn's cases (its checks): where it cannot run, SDPA does
        layers = [pool.shape.of(i) for i in range(pool.shape.num_layers)]  # (KV heads, head dim): Gemma 4's differ
        self.own_decode = (self.row_invariant and not pool.shape.latent
                           and pool.shape.dtype in (torch.bfloat16, torch.float32)
                           and all(d in (32, 64, 96, 128, 256) and (not h or num_heads // h <= 16) for h, d in layers)
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
            masks.append(window_mask(torch.arange(prefix, seq_len, device=table.device), seq_len, 0))  # causal
        band = None
        if self.row_invariant:
            width = -(-max(batch.seq_lens_cpu) // _ROWS) * _ROWS
            keys = torch.arange(width, device=table.device)[None, :]
            last_keys = torch.arange(width - _ROWS, width, device=table.device)[:, None]
            band = torch.zeros(_ROWS, width, device=table.device).masked_fill_(keys > last_keys, float("-inf"))
        batch.attn_meta = TorchExtendMeta(batch.qo_indptr.tolist(), kv_slots, masks, prefixes, band)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        window: int = 0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        meta = batch.attn_meta
        if isinstance(meta, TorchDecodeMeta):
            return self.decode(q, layer_id, meta, window, sinks)
        outs = []
        all_slots = meta.slots
        if layer_id in self.pool.window_layers:
            if meta.window_slots is None:
                meta.window_slots = [None if s is None else self.pool.slot_map[s] for s in meta.slots]
            all_slots = meta.window_slots
        for i, (slots, mask) in enumerate(zip(all_slots, meta.masks)):
            a, b = meta.starts[i], meta.starts[i + 1]
            ki, vi = (k[a:b], v[a:b]) if slots is None else self.pool.read(layer_id, slots, q.dtype)
            if meta.band is None:  # not row_invariant: in one call
                if window:  # the window's own mask (a plain causal one where nothing was cached)
                    prefix = meta.prefixes[i]
                    mask = window_mask(torch.arange(prefix, prefix + b - a, device=q.device), ki.shape[0], window)
                outs.append(self._sdpa(q[a:b], ki, vi, mask, sinks))
            else:
                outs.append(self._blocks(q[a:b], ki, vi, meta.prefixes[i], meta, window, sinks))
        return torch.cat(outs, dim=0)

    def _blocks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                meta: TorchExtendMeta, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One request's rows [T, H, D] at positions prefix.. over its keys [prefix + T, Hkv, D], causal, each row
        computed in a call of the same shapes wherever it runs: SDPA rounds a row by the rows of its call (their
        count, its place among them), so a row attends in the block of _ROWS positions holding it (absent rows:
        zeros) over the keys up to the block's end (absent keys: zeros, masked). Its KV, and so a greedy answer,
        then comes out alike whether the prompt is prefilled cold, extended after a prefix hit or in chunks (and
        _ROWS rows keep each thread's scratch aligned whatever the thread count: see _decode). A sliding window
        masks the keys before it too: the band of that window (`_band`)."""
        end = prefix + q.shape[0]
        first, last = prefix // _ROWS * _ROWS, -(-end // _ROWS) * _ROWS
        q = F.pad(q, (0, 0, 0, 0, prefix - first, last - end))
        if last > end:
            k, v = (F.pad(t, (0, 0, 0, 0, 0, last - end)) for t in (k, v))
        band = self._band(meta, window, q.dtype)
        width = band.shape[1]
        outs = [self._sdpa(q[s - first : s - first + _ROWS], k[: s + _ROWS], v[: s + _ROWS],
                           band[:, width - s - _ROWS :], sinks) for s in range(first, last, _ROWS)]
        return torch.cat(outs)[prefix - first : end - first]

    @staticmethod
    def _band(meta: TorchExtendMeta, window: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's band in `dtype`, or a sliding window's: key j of row r also masked where j <= last - window."""
        assert meta.band is not None
        if meta.band.dtype != dtype:
            meta.band = meta.band.to(dtype)
        if not window:
            return meta.band
        band = meta.windowed.get(window)
        if band is None or band.dtype != dtype:
            rows, width = meta.band.shape
            keys = torch.arange(width, device=meta.band.device)[None, :]
            last_keys = torch.arange(width - rows, width, device=meta.band.device)[:, None]
            band = meta.windowed[window] = meta.band.masked_fill(keys <= last_keys - window, float("-inf"))
        return band

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One request's rows [T, H, D] over its keys [L, Hkv, D]: under `mask`, else causal."""
        out = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, self.scale,
                   sinks[:, None] if sinks is not None else None, causal=mask is None)
        return out[0].transpose(0, 1)

    def decode(self, q: torch.Tensor, layer_id: int, meta: TorchDecodeMeta, window: int = 0,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One decode row a request of layer `layer_id` over its cached keys (`meta`): minisgl::decode_attn where
        `own_decode`, else SDPA over the gathered keys (bench_cpu_attention.py times both)."""
        bsz, heads, d = q.shape  # this layer's (a model's layers may differ: Gemma 4)
        hkv = self.pool.k[layer_id].shape[1]
        slots = meta.slots
        if layer_id in self.pool.window_layers:
            if meta.window_slots is None:
                meta.window_slots = self.pool.slot_map[meta.slots]
            slots = meta.window_slots
        if self.own_decode:
            return torch.ops.minisgl.decode_attn(q.reshape(bsz, heads, d).contiguous(),
                                                 self.pool.k[layer_id], self.pool.v[layer_id],
                                                 slots.view(bsz, meta.max_len), meta.lens, self.scale,
                                                 window, sinks)
        group = heads // hkv
        shape = (bsz, meta.max_len, hkv, d)
        k_all, v_all = self.pool.read(layer_id, slots, q.dtype)
        mask = self._decode_mask(meta, window, q.dtype)
        # [B, Hkv, L, D] as strided views: SDPA reads them in place, a .contiguous() copy costs more.
        keys = k_all.view(shape).transpose(1, 2)
        values = v_all.view(*shape[:3], -1).transpose(1, 2)  # an MLA pool's values are narrower (its latent)
        # GQA without copying K/V per query head: a KV head's query heads act as its query rows. torch's CPU flash
        # attention lays each thread's scratch after the previous one's, (query rows) x (keys + head dim + 2) floats
        # and (query rows) x keys 16-bit values: with 3 query rows (SmolLM2) a thread's starts off a 64-byte line,
        # its GEMMs round otherwise, and a (request, KV head) rounded by the thread its batch size handed it to
        # (batch 1 against batch 2 on 2 threads). Padded to a multiple of _GROUP rows (keys are to _PAD) every
        # thread's scratch starts aligned: a row rounds alike in any batch, on any thread count, eager or compiled.
        rows = q.reshape(bsz, hkv, group, d)
        row_sinks = None if sinks is None else sinks.view(hkv, group)
        if self.row_invariant and group % _GROUP:
            rows = F.pad(rows, (0, 0, 0, _GROUP - group % _GROUP))
            row_sinks = None if row_sinks is None else F.pad(row_sinks, (0, _GROUP - group % _GROUP))
        with one_thread() if self.serial_decode else contextlib.nullcontext():
            out = sdpa(rows, keys, values, mask, self.scale, row_sinks)
        return out[:, :, :group].reshape(bsz, heads, -1)  # -1: an MLA pool's values are its latent's width

    @staticmethod
    def _decode_mask(meta: TorchDecodeMeta, window: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's decode mask in `dtype` (prepare's), or a sliding window's (made by its first layer)."""
        if not window:
            assert meta.mask is not None  # prepare builds it where SDPA attends
            if meta.mask.dtype != dtype:
                meta.mask = meta.mask.to(dtype)
            return meta.mask
        mask = meta.windowed.get(window)
        if mask is None or mask.dtype != dtype:
            mask = meta.windowed[window] = decode_mask(meta.lens, meta.max_len, dtype, window)
        return mask


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's intra-op threads set to one for the block."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
