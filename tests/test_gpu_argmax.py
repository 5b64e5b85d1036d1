"""The greedy argmax of a decode graph (kernels/triton/sampling.py's argmax_rows: a row over many programs, the last
to finish picking) against torch.argmax: the first of the largest, across blocks and within one, a NaN counted as
the largest, a row of -inf, a vocabulary that ends inside a block. On CUDA, or without a GPU under Triton's interpreter
on CPU tensors where triton is importable and TRITON_INTERPRET=1 was set before it was imported:
    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_argmax.py
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp import NEEDS_TRITON, patch_interpreter

pytestmark = [pytest.mark.gpu, NEEDS_TRITON]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_argmax_rows_picks_what_torch_argmax_picks(dtype):
    patch_interpreter()
    from minisgl_cli.kernels.triton.sampling import SPLIT, argmax_rows

    vocab = 2 * SPLIT + 333  # the last block is partly past the vocabulary
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, vocab, generator=g)
    logits[1, [7, SPLIT + 9]] = 9.0  # the largest twice, in two blocks: the first wins
    logits[2, [SPLIT + 3, SPLIT + 4]] = 9.0  # twice in one block
    logits[3, SPLIT + 11] = float("nan")  # torch's argmax takes the NaN
    logits[4] = float("-inf")  # nothing finite: index 0
    logits[5, vocab - 1] = 9.0  # the largest in the partial block
    logits = logits.to(DEV, dtype)
    counts = torch.zeros(8, dtype=torch.int32, device=DEV)
    out = torch.full((6,), -1, dtype=torch.int64, device=DEV)
    argmax_rows(logits, out, counts)
    want = torch.argmax(logits.float().cpu(), dim=-1)
    assert torch.equal(out.cpu(), want), (out.cpu().tolist(), want.tolist())
    assert want.tolist()[1:] == [7, SPLIT + 3, SPLIT + 11, 0, vocab - 1]
    assert not counts.any()  # left zero for the next call
    argmax_rows(logits[:2], out[:2], counts)  # again, with the counters it left
    assert torch.equal(out[:2].cpu(), want[:2])
