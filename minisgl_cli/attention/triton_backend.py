"""The Triton attention backend: our own paged kernels (split-K decode, causal extend, fused KV store), graph-ready;
16-bit or FP8 KV (the kernels dequantize in registers); layers of different head shapes (Gemma 4)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl_cli import env
from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kernels.triton import attention as tk
from minisgl_cli.kvcache.pool import KVPool
from minisgl_cli.layers.kernel_choice import Kernels

HeadShape = tuple[int, int, int]  # a layer's (query heads, KV heads, head dim)
INTERPRETER_SMS = 4  # the "SMs" split-K plans for under Triton's interpreter (CPU tensors): a few splits, as on a GPU


@dataclass
class DecodeSplits:
    """One head shape's split-K plan of a decode step, shared by every layer of that shape."""

    num_splits: int  # KV splits per request (fixed per captured batch size under CUDA graphs)
    mid_o: torch.Tensor  # [bs, H, num_splits, D] fp32: per-split normalised outputs
    mid_lse: torch.Tensor  # [bs, H, num_splits] fp32: per-split base-2 log-sum-exps


@dataclass
class TritonDecodeMeta:
    req_rows: torch.Tensor  # [bs] int64: page-table rows
    seq_lens: torch.Tensor  # [bs] int32: context length including this step's token
    # By head shape: every shape's partials view the step's one scratch (the layers attend one after another)
    splits: dict[HeadShape, DecodeSplits]
    order: torch.Tensor | None  # [bs] int32: the rows by context length, longest first (the kernel starts those first)
    counters: torch.Tensor | None = None  # [>= bs * Hkv] int32 zeros: the split programs merge their own partials


# Up to this many rows a decode step's programs all start in the first wave: their order buys nothing, and sorting
# them on the device cost ~100 us of host work a step (a sort's launches), a fifth of batch 1's.
IN_ORDER_MAX_BS = 8


@dataclass
class TritonExtendMeta:
    req_rows: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int32
    qo_indptr: torch.Tensor  # [B+1] int32
    max_extend_len: int


