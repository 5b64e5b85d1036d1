"""ForwardBatch: one engine step's tokens and where their KV lives, passed explicitly to every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

Mode = Literal["extend", "decode"]


@dataclass
class ForwardBatch:
    """Flat token batch (no padding) for one forward: an extend (prefill) step or a decode step.

    Request i owns rows `qo_indptr[i]:qo_indptr[i+1]` of the flat token arrays; its KV for positions
    `0..seq_lens[i]-1` lives at slots `page_table[req_slots[i], :seq_lens[i]]` of the KV pool, the last
    `extend_lens[i]` of which this step writes (at `out_cache_loc`).
    """

    mode: Mode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64: KV slot of each new token
    req_slots: torch.Tensor  # [B] int64: rows of the page table
    seq_lens: torch.Tensor  # [B] int32: tokens in KV after this step
    extend_lens: torch.Tensor  # [B] int32: new tokens this step (1 when decoding)
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    qo_indptr: torch.Tensor  # [B+1] int32: prefix sum of extend_lens
    logits_indices: torch.Tensor  # [B] int64: row of each request's last token
    attn_meta: Any = field(default=None)  # filled by the attention backend's prepare()

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"

    @staticmethod
    def build(
        mode: Mode,
        input_ids: list[int],
        req_slots: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str,
    ) -> "ForwardBatch":
        """Derive positions and offsets on the CPU, then move everything in one go per tensor."""
        positions: list[int] = []
        for p, e in zip(prefix_lens, extend_lens):
            positions.extend(range(p, p + e))
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        indptr = [0]
        for e in extend_lens:
            indptr.append(indptr[-1] + e)
        pin = torch.device(device).type == "cuda"

        def dev(data: list[int], dtype: torch.dtype) -> torch.Tensor:
            t = torch.tensor(data, dtype=dtype, pin_memory=pin)
            return t.to(device, non_blocking=True)

        return ForwardBatch(
            mode=mode,
            input_ids=dev(input_ids, torch.int64),
            positions=dev(positions, torch.int64),
            out_cache_loc=out_cache_loc.to(device, non_blocking=True),
            req_slots=dev(req_slots, torch.int64),
            seq_lens=dev(seq_lens, torch.int32),
            extend_lens=dev(extend_lens, torch.int32),
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(extend_lens),
            qo_indptr=dev(indptr, torch.int32),
            logits_indices=dev([i - 1 for i in indptr[1:]], torch.int64),
        )
