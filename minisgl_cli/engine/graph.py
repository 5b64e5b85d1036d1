"""DecodeGraphs: CUDA graphs of the decode forward (model + logits), one per captured batch size.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python the GPU
waits on the CPU. Replaying a captured graph launches them all at once. Batches are padded up to the
next captured size; padded rows write their KV to the pool's scratch slot 0 and their logits are
dropped. All graphs share one memory pool and one set of static inputs, captured largest first so the
smaller graphs reuse the largest one's intermediate memory.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.models.llama import LlamaForCausalLM

log = logging.getLogger("minisgl.graph")


def capture_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, every 16 up to 512, every 32 beyond; capped at max_bs."""
    sizes = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, 513, 16)) + list(range(544, 4097, 32))
    out = [s for s in sizes if s < max_bs] + [max_bs]
    return sorted(set(out))


MAX_DEFAULT_BS = 256  # the most rows default_max_bs captures
# Graphs up to this many rows also take each row's argmax: a greedy step's draw then costs no launch of its own
# (at batch 1 the eager argmax's host work was ~50 us of a ~500 us step; past a few rows the host is not the limit).
GREEDY_MAX_BS = 16


def default_max_bs(free_bytes: int, max_running: int) -> int:
    """By free memory after weights and KV sizing inputs: big cards capture up to 256 rows."""
    gib = free_bytes / (1 << 30)
    cap = MAX_DEFAULT_BS if gib >= 40 else 128 if gib >= 16 else 32
    return max(1, min(cap, max_running))


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, attn: AttentionBackend, max_bs: int, vocab: int,
                 device: torch.device, dtype: torch.dtype, hidden: int = 0, takes_hidden: bool = False):
        """`hidden`: the model's width, where replays keep each row's hidden state (MTP drafts read it); 0: not.
        `takes_hidden`: the model reads a hidden state a row beside its token (an MTP layer: `batch.prev_hidden`)."""
        self.model = model
        self.attn = attn
        self.device = device
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        n = self.max_bs
        # Static inputs: replays copy the real step's tensors in; rows past the real batch stay at 0
        # (token 0, position 0, KV slot 0 = the pool's scratch slot). Positions, KV slots and page-table rows are
        # rows of one block, laid out as ForwardBatch.decode_rows: one copy takes all three.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.rows = torch.zeros((3, n), dtype=torch.int64, device=device)
        self.positions, self.out_cache_loc = self.rows[0], self.rows[1]
        self.req_rows = self.rows[2]  # a VLM reads its rows' M-RoPE deltas
        self.logits = torch.empty((n, vocab), dtype=dtype, device=device)
        self.hidden = torch.empty((n, hidden), dtype=dtype, device=device)
        self.prev_hidden = torch.zeros((n, hidden), dtype=dtype, device=device) if takes_hidden else None
        self.greedy = torch.zeros(n, dtype=torch.int64, device=device)  # each row's argmax (graphs <= GREEDY_MAX_BS)
        self.argmax_counts = torch.zeros(n, dtype=torch.int32, device=device)  # the Triton argmax's row counters
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._dirty = 0  # rows of out_cache_loc that may hold a real slot from an earlier replay
        self.last = 0  # rows of the last replay

    def _static_batch(self, bs: int) -> ForwardBatch:
        ones = torch.ones(bs, dtype=torch.int32, device=self.device)
        return ForwardBatch(
            mode="decode", input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_rows=self.req_rows[:bs],
            seq_lens=ones, extend_lens=ones, seq_lens_cpu=[1] * bs, extend_lens_cpu=[1] * bs,
            qo_indptr=torch.arange(bs + 1, dtype=torch.int32, device=self.device),
            logits_indices=torch.arange(bs, dtype=torch.int64, device=self.device),
            prev_hidden=self.prev_hidden[:bs] if self.prev_hidden is not None else None,
        )

    def _body(self, batch: ForwardBatch, bs: int) -> None:
        hidden = self.model(batch, self.attn)
        if self.hidden.shape[1]:  # an MTP layer's next-row state where it sets one, else the rows' hidden states
            self.hidden[:bs].copy_(batch.hidden if batch.hidden is not None else hidden)
        # The head's output lands in the one static buffer (engine dtype: an fp32 copy of 256 x 128k
        # logits would cost ~0.1 ms a step; the sampler widens only what it computes on).
        self.logits[:bs].copy_(self.model.logits(hidden))
        if bs <= GREEDY_MAX_BS:
            ops = self.model.kernels.triton(self.logits)
            if ops is not None:  # a row over many programs (torch's one block a row took 28.5 µs on a 128k vocabulary)
                ops.argmax_rows(self.logits[:bs], self.greedy[:bs], self.argmax_counts)
            else:
                torch.argmax(self.logits[:bs], dim=-1, out=self.greedy[:bs])

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        self.attn.init_cuda_graph_state(self.max_bs)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for bs in reversed(self.sizes):  # largest first: the others fit in its memory
                batch = self._static_batch(bs)
                self.attn.prepare_for_capture(bs, batch)
                self._body(batch, bs)  # warm-up: Triton compiles, cuBLAS picks kernels, outside capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._body(batch, bs)
                self.graphs[bs] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("captured %d decode CUDA graphs (bs %d..%d) in %.1fs", len(self.sizes), self.sizes[0],
                 self.max_bs, time.perf_counter() - t0)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.is_decode and batch.batch_size <= self.max_bs

    def replay(self, batch: ForwardBatch, page_table: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, vocab] (a view of the static buffer: valid until the next replay). `page_table`: the step's
        page-table entries are still to write (`ForwardBatch.page_write`), into this table."""
        n = batch.batch_size
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        if self.prev_hidden is not None:
            assert batch.prev_hidden is not None  # an MTP step's
            self.prev_hidden[:n].copy_(batch.prev_hidden, non_blocking=True)
        ops = self.model.kernels.triton(self.input_ids)
        attn_rows = self.attn.graph_rows(bs) if ops is not None and batch.decode_rows is not None else None
        loc32 = batch.out_cache_loc32
        if page_table is not None:
            assert loc32 is not None  # Engine.write_step_rows defers the write only then
        if attn_rows is not None:
            # one launch for the copies below and the page-table write (rows n..bs-1 padded as they describe)
            assert batch.decode_rows is not None and ops is not None
            ops.decode_inputs(n, bs, batch.input_ids, batch.decode_rows, batch.seq_lens, self.input_ids, self.rows,
                              *attn_rows, page_table, loc32)
            # it zeroed rows n..bs-1; rows past bs may still hold a bigger step's slots
            self._dirty = self._dirty if self._dirty > bs else n
        else:
            if page_table is not None and loc32 is not None:
                page_table[batch.req_rows, batch.positions] = loc32
            self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
            if batch.decode_rows is not None:
                self.rows[:, :n].copy_(batch.decode_rows, non_blocking=True)
            else:
                self.positions[:n].copy_(batch.positions, non_blocking=True)
                self.out_cache_loc[:n].copy_(batch.out_cache_loc, non_blocking=True)
                self.req_rows[:n].copy_(batch.req_rows, non_blocking=True)
            if self._dirty > n:  # rows a bigger step wrote must not scribble over live KV slots now
                self.out_cache_loc[n : self._dirty].zero_()
            self._dirty = n
            self.attn.prepare_for_replay(batch, bs)
        self.graphs[bs].replay()
        self.last = n
        return self.logits[:n]

    def greedy_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The argmax rows the last replay took, if `logits` are that replay's and its graph took them (a view of
        the static buffer: stream-ordered readers only, before the next replay)."""
        n = logits.shape[0]
        if n > GREEDY_MAX_BS or n != self.last or logits.data_ptr() != self.logits.data_ptr():
            return None
        return self.greedy[:n]
