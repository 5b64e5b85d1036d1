"""MLA attention (DeepSeek's Multi-head Latent Attention) over the latent KV pool: prefill expanded, decode absorbed.

The pool keeps one row a token and layer: [c | k_pe], c the normalized latent (kv_lora_rank R), k_pe the rotated
rope key (qk_rope_head_dim) every head shares (kvcache/pool.py's `latent` shape). A head h's key is
[W_UK[h] c | k_pe] and its value W_UV[h] c, W_UK / W_UV the two halves of kv_b_proj.

  extend  (prefill, chunks, a cached prefix) the keys and values expanded through kv_b_proj for every position of
          the request, as transformers computes them, then causal attention over [q_nope | q_pe]
  decode  absorbed: q_nope W_UK[h] is a query over c itself, so one step is attention of H query heads over one
          shared "head" [c | k_pe] of R + rope dims whose values are c ([q_nope W_UK | q_pe] . [c | k_pe] is
          q_nope . k_nope + q_pe . k_pe); W_UV after it. Nothing per head is read from memory but the latent rows.
          On CUDA the attention over the latent rows is kernels/triton/mla.py's kernel (CUDA graphs capture it:
          it reads each row's page-table row and length from the device), elsewhere TorchBackend's decode (SDPA,
          the query heads as rows of the one KV head).

An FP8 latent pool (`--kv-cache-dtype fp8_e4m3`) stores each row as e4m3 codes of row - mean with one scale a layer
(kvcache/pool.py); extend steps and the torch decode read the rows dequantized, the kernel dequantizes on load.

Both are the same numbers to rounding (tests/test_deepseek.py checks each against the other and transformers).
Prompts and decode rows attend as TorchBackend's do (its metadata, its position-aligned blocks on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.util import find_spec
from typing import Protocol

import torch

from minisgl_cli.attention.torch_backend import TorchBackend, TorchDecodeMeta, sdpa
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kvcache.pool import KVPool
from minisgl_cli.layers.kernel_choice import Kernels


class MlaWeights(Protocol):
    """What an MLA layer hands its backend: kv_b_proj as the expansion and as its two halves, this rank's heads."""

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, qk_nope_head_dim, R]"""
        ...

    @property
    def w_uv(self) -> torch.Tensor:
        """[H, v_head_dim, R]"""
        ...

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [L, R] -> (k_nope [L, H, qk_nope_head_dim], v [L, H, v_head_dim])."""
        ...


@dataclass
class KernelDecodeMeta:
    """A decode step through the Triton kernel: each row's page-table row and length (static buffers in a graph)."""

    req_rows: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32


