"""A decode step's inputs in one launch (kernels/triton/step_inputs.py) against the copies a graph replay made one by
one: the tokens, the [3, B] rows (positions, KV slots, page rows), the attention's rows and lengths, the padding rows
up to the graph's size, and the page-table write. On CUDA, or without a GPU under Triton's interpreter:
    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_step_inputs.py
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _upload(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's fields as ForwardBatch.build lays them out: ids, then [3, n] rows at a stride of n rounded up to
    even (its 16-byte parts), lengths and int32 slots."""
    stride = n + n % 2
    flat = torch.zeros(4 * stride, dtype=torch.int64)
    ids = torch.randint(0, 1000, (n,), generator=g)
    pos = torch.randint(0, 40, (n,), generator=g)
    loc = torch.randperm(500, generator=g)[:n] + 1
    rows = torch.randperm(9, generator=g)[:n] if n <= 9 else torch.arange(n) % 9
    pos = pos if n <= 9 else torch.arange(n) // 9  # one position a (row, position) pair
    for k, part in enumerate((ids, pos, loc, rows)):
        flat[k * stride : k * stride + n] = part
    flat = flat.to(DEV)
    decode_rows = flat[stride:].as_strided((3, n), (stride, 1))
    return flat[:n], decode_rows, (pos + 1).to(DEV, torch.int32), loc.to(DEV, torch.int32)


@pytest.mark.parametrize("n,bs", [(1, 1), (3, 4), (5, 8), (130, 136)])
@pytest.mark.parametrize("write", [True, False], ids=["page-write", "no-page-write"])
def test_decode_inputs_equal_the_copies_they_replace(n, bs, write):
    patch_interpreter()
    from minisgl_cli.kernels.triton.step_inputs import decode_inputs

    g = torch.Generator().manual_seed(n * 7 + bs)
    ids, decode_rows, lens, loc32 = _upload(n, g)
    cap = 160  # the graphs' largest size: rows past bs keep what they held

    def stale() -> list[torch.Tensor]:
        h = torch.Generator().manual_seed(99)
        return [torch.randint(1, 50, (cap,), generator=h).to(DEV),
                torch.randint(1, 50, (3, cap), generator=h).to(DEV),
                torch.randint(1, 50, (cap,), generator=h).to(DEV),
                torch.randint(1, 50, (cap,), generator=h).to(DEV, torch.int32),
                torch.full((9, 48), -7, dtype=torch.int32, device=DEV)]

    want = stale()
    w_ids, w_rows, w_arows, w_alens, w_pt = want
    w_ids[:n] = ids
    w_rows[:, :n] = decode_rows
    w_rows[:, n:bs] = 0
    w_ids[n:bs] = 0
    w_arows[:n], w_alens[:n] = decode_rows[2], lens
    w_arows[n:bs], w_alens[n:bs] = 0, 1
    if write:
        w_pt[decode_rows[2], decode_rows[0]] = loc32

    got = stale()
    decode_inputs(n, bs, ids, decode_rows, lens, got[0], got[1], got[2][:bs], got[3][:bs],
                  got[4] if write else None, loc32)
    for name, a, b in zip(("ids", "rows", "attn rows", "attn lens", "page table"), got, want):
        assert torch.equal(a.cpu(), b.cpu()), name
    if write:
        assert (got[4] != -7).sum().item() == n  # each (row, position) once, nothing else touched