class TritonBackend(AttentionBackend):
    """Paged attention through the kernels in `triton_kernels`, reading KV via the pool's page table.

    Eager use: `prepare(batch)` once per step, then `forward(q, k, v, layer_id, batch)` per layer.

    CUDA graphs (decode only; extend always runs eagerly). The engine's DecodeGraphs do:

    1. once, after building the backend: `init_cuda_graph_state(max_bs)` -- allocates the static decode
       metadata (page-table rows, seq_lens, split-K scratch) for every batch size up to max_bs;
    2. per captured batch size `bs`: build its static decode `ForwardBatch` (static input_ids /
       positions / out_cache_loc of length bs), then `prepare_for_capture(bs, batch)`, which sets
       `batch.attn_meta` to views of the static buffers (it also returns that meta). Run the model once
       eagerly with that batch (warm-up: compiles the Triton kernels outside the capture), then capture
       the model forward with it. Capturing sizes in any order is fine: all sizes share one storage;
    3. per replayed step: copy the real step's tensors into the graphs' static inputs (padding rows
       bs_real..bs-1 must write KV to the scratch page, e.g. out_cache_loc = 0), call
       `prepare_for_replay(real_batch, bs)` -- it copies the real batch's req_rows / seq_lens into the
       static buffers and makes the padding rows attend to one valid position -- then replay graph[bs].
       Do not call `prepare` for a replayed step; `prepare_for_replay` replaces it.

    The decode kernels never read host-side values in `attend`: the split count is fixed per `bs` at
    capture and each request's chunking is derived from its seq_len on the device.

    Layers of different head shapes (Gemma 4: narrow sliding heads, wide global ones; `layer_heads` and the pool's
    per-layer shapes): each distinct (query heads, KV heads, head dim) gets its own split count, planned once a step
    (or once per captured size) and reused by its layers; all their partials view one scratch sized for the largest
    shape, the split counters for the most KV heads, so a captured step allocates nothing per layer.
    """

    name = "triton"
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 kernels: Kernels | None = None, layer_heads: tuple[int, ...] = ()):
        """`layer_heads`: each pool layer's query heads where the layers' head shapes differ (() = num_heads)."""
        super().__init__(pool, num_heads, num_kv_heads, head_dim, scale)
        self.kernels = kernels or Kernels()  # the engine's: its `pdl` switches the decode kernels' launch
        on_cuda = pool.device.type == "cuda"
        if not on_cuda and not env.triton_interpret():
            raise ValueError("the triton attention backend needs a CUDA KV pool")
        # Each pool layer's head shape; None for a layer that stores no KV (Gemma 4's shared-KV layers attend through
        # the layer they share).
        self._shape_of: list[HeadShape | None] = []
        for i in range(pool.shape.num_layers):
            hkv, d = pool.shape.of(i)
            h = layer_heads[i] if layer_heads else num_heads
            if hkv and h % hkv:
                raise ValueError(f"layer {i}: {h} query heads are not a multiple of its {hkv} KV heads")
            self._shape_of.append((h, hkv, d) if hkv else None)
        self.shapes: tuple[HeadShape, ...] = tuple(dict.fromkeys(s for s in self._shape_of if s is not None))
        self._max_kv_heads = max(hkv for _, hkv, _ in self.shapes)
        # Each shape's decode tile: no split shorter than one (prepare caps the splits by the tiles of a step)
        self._block_n = {s: tk.decode_block_n(s[2], pool.shape.dtype.itemsize) for s in self.shapes}
        self.num_sms = (torch.cuda.get_device_properties(pool.device).multi_processor_count if on_cuda
                        else INTERPRETER_SMS)
        self._graph: dict[str, torch.Tensor] | None = None
        self._graph_max_bs = 0
        self._order_dirty = False  # the graphs' order holds a permutation (a step of more than IN_ORDER_MAX_BS)
        self._counters = torch.zeros(0, dtype=torch.int32, device=pool.device)

    # --- metadata --------------------------------------------------------------------------------
    def _splits(self, bs: int, shape: HeadShape) -> int:
        return tk.num_kv_splits(bs, shape[1], self.num_sms)

    def _split_counters(self, bs: int) -> torch.Tensor:
        """Zeros for bs requests' split counters (each decode call leaves them zero again): kept, grown as needed."""
        n = bs * self._max_kv_heads
        if self._counters.numel() < n:
            self._counters = torch.zeros(max(n, 2 * self._counters.numel()), dtype=torch.int32,
                                         device=self.pool.device)
        return self._counters

    @staticmethod
    def _plan(bs: int, splits: dict[HeadShape, int], mid_o: torch.Tensor,
              mid_lse: torch.Tensor) -> dict[HeadShape, DecodeSplits]:
        """Each shape's plan of `splits[shape]` splits over views of the flat scratch `mid_o` / `mid_lse`."""
        return {(h, hkv, d): DecodeSplits(n, mid_o[: bs * h * n * d].view(bs, h, n, d),
                                          mid_lse[: bs * h * n].view(bs, h, n))
                for (h, hkv, d), n in splits.items()}

    @staticmethod
    def _scratch_size(bs: int, splits: dict[HeadShape, int]) -> tuple[int, int]:
        """(mid_o, mid_lse) floats the largest of these shapes' plans needs."""
        return (max(bs * h * n * d for (h, _, d), n in splits.items()),
                max(bs * h * n for (h, _, _), n in splits.items()))

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            bs = batch.batch_size
            # No point in splits shorter than one KV tile: cap by the longest context of this step.
            longest = max(batch.seq_lens_cpu, default=1)
            splits = {s: max(1, min(self._splits(bs, s), -(-longest // n))) for s, n in self._block_n.items()}
            n_o, n_lse = self._scratch_size(bs, splits)
            dev = self.pool.device
            plans = self._plan(bs, splits, torch.empty(n_o, dtype=torch.float32, device=dev),
                               torch.empty(n_lse, dtype=torch.float32, device=dev))
            order = torch.argsort(batch.seq_lens, descending=True).to(torch.int32) if bs > IN_ORDER_MAX_BS else None
            batch.attn_meta = TritonDecodeMeta(batch.req_rows, batch.seq_lens, plans, order, self._split_counters(bs))
        else:
            batch.attn_meta = TritonExtendMeta(
                batch.req_rows, batch.seq_lens, batch.qo_indptr, max(batch.extend_lens_cpu, default=0)
            )

    # --- CUDA graphs -----------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int) -> None:
        dev = self.pool.device
        # Each captured size bs views its shapes' partials in one flat scratch; size it for the worst bs and shape.
        sizes = [self._scratch_size(bs, {s: self._splits(bs, s) for s in self.shapes}) for bs in range(1, max_bs + 1)]
        self._graph = {
            "req_rows": torch.zeros(max_bs, dtype=torch.int64, device=dev),
            "seq_lens": torch.ones(max_bs, dtype=torch.int32, device=dev),
            "order": torch.arange(max_bs, dtype=torch.int32, device=dev),
            "identity": torch.arange(max_bs, dtype=torch.int32, device=dev),
            "counters": torch.zeros(max_bs * self._max_kv_heads, dtype=torch.int32, device=dev),
            "mid_o": torch.empty(max(o for o, _ in sizes), dtype=torch.float32, device=dev),
            "mid_lse": torch.empty(max(lse for _, lse in sizes), dtype=torch.float32, device=dev),
        }
        self._graph_max_bs = max_bs

    def prepare_for_capture(self, bs: int, batch: ForwardBatch | None = None) -> TritonDecodeMeta:
        """Decode metadata of static views for a graph of `bs` rows; also set as `batch.attn_meta` if given."""
        g = self._require_graph_state(bs)
        splits = {s: self._splits(bs, s) for s in self.shapes}
        meta = TritonDecodeMeta(
            req_rows=g["req_rows"][:bs],
            seq_lens=g["seq_lens"][:bs],
            splits=self._plan(bs, splits, g["mid_o"], g["mid_lse"]),
            order=g["order"][:bs],
            counters=g["counters"],
        )
        if batch is not None:
            batch.attn_meta = meta
        return meta

    def prepare_for_replay(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a real decode batch (batch_size <= bs) into the static metadata of graph `bs`."""
        g = self._require_graph_state(bs)
        n = batch.batch_size
        if n > bs:
            raise ValueError(f"batch of {n} does not fit a graph of {bs}")
        g["req_rows"][:n].copy_(batch.req_rows, non_blocking=True)
        g["seq_lens"][:n].copy_(batch.seq_lens, non_blocking=True)
        if n < bs:  # padding rows: one position of page-table row 0 (any valid slot; output discarded)
            g["req_rows"][n:bs].zero_()
            g["seq_lens"][n:bs].fill_(1)
        if bs > IN_ORDER_MAX_BS:
            g["order"][:bs].copy_(torch.argsort(g["seq_lens"][:bs], descending=True))
            self._order_dirty = True
        elif self._order_dirty:  # a bigger step's order may name rows past this graph's: back to rows in order
            g["order"].copy_(g["identity"])
            self._order_dirty = False

    def graph_rows(self, bs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if bs > IN_ORDER_MAX_BS or self._order_dirty:  # the rows' order is the replay's to set too
            return None
        g = self._require_graph_state(bs)
        return g["req_rows"][:bs], g["seq_lens"][:bs]

    def _require_graph_state(self, bs: int) -> dict[str, torch.Tensor]:
        if self._graph is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) first")
        if not 1 <= bs <= self._graph_max_bs:
            raise ValueError(f"graph batch size {bs} outside 1..{self._graph_max_bs}")
        return self._graph

    # --- forward ---------------------------------------------------------------------------------
    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # K and V in one launch (as e4m3 codes in an FP8 pool)
        tk.store_kv(k, v, self.pool.k[layer_id], self.pool.v[layer_id], loc, self.pool.layer_quant(layer_id))

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: ForwardBatch,
        window: int = 0, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = self.pool.k[layer_id], self.pool.v[layer_id]
        meta = batch.attn_meta
        table = self.pool.page_table
        quant = self.pool.layer_quant(layer_id)
        if isinstance(meta, TritonDecodeMeta):
            plan = meta.splits[self._shape_of[layer_id]]  # type: ignore[index]  # a layer that stores KV
            return tk.decode_attention(
                q, k_cache, v_cache, table, meta.req_rows, meta.seq_lens, self.scale,
                plan.num_splits, plan.mid_o, plan.mid_lse, pdl=self.kernels.pdl, quant=quant, order=meta.order,
                window=window, sinks=sinks, slot_map=self.pool.slot_map_of(layer_id), counters=meta.counters,
            )
        return tk.extend_attention(
            q, k_cache, v_cache, table, meta.req_rows, meta.seq_lens, meta.qo_indptr,
            meta.max_extend_len, self.scale, quant=quant, window=window, sinks=sinks,
            slot_map=self.pool.slot_map_of(layer_id),
        )