class MlaBackend(TorchBackend):
    """MLA over a latent pool."""

    absorb = True  # False: decode rows expanded too (the reference the absorbed form is checked against)
    triton_decode: bool | None = None  # the absorbed decode through the Triton kernel; None: on CUDA

    def __init__(self, pool: KVPool, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 serial_decode: bool = False, triton_decode: bool | None = None):
        """`triton_decode`: this backend's choice of decode (None: the class's, by default on CUDA)."""
        super().__init__(pool, num_heads, 1, kv_lora_rank + rope_dim, scale, serial_decode)
        self.rank = kv_lora_rank
        if triton_decode is not None:
            self.triton_decode = triton_decode
        # The kernel reads only its rows and lengths from the device: CUDA graphs capture its decode.
        self.supports_cuda_graph = self.kernel_decode
        self._graph: KernelDecodeMeta | None = None

    @property
    def name(self) -> str:  # type: ignore[override]
        """What the engine's log and /metrics say: MLA, and which decode it runs."""
        return "mla-triton" if self.kernel_decode else "mla-torch"

    @property
    def kernel_decode(self) -> bool:
        """Whether decode steps attend through the Triton kernel (absorbed, on CUDA unless `triton_decode` says)."""
        on_cuda = self.pool.device.type == "cuda"
        return self.absorb and bool(self.triton_decode or (self.triton_decode is None and on_cuda))

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode and self.kernel_decode:  # nothing to gather: the kernel walks the page table itself
            batch.attn_meta = KernelDecodeMeta(batch.req_rows, batch.seq_lens)
            return
        super().prepare(batch)

    def init_cuda_graph_state(self, max_bs: int) -> None:
        dev = self.pool.device
        self._graph = KernelDecodeMeta(torch.zeros(max_bs, dtype=torch.int64, device=dev),
                                       torch.ones(max_bs, dtype=torch.int32, device=dev))

    def prepare_for_capture(self, bs: int, batch: ForwardBatch | None = None) -> KernelDecodeMeta:
        if self._graph is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) first")
        meta = KernelDecodeMeta(self._graph.req_rows[:bs], self._graph.seq_lens[:bs])
        if batch is not None:
            batch.attn_meta = meta
        return meta

    def prepare_for_replay(self, batch: ForwardBatch, bs: int) -> None:
        g = self.prepare_for_capture(bs)
        n = batch.batch_size
        g.req_rows[:n].copy_(batch.req_rows, non_blocking=True)
        g.seq_lens[:n].copy_(batch.seq_lens, non_blocking=True)
        if n < bs:  # padding rows: one position of page-table row 0 (any valid slot; their output is dropped)
            g.req_rows[n:].zero_()
            g.seq_lens[n:].fill_(1)

    def graph_rows(self, bs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        g = self.prepare_for_capture(bs)
        return g.req_rows, g.seq_lens

    def forward_mla(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, layer_id: int,
                    batch: ForwardBatch, w: MlaWeights) -> torch.Tensor:
        """q_nope [T, H, dn], q_pe [T, H, dr] (rotated), latent [T, R + dr] this step's rows ([c | k_pe], stored
        here) -> [T, H, v_head_dim]."""
        rows = latent[:, None, :]
        if not batch.is_decode and self.pool.needs_scales(layer_id):  # an FP8 pool's first prefill at this layer
            self.pool.calibrate(layer_id, rows, rows)
        self.pool.store(layer_id, batch.out_cache_loc, rows, rows)  # an MLA pool keeps K alone
        meta = batch.attn_meta
        if isinstance(meta, KernelDecodeMeta) or (isinstance(meta, TorchDecodeMeta) and self.absorb):
            return self._absorbed(q_nope, q_pe, layer_id, meta, w)
        if isinstance(meta, TorchDecodeMeta):
            return self._expanded_decode(q_nope, q_pe, layer_id, meta, w)
        q = torch.cat((q_nope, q_pe), dim=-1)
        outs = []
        for i, slots in enumerate(meta.slots):
            a, b = meta.starts[i], meta.starts[i + 1]
            seq = latent[a:b] if slots is None else self._read(layer_id, slots, q.dtype)
            k, v = self._expand(seq, w)
            if meta.band is None:  # not row_invariant: in one call (causal, or the prepared mask over a prefix)
                outs.append(self._sdpa(q[a:b], k, v, meta.masks[i]))
            else:
                outs.append(self._blocks(q[a:b], k, v, meta.prefixes[i], meta))
        return torch.cat(outs, dim=0)

    def _read(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Latent rows [len(slots), R + dr] (an FP8 pool's dequantized)."""
        return self.pool.read(layer_id, slots, dtype)[0][:, 0]

    def _expand(self, seq: torch.Tensor, w: MlaWeights) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [L, R + dr] -> every head's keys [L, H, dn + dr] and values [L, H, dv]."""
        k_nope, v = w.expand(seq[:, : self.rank])
        k_pe = seq[:, None, self.rank :].expand(-1, k_nope.shape[1], -1)
        return torch.cat((k_nope, k_pe), dim=-1), v

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int,
                  meta: KernelDecodeMeta | TorchDecodeMeta, w: MlaWeights) -> torch.Tensor:
        q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # [B, H, R]: W_UK folded into the query
        q = torch.cat((q_lat, q_pe), dim=-1)
        if isinstance(meta, KernelDecodeMeta):  # the Triton kernel, imported only here
            from minisgl_cli.kernels.triton.mla import mla_decode

            out = mla_decode(q, self.pool.k[layer_id], self.pool.page_table, meta.req_rows, meta.seq_lens,
                             self.rank, self.scale, self.pool.layer_quant(layer_id))
        else:
            out = self.decode(q, layer_id, meta)  # [B, H, R]: over the latent rows
        return torch.bmm(out.transpose(0, 1), w.w_uv.transpose(1, 2)).transpose(0, 1)  # W_UV after attention

    def _expanded_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, layer_id: int, meta: TorchDecodeMeta,
                         w: MlaWeights) -> torch.Tensor:
        bsz, heads = q_nope.shape[:2]
        k, v = self._expand(self._read(layer_id, meta.slots, q_nope.dtype), w)
        k = k.view(bsz, meta.max_len, heads, -1).transpose(1, 2)
        v = v.view(bsz, meta.max_len, heads, -1).transpose(1, 2)
        q = torch.cat((q_nope, q_pe), dim=-1)[:, :, None, :]
        return sdpa(q, k, v, self._decode_mask(meta, 0, q.dtype), self.scale)[:, :, 0]


def create_mla_backend(name: str, pool: KVPool, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                       kernels: Kernels | None = None) -> MlaBackend:
    """The MLA backend for `--attention-backend name`: auto (the Triton decode kernel on CUDA where triton imports,
    torch elsewhere), triton (CUDA only), torch (torch's decode on any device: the reference); flashinfer is refused
    by name (no MLA kernels of its here)."""
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention backend {name!r} has no MLA (DeepSeek) kernels here: use --attention-backend "
                         "auto, triton or torch")
    on_cuda = pool.device.type == "cuda"
    if name == "triton" and not on_cuda:
        raise ValueError(f"attention backend 'triton' needs a CUDA device (got {pool.device}); use 'torch' or 'auto'")
    kernel = False if name == "torch" or (name == "auto" and find_spec("triton") is None) else None  # None: on CUDA
    serial = kernels is not None and kernels.cpu_gemm == "invariant"
    return MlaBackend(pool, num_heads, kv_lora_rank, rope_dim, scale, serial_decode=serial, triton_decode=kernel)
