"""The gated delta rule's rows-in-order kernel (kernels/triton/gated_delta.py) against the torch path it replaces on
CUDA (attention/gated_delta.py's verify and commit, a round at a time): requests with runs of several lengths, slots
out of order, commits over some, none or all of a request's rows, and slots the step does not name left alone.

The cases run on CUDA, or without a GPU under Triton's interpreter on CPU tensors (as tests/test_gpu_mla_attention.py):

    PYTHONPATH=$PWD:/path/to/triton TRITON_INTERPRET=1 python -m pytest -q tests/test_gpu_gated_delta.py
"""

from __future__ import annotations

import pytest
import torch

from minisgl_cli.attention import gated_delta
from tests.triton_interp import NEEDS_TRITON, patch_interpreter

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _step_inputs(runs: list[int], hk: int, hv: int, dk: int, dv: int, seed: int):
    """A verify step's raw q, k [T, hk, dk], v [T, hv, dv] (bf16 where the kernel runs in the engine), g (log decay,
    < 0) and beta [T, hv], and a state pool of 6 slots [6, hv, dk, dv] (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(runs)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.5
    beta = torch.rand(t, hv, generator=gen)
    ssm = torch.randn(6, hv, dk, dv, generator=gen) * 0.3
    return [x.to(DEV) for x in (q, k, v, g, beta, ssm)]


@NEEDS_TRITON
@pytest.mark.parametrize("shape", [(2, 4, 16, 24), (1, 1, 32, 32), (2, 2, 64, 40)],
                         ids=["grouped-ragged-v", "one-head", "wide"])
def test_verify_and_commit_in_one_launch_are_the_rounds(shape):
    """Outputs of every row and the committed states equal the torch rounds' to fp32 rounding; the verify step writes
    no state; a commit of 0 rows leaves that request's slot, and slots no request names stay as they were."""
    patch_interpreter()
    hk, hv, dk, dv = shape
    runs, accepted = [3, 1, 4], [2, 0, 4]
    slots = torch.tensor([4, 1, 2], device=DEV)
    q, k, v, g, beta, ssm = _step_inputs(runs, hk, hv, dk, dv, seed=sum(shape))
    before = ssm.clone()
    ours_ssm, theirs_ssm = ssm.clone(), ssm.clone()
    ours, ours_inputs = gated_delta.verify(q, k, v, g, beta, ours_ssm, slots, runs, fused=True)
    theirs, theirs_inputs = gated_delta.verify(q, k, v, g, beta, theirs_ssm, slots, runs, fused=False)
    assert torch.equal(ours_ssm, before)  # a verify step reads the slots only
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.abs().max() > 1e-2  # the rows read something (q is scaled by dk^-1/2)
    gated_delta.commit(ours_inputs, ours_ssm, slots, runs, accepted, fused=True)
    gated_delta.commit(theirs_inputs, theirs_ssm, slots, runs, accepted, fused=False)
    torch.testing.assert_close(ours_ssm, theirs_ssm, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours_ssm[4], before[4]) and not torch.allclose(ours_ssm[2], before[2])
    for untouched in (0, 1, 3, 5):  # slot 1's request accepted nothing; the others are no request's
        assert torch.equal(ours_ssm[untouched], before[untouched])


@NEEDS_TRITON
def test_committing_all_rows_is_what_decode_steps_make():
    """A request's rows committed in one launch = the same rows through `decode` one step at a time (the path a
    decode graph runs), so accepted drafts leave the state as decoding them would."""
    patch_interpreter()
    runs = [4]
    q, k, v, g, beta, ssm = _step_inputs(runs, 2, 4, 16, 16, seed=7)
    slot = torch.tensor([3], device=DEV)
    stepped = ssm.clone()
    outs = [gated_delta.decode(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1], beta[i : i + 1], stepped, slot)
            for i in range(4)]
    out, inputs = gated_delta.verify(q, k, v, g, beta, ssm, slot, runs, fused=True)
    gated_delta.commit(inputs, ssm, slot, runs, [4], fused=True)
    torch.testing.assert_close(out, torch.cat(outs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ssm, stepped, rtol=1e-5, atol=1e-5)


@NEEDS_TRITON
def test_a_fused_decode_step_is_the_torch_step():
    """`decode` in one launch (the path a 16-bit CUDA decode graph runs) = torch's gather, step and scatter: the
    outputs, the states of the slots it names, and the other slots left alone."""
    patch_interpreter()
    q, k, v, g, beta, ssm = _step_inputs([1, 1, 1], 2, 4, 32, 24, seed=11)
    slots = torch.tensor([5, 0, 2], device=DEV)
    ours_ssm, theirs_ssm = ssm.clone(), ssm.clone()
    ours = gated_delta.decode(q, k, v, g, beta, ours_ssm, slots, fused=True)
    theirs = gated_delta.decode(q, k, v, g, beta, theirs_ssm, slots, fused=False)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_ssm, theirs_ssm, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours_ssm[5], ssm[5])
    for untouched in (1, 3, 4):
        assert torch.equal(ours_ssm[untouched], ssm[untouched])
