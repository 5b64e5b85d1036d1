"""Perplexity of a token sequence through an engine's own serving path: the quality check of its numeric modes.

The text goes in as chunked prefills into the paged KV pool, exactly as a long prompt would (each chunk
attends to the earlier ones through the pool, so an FP8 KV cache is read back as FP8), with logits kept
for every position instead of only the last. Used by the FP8 quality test and examples/fp8_quality.py.
"""

from __future__ import annotations

import math

import torch

from minisgl_cli.core.batch import ForwardBatch
from minisgl_cli.engine.engine import Engine


@torch.inference_mode()
def perplexity(engine: Engine, ids: list[int], chunk: int = 512) -> float:
    """exp(mean negative log-likelihood of ids[1:] given what precedes each), in prefill chunks of `chunk`."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    pool = engine.pool
    n = len(ids)
    row = pool.alloc_req_slot()
    pages = pool.alloc_pages(-(-n // pool.page_size))
    if row is None or pages is None or n > pool.max_context_len:
        raise ValueError(f"{n} tokens do not fit this engine's KV pool / context")
    try:
        slots = pool.slots_of_pages(pages)[:n]
        pool.page_table[row, :n] = slots.to(pool.device, torch.int32)
        nll = 0.0
        for start in range(0, n - 1, chunk):
            part = ids[start : start + chunk]
            batch = ForwardBatch.build("extend", part, [row], [start], [len(part)], slots[start : start + len(part)],
                                       engine.device, engine.host)
            batch.logits_indices = torch.arange(len(part), device=engine.device)  # every position, not the last
            logprobs = engine.forward(batch).float().log_softmax(-1)
            targets = torch.tensor(ids[start + 1 : start + len(part) + 1], device=engine.device)
            nll -= logprobs[torch.arange(len(targets), device=engine.device), targets].sum().item()
        return math.exp(nll / (n - 1))
    finally:
        pool.free_pages(pages)
        pool.free_req_slot(row)
