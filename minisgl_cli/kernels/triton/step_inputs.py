"""A decode step's inputs into its CUDA graph's static buffers in one launch.

Between two decode graphs the device ran the step's copies one by one: the tokens, the positions / KV slots / page
rows, the attention's rows and lengths, and the page-table write of each new token's slot, each a kernel or copy of
a microsecond that the device starts ~2.5 µs after the one before (an H200's timeline, `examples/decode_host.py`:
29 µs between Llama-3.1-8B's graphs, 21 of them idle). One program a 128 rows does all of them (19 µs
between the graphs after it, one H200 call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _decode_inputs_kernel(ids_ptr, rows_ptr, stride_rows, lens_ptr, loc32_ptr, out_ids_ptr, out_rows_ptr,
                          stride_out, attn_rows_ptr, attn_lens_ptr, pt_ptr, stride_pt, n, bs,
                          WRITE_PT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    run = i < bs  # rows n..bs-1 pad the graph: token 0 at position 0 into scratch slot 0, one position of row 0
    ids = tl.load(ids_ptr + i, mask=live, other=0)
    pos = tl.load(rows_ptr + i, mask=live, other=0)
    loc = tl.load(rows_ptr + stride_rows + i, mask=live, other=0)
    row = tl.load(rows_ptr + 2 * stride_rows + i, mask=live, other=0)
    lens = tl.load(lens_ptr + i, mask=live, other=1)
    tl.store(out_ids_ptr + i, ids, mask=run)
    tl.store(out_rows_ptr + i, pos, mask=run)
    tl.store(out_rows_ptr + stride_out + i, loc, mask=run)
    tl.store(out_rows_ptr + 2 * stride_out + i, row, mask=run)
    tl.store(attn_rows_ptr + i, row, mask=run)
    tl.store(attn_lens_ptr + i, lens, mask=run)
    if WRITE_PT:  # page_table[row, position] = the new token's slot
        tl.store(pt_ptr + row * stride_pt + pos, tl.load(loc32_ptr + i, mask=live, other=0), mask=live)


def decode_inputs(n: int, bs: int, input_ids: torch.Tensor, decode_rows: torch.Tensor, seq_lens: torch.Tensor,
                  out_ids: torch.Tensor, out_rows: torch.Tensor, attn_rows: torch.Tensor, attn_lens: torch.Tensor,
                  page_table: torch.Tensor | None = None, loc32: torch.Tensor | None = None) -> None:
    """A decode step of n rows into graph bs's static inputs: out_ids [>= bs] int64 <- input_ids [n]; out_rows
    [3, >= bs] int64 (positions, KV slots, page rows) <- decode_rows [3, n]; the attention's attn_rows [>= bs] int64
    and attn_lens [>= bs] int32 <- decode_rows[2], seq_lens [n]; rows n..bs-1 as the graph pads them (0, lengths
    1). With `page_table` (int32 [R, L]): page_table[decode_rows[2], decode_rows[0]] = loc32 [n] as well."""
    assert 0 < n <= bs <= out_ids.shape[0] and input_ids.stride(0) == 1 and seq_lens.stride(0) == 1
    assert decode_rows.stride(1) == 1 and out_rows.stride(1) == 1 and attn_rows.stride(0) == attn_lens.stride(0) == 1
    write = page_table is not None
    pt = page_table if page_table is not None else attn_lens  # (unread without WRITE_PT)
    assert not write or (loc32 is not None and loc32.stride(0) == 1 and pt.stride(1) == 1)
    _decode_inputs_kernel[(triton.cdiv(bs, BLOCK),)](
        input_ids, decode_rows, decode_rows.stride(0), seq_lens, loc32 if loc32 is not None else seq_lens, out_ids,
        out_rows, out_rows.stride(0), attn_rows, attn_lens, pt, pt.stride(0), n, bs, WRITE_PT=write, BLOCK=BLOCK,
        num_warps=4)
