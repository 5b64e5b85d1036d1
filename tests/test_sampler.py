"""The sampler's logprobs, logit bias and grammar masks on random logits: each row's logprobs are the
log-softmax of the distribution its token was drawn from, and a plain batch costs nothing extra."""

from __future__ import annotations

import torch

from minisgl_cli.engine.sampler import SamplingRow, apply_token_bitmask, sample
from minisgl_cli.types import SamplingParams

V = 100


def _rows(*params: SamplingParams, seed: int = 0) -> list[SamplingRow]:
    return [SamplingRow(p, torch.Generator().manual_seed(seed + i) if p.seed is not None else None, [])
            for i, p in enumerate(params)]


def test_plain_batch_computes_no_logprobs():
    logits = torch.randn(3, V)
    out = sample(logits, _rows(SamplingParams(), SamplingParams(), SamplingParams()))
    assert out.lp_rows is None and out.logprob is None and out.top_ids is None
    assert out.next_ids.tolist() == logits.argmax(-1).tolist()


def test_greedy_logprob_is_the_top_entry():
    logits = torch.randn(2, V)
    out = sample(logits, _rows(SamplingParams(logprobs=True, top_logprobs=5), SamplingParams()))
    assert out.lp_rows == [0]
    want = logits[0].log_softmax(-1)
    tok = int(out.next_ids[0])
    assert tok == int(want.argmax())
    assert torch.allclose(out.logprob[0], want[tok])
    assert out.top_ids[0, 0].item() == tok and torch.allclose(out.top_logprobs[0, 0], want[tok])
    assert torch.allclose(out.top_logprobs[0], want.topk(5).values)


def test_sampled_logprob_is_of_the_tempered_cut_distribution():
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=0.7, top_k=10, seed=3, logprobs=True, top_logprobs=12)
    out = sample(logits, _rows(p))
    scaled = logits[0] / 0.7
    kth = scaled.topk(10).values[-1]
    want = scaled.masked_fill(scaled < kth, float("-inf")).log_softmax(-1)
    tok = int(out.next_ids[0])
    assert torch.isfinite(want[tok]) and torch.allclose(out.logprob[0], want[tok])
    assert torch.allclose(out.top_logprobs[0, :10], want.topk(10).values)
    assert torch.isinf(out.top_logprobs[0, 10:]).all()  # past top-k: impossible tokens


def test_logit_bias_and_penalties_shape_the_distribution():
    logits = torch.zeros(1, V)
    out = sample(logits, _rows(SamplingParams(logit_bias={7: 5.0, 8: -100.0}, logprobs=True)))
    assert out.next_ids.tolist() == [7]
    want = torch.zeros(V)
    want[7], want[8] = 5.0, -100.0
    assert torch.allclose(out.logprob[0], want.log_softmax(-1)[7])


def test_bitmask_allows_only_its_tokens():
    logits = torch.randn(2, V)
    words = (V + 31) // 32
    mask = torch.zeros(2, words, dtype=torch.int32)
    mask[0, 1] = 1 << 3  # row 0: token 35 only
    mask[1] = -1  # row 1: everything
    out = sample(logits, _rows(SamplingParams(logprobs=True), SamplingParams()), bitmask=mask)
    assert out.next_ids.tolist() == [35, int(logits[1].argmax())]
    assert abs(out.logprob[0].item()) < 1e-6  # the only allowed token has probability 1
    masked = logits.clone()
    apply_token_bitmask(masked, mask)
    assert torch.isinf(masked[0]).sum() == V - 1 and not torch.isinf(masked[1]).any()
