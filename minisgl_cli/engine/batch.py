"""ForwardBatch: one engine step's tokens and where their KV lives, passed explicitly to every layer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from minisgl_cli.engine.host import HostBuffers

Mode = Literal["prefill", "decode"]


@dataclass
class ImageChunk:
    """Placeholder rows of one image in a step: rows `row..row+count` of the step take the image's embeddings
    `first..first+count` (a chunked prefill may cut an image)."""

    image: Any  # types.ImageInput
    row: int
    first: int
    count: int


@dataclass
class StepImages:
    """A vision-language model's prefill step: every token's M-RoPE positions, and the image rows it writes."""

    positions: torch.Tensor  # [3, T] int64: time, height, width position of each token
    chunks: list[ImageChunk]  # the images this step's rows hold, in row order
    rows: torch.Tensor | None = None  # [R] int64: the step's rows that take an image embedding
    embeds: torch.Tensor | None = None  # [R, hidden]: their embeddings (the engine fills both before the forward)


@dataclass
class ForwardBatch:
    """Flat token batch (no padding) for one forward: an extend (prefill) step or a decode step.

    Request i owns rows `qo_indptr[i]:qo_indptr[i+1]` of the flat token arrays; its KV for positions
    `0..seq_lens[i]-1` lives at slots `page_table[req_rows[i], :seq_lens[i]]` of the KV pool, the last
    `extend_lens[i]` of which this step writes (at `out_cache_loc`).
    """

    mode: Mode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot of each new token
    req_rows: torch.Tensor  # [B] int64: rows of the page table
    seq_lens: torch.Tensor  # [B] int32: tokens in KV after this step
    extend_lens: torch.Tensor  # [B] int32: new tokens this step (1 when decoding)
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    qo_indptr: torch.Tensor  # [B+1] int32: prefix sum of extend_lens
    logits_indices: torch.Tensor  # [B] int64: row of each request's last token
    attn_meta: Any = field(default=None)  # filled by the attention backend's prepare()
    images: StepImages | None = None  # a VLM's prefill step where a request holds images (vision/state.py)
    # A verify step (speculative decoding): each request's rows, consecutive (1 + its drafts); None otherwise.
    # Linear-attention layers run a request's rows in order and keep its state as it was until the scheduler says
    # how many were accepted (models/qwen3_next.py).
    runs: list[int] | None = None
    out_cache_loc32: torch.Tensor | None = None  # [T] int32: out_cache_loc as the page table holds slots
    # A decode step of one token a request: positions, out_cache_loc and req_rows as rows 0-2 of one [3, B] view of
    # the upload, so a graph replay takes them in one copy.
    decode_rows: torch.Tensor | None = None
    # The step's page-table entries (page_table[req_rows, positions] = out_cache_loc32) are still to write: the
    # engine writes them with the forward (`Engine.write_step_rows`; a decode graph's replay in its input launch).
    page_write: bool = False
    # MTP drafts (scheduler/mtp.py). `keep_hidden`: the model keeps every row's last hidden state in `hidden` [T, H]
    # (the target's after its final norm; the MTP module's before its head's norm: what the next MTP row takes).
    # `prev_hidden` [T, H]: an MTP step's input beside its tokens, the hidden state of each row's previous position.
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None
    prev_hidden: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"

    @staticmethod
    def build(
        mode: Mode,
        input_ids: list[int],
        req_rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor | list[int],
        device: torch.device | str,
        host: HostBuffers,
        positions: list[int] | None = None,
    ) -> ForwardBatch:
        """Derive positions and offsets on the host, then move them in two copies (int64, int32 fields), each field
        a view that starts on a 16-byte boundary (one compiled variant of every Triton kernel, whatever the sizes).

        On CUDA the copies go through `host` (the engine's pinned buffers) asynchronously, so building the
        next step's batch never waits for the step the GPU is running."""
        B = len(req_rows)
        if mode == "decode" and len(input_ids) == B:  # one token a request: the offsets are the row numbers
            positions = list(prefix_lens) if positions is None else positions
            seq_lens = [p + 1 for p in prefix_lens]
            indptr = list(range(B + 1))
        else:
            if positions is None:
                positions = []
                for p, e in zip(prefix_lens, extend_lens):
                    positions.extend(range(p, p + e))
            seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
            indptr = [0, *itertools.accumulate(extend_lens)]
        if isinstance(out_cache_loc, torch.Tensor):
            out_cache_loc = out_cache_loc.tolist()
        device = torch.device(device)
        (ids, pos, loc, slots, last), (lens, extends, qo_indptr, loc32) = host.to_device_mixed(
            [([input_ids, positions, out_cache_loc, req_rows, [i - 1 for i in indptr[1:]]], torch.int64),
             ([seq_lens, extend_lens, indptr, out_cache_loc], torch.int32)], device)
        decode_rows = None
        if len(input_ids) == B and B:  # parts of B entries each, padded alike: equally spaced in the upload
            decode_rows = pos.as_strided((3, B), (B + B % 2, 1))
        return ForwardBatch(
            mode=mode,
            input_ids=ids,
            positions=pos,
            out_cache_loc=loc,
            req_rows=slots,
            seq_lens=lens,
            extend_lens=extends,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
            qo_indptr=qo_indptr,
            logits_indices=last,
            out_cache_loc32=loc32,
            decode_rows=decode_rows,
        )
