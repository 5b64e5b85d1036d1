"""Perplexity of documents through an engine's own serving path: the quality check of its numeric modes.

Each document goes in as chunked prefills into the paged KV pool, exactly as a long prompt would (each chunk
attends to the earlier ones through the pool, so an FP8 KV cache is read back as FP8), with logits kept for
every position instead of only the last. Documents are separate sequences: none sees another's tokens. Used
by the quality tests of the quantized modes (tests/test_fp8.py, tests/test_quant.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.engine import Engine


@torch.inference_mode()
def perplexity(engine: Engine, docs: Sequence[list[int]], chunk: int = 512) -> float:
    """exp(mean negative log-likelihood of each document's tokens after its first, given what precedes them in
    that document), each read in prefill chunks of `chunk` tokens."""
    nll, count = 0.0, 0
    for ids in docs:
        nll += _document_nll(engine, ids, chunk)
        count += len(ids) - 1
    if count == 0:
        raise ValueError("perplexity needs a document of at least two tokens")
    return math.exp(nll / count)


def _document_nll(engine: Engine, ids: list[int], chunk: int) -> float:
    pool = engine.pool
    n = len(ids)
    if n < 2:
        return 0.0
    row = pool.alloc_req_row()
    pages = pool.alloc_pages(-(-n // pool.page_size))
    if row is None or pages is None or n > pool.max_context_len:
        raise ValueError(f"{n} tokens do not fit this engine's KV pool / context")
    try:
        slots = pool.slots_of_pages(pages)[:n]
        pool.page_table[row, :n] = slots.to(pool.device, torch.int32)
        nll = 0.0
        for start in range(0, n - 1, chunk):
            part = ids[start : start + chunk]
            batch = ForwardBatch.build("prefill", part, [row], [start], [len(part)], slots[start : start + len(part)],
                                       engine.device, engine.host)
            batch.logits_indices = torch.arange(len(part), device=engine.device)  # every position, not the last
            logprobs = engine.forward(batch).float().log_softmax(-1)
            targets = torch.tensor(ids[start + 1 : start + len(part) + 1], device=engine.device)
            nll -= logprobs[torch.arange(len(targets), device=engine.device), targets].sum().item()
        return nll
    finally:
        pool.free_pages(pages)
        pool.free_req_row(row)
