"""The sampler on random logits, with its real device-side state: draws follow the softmax (chi-square), top-k /
top-p / min-p keep exactly their tokens, penalties equal a plain reference, seeded rows ignore the batch, each
row's logprobs are of the distribution its token was drawn from, and a plain batch costs nothing extra."""

from __future__ import annotations

import pytest
import torch

from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.sampling.sampler import (
    Sampled,
    Sampler,
    apply_token_bitmask,
    cpu_draw,
    create_sampler,
    cut,
    sample,
    torch_draw,
)
from minisgl_cli.sampling.state import SamplingBatch, SamplingState
from minisgl_cli.types import SamplingParams

V = 100
CPU = torch.device("cpu")
SAMPLER = create_sampler(CPU, V)


def _state(*params: SamplingParams, vocab: int = V, prompts: list[list[int]] | None = None,
           outputs: list[list[int]] | None = None) -> SamplingState:
    state = SamplingState(max(len(params), 1), vocab, CPU, HostBuffers())
    for slot, p in enumerate(params):
        state.set_row(slot, p, prompts[slot] if prompts else [1], outputs[slot] if outputs else [])
    return state


def _batch(state: SamplingState, slots: list[int], positions: list[int] | None = None) -> SamplingBatch:
    pos = torch.tensor(positions if positions is not None else [7] * len(slots))
    return state.batch(slots, torch.tensor(slots), pos, [True] * len(slots))


def _sample(logits: torch.Tensor, *params: SamplingParams, bitmask: torch.Tensor | None = None) -> Sampled:
    state = _state(*params, vocab=logits.shape[-1])
    return sample(logits, _batch(state, list(range(len(params)))), state, SAMPLER, bitmask)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_plain_batch_computes_no_logprobs():
    logits = torch.randn(3, V)
    out = _sample(logits, SamplingParams(), SamplingParams(), SamplingParams())
    assert out.lp_rows is None and out.logprob is None and out.top_ids is None
    assert out.next_ids.tolist() == logits.argmax(-1).tolist()


def test_sampled_frequencies_match_the_softmax():
    """20k draws of one row (a new position each) over 10 tokens: chi-square with 9 degrees of freedom stays
    below its 0.1% quantile (27.9); a wrong temperature or an off-by-one mask lands far above it."""
    torch.manual_seed(0)
    logits = torch.randn(1, 10) * 2
    n = 20000
    state = _state(SamplingParams(temperature=0.8, seed=5), vocab=10)
    batch = _batch(state, [0] * n, list(range(n)))
    ids = sample(logits.expand(n, 10), batch, state, SAMPLER).next_ids
    counts = torch.bincount(ids, minlength=10).double()
    assert _chi2(counts, (logits[0] / 0.8).softmax(-1).double()) < 27.9
    assert _chi2(counts, logits[0].softmax(-1).double()) > 100  # the test can tell temperature 1 from 0.8


@pytest.mark.parametrize("top_k", [4, -1])
@pytest.mark.parametrize("sampler", [Sampler("cpu", cpu_draw), Sampler("mask", torch_draw)],
                         ids=lambda s: s.name)
def test_cut_draws_follow_the_kept_distribution(sampler, top_k):
    """top-p 0.45 (the cut that binds: 3 tokens) + min-p 0.05, with or without top-k 4, over 12 tokens: draws land
    only on the kept tokens, in their proportions (the CPU path draws the top-k row from its candidates, the other
    by rejection)."""
    torch.manual_seed(1)
    logits = torch.randn(1, 12) * 1.5
    p = SamplingParams(temperature=1.0, top_k=top_k, top_p=0.45, min_p=0.05, seed=9)
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(12, dtype=torch.bool)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if (top_k < 0 or rank < top_k) and mass <= 0.45 and probs[t] >= 0.05 * probs.max():
            keep[t] = True
        mass += float(probs[t])
    want = torch.where(keep, probs, 0.0)
    want /= want.sum()
    n = 20000
    state = _state(p, vocab=12)
    ids = sample(logits.expand(n, 12), _batch(state, [0] * n, list(range(n))), state, sampler).next_ids
    counts = torch.bincount(ids, minlength=12).double()
    assert set(ids.unique().tolist()) == set(keep.nonzero()[:, 0].tolist())
    assert keep.sum() == 3 and _chi2(counts, want.double()) < 13.8  # 2 degrees of freedom, 0.1% quantile


def _kept(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    state = _state(p, vocab=logits.shape[-1])
    batch = _batch(state, [0])
    params = state.params(batch.req_rows)
    return set(torch.isfinite(cut(logits / p.temperature, params, batch))[0].nonzero()[:, 0].tolist())


def test_top_k_top_p_min_p_keep_exactly_their_tokens():
    torch.manual_seed(2)
    logits = torch.randn(1, V) * 3
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True).tolist()
    assert _kept(logits, SamplingParams(temperature=1.0, top_k=7)) == set(order[:7])
    before = probs[order].cumsum(0) - probs[order]
    n_p = int((before <= 0.5).sum())
    assert _kept(logits, SamplingParams(temperature=1.0, top_p=0.5)) == set(order[:n_p])  # the sort path
    # top_k bounds the candidates (the topk path): the same set as the sort gives
    assert _kept(logits, SamplingParams(temperature=1.0, top_p=0.5, top_k=50)) == set(order[:min(n_p, 50)])
    floor = 0.1 * probs.max()
    assert _kept(logits, SamplingParams(temperature=1.0, min_p=0.1)) == set((probs >= floor).nonzero()[:, 0].tolist())
    assert _kept(logits, SamplingParams(temperature=1.0)) == set(range(V))


@pytest.mark.parametrize("sampler", [Sampler("cpu", cpu_draw), Sampler("mask", torch_draw)], ids=lambda s: s.name)
def test_a_tie_at_the_cut_keeps_all_of_its_tokens(sampler):
    """Tied logits share one fate (HF's and vLLM's top-k, and the Triton kernel, keep a boundary tie whole): the
    cut and the draws agree on it, on the sort path and on the top-k candidates alike. bf16 logits tie often."""
    logits = torch.full((1, 16), -4.0)
    logits[0, [3, 9, 12, 5]] = torch.tensor([3.0, 2.0, 2.0, 1.0])  # token 3 first, 9 and 12 tied second
    assert _kept(logits, SamplingParams(temperature=1.0, top_k=2)) == {3, 9, 12}
    assert _kept(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.99)) == {3, 9, 12}
    probs = logits[0].softmax(-1)
    assert probs[3] < 0.6  # so top-p 0.6 passes token 3's mass: the tie after it stays, both of its tokens
    assert _kept(logits, SamplingParams(temperature=1.0, top_p=0.6)) == {3, 9, 12}
    n = 3000
    state = _state(SamplingParams(temperature=1.0, top_k=2), vocab=16)
    ids = sample(logits.expand(n, 16), _batch(state, [0] * n, list(range(n))), state, sampler).next_ids
    assert set(ids.tolist()) == {3, 9, 12}


def test_mixed_batch_cuts_each_row_by_its_own_params():
    """A top-p row beside a top-k row and an uncut row: each keeps its own set (the sort path serves all three)."""
    torch.manual_seed(3)
    logits = torch.randn(3, V) * 3
    ps = [SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=1.0, top_k=5),
          SamplingParams(temperature=1.0)]
    state = _state(*ps)
    batch = _batch(state, [0, 1, 2])
    kept = torch.isfinite(cut(logits, state.params(batch.req_rows), batch))
    for row, p in enumerate(ps):
        assert set(kept[row].nonzero()[:, 0].tolist()) == _kept(logits[row : row + 1], p)


def _reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """HF / vLLM repetition penalty over prompt + output, then OpenAI presence / frequency over the output, then
    the bias."""
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    return out


def test_penalties_equal_a_plain_reference():
    torch.manual_seed(4)
    logits = torch.randn(3, V) * 3
    prompts = [[1, 2, 3, 2], [5, 6], [9]]
    outputs = [[3, 4, 4, 7], [6, 6, 6], []]
    ps = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, logprobs=True),
          SamplingParams(repetition_penalty=0.7, logit_bias={0: 2.0, 6: -1.5}, logprobs=True),
          SamplingParams(frequency_penalty=1.0, logprobs=True)]
    # The outputs reach the state two ways: row 0 at admission (as after a retraction), rows 1-2 by `record`.
    state = SamplingState(3, V, CPU, HostBuffers())
    state.set_row(0, ps[0], prompts[0], outputs[0])
    state.set_row(1, ps[1], prompts[1], [])
    state.set_row(2, ps[2], prompts[2], [])
    for tok in outputs[1]:
        b = state.batch([1], torch.tensor([1]), torch.tensor([0]), [True])
        state.record(b, torch.tensor([tok]))
    batch = _batch(state, [0, 1, 2])
    got = logits.clone()
    state.penalize(got, batch, state.params(batch.req_rows))
    for row in range(3):
        want = _reference_penalties(logits[row], prompts[row], outputs[row], ps[row])
        torch.testing.assert_close(got[row], want)
    # and the logprobs report the penalized distribution
    out = sample(logits, batch, state, SAMPLER)
    assert torch.allclose(out.logprob, got.log_softmax(-1).gather(1, out.next_ids[:, None])[:, 0])


def test_record_skips_rows_that_drew_no_token():
    """A prompt chunk's row draws nothing real: its token must not count."""
    state = _state(SamplingParams(frequency_penalty=1.0), SamplingParams(frequency_penalty=1.0))
    b = state.batch([0, 1], torch.tensor([0, 1]), torch.tensor([3, 3]), [True, False])
    state.record(b, torch.tensor([4, 5]))
    assert state.counts is not None
    assert state.counts[0, 4] == 1 and state.counts[1].sum() == 0


def test_seeded_row_draws_the_same_tokens_in_any_batch():
    torch.manual_seed(5)
    logits = torch.randn(1, V)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(), SamplingParams(temperature=1.0, min_p=0.1)]
    alone_state = _state(seeded)
    alone = [int(sample(logits, _batch(alone_state, [0], [pos]), alone_state, SAMPLER).next_ids[0])
             for pos in range(40)]
    mixed_state = _state(*others, seeded)
    mixed = []
    for pos in range(40):
        batch = _batch(mixed_state, [3, 0, 1, 2], [pos, 11, 12, 13])
        mixed.append(int(sample(torch.cat([logits, torch.randn(3, V)]), batch, mixed_state, SAMPLER).next_ids[0]))
    assert alone == mixed
    assert len(set(alone)) > 5  # really sampled


def test_greedy_logprob_is_the_top_entry():
    logits = torch.randn(2, V)
    out = _sample(logits, SamplingParams(logprobs=True, top_logprobs=5), SamplingParams())
    assert out.lp_rows == [0]
    want = logits[0].log_softmax(-1)
    tok = int(out.next_ids[0])
    assert tok == int(want.argmax())
    assert torch.allclose(out.logprob[0], want[tok])
    assert out.top_ids[0, 0].item() == tok and torch.allclose(out.top_logprobs[0, 0], want[tok])
    assert torch.allclose(out.top_logprobs[0], want.topk(5).values)


def test_sampled_logprob_is_of_the_tempered_cut_distribution():
    logits = torch.randn(1, V)
    out = _sample(logits, SamplingParams(temperature=0.7, top_k=10, seed=3, logprobs=True, top_logprobs=12))
    scaled = logits[0] / 0.7
    kth = scaled.topk(10).values[-1]
    want = scaled.masked_fill(scaled < kth, float("-inf")).log_softmax(-1)
    tok = int(out.next_ids[0])
    assert torch.isfinite(want[tok]) and torch.allclose(out.logprob[0], want[tok])
    assert torch.allclose(out.top_logprobs[0, :10], want.topk(10).values)
    assert torch.isinf(out.top_logprobs[0, 10:]).all()  # past top-k: impossible tokens


def test_logit_bias_shapes_the_distribution():
    logits = torch.zeros(1, V)
    out = _sample(logits, SamplingParams(logit_bias={7: 5.0, 8: -100.0}, logprobs=True))
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
    out = _sample(logits, SamplingParams(logprobs=True), SamplingParams(), bitmask=mask)
    assert out.next_ids.tolist() == [35, int(logits[1].argmax())]
    assert abs(out.logprob[0].item()) < 1e-6  # the only allowed token has probability 1
    masked = logits.clone()
    apply_token_bitmask(masked, mask)
    assert torch.isinf(masked[0]).sum() == V - 1 and not torch.isinf(masked[1]).any()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sampler", [Sampler("cpu", cpu_draw), Sampler("mask", torch_draw)], ids=lambda s: s.name)
def test_a_row_of_overflowed_logits_still_draws_a_token(sampler):
    """A repetition penalty near 0 divides positive logits into inf (NaN after the softmax shift): that row takes some
    token of the vocabulary, and the draw ends (the CPU's rejection loop used to spin for ever, stalling the
    scheduler and every request beside it)."""
    logits = torch.randn(3, V)
    logits[0, :5], logits[1] = float("inf"), float("nan")
    state = _state(SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9),
                   SamplingParams(temperature=1.0))
    ids = sample(logits, _batch(state, [0, 1, 2]), state, sampler).next_ids
    assert ((ids >= 0) & (ids < V)).all(), ids


def test_a_slot_no_request_took_reads_as_a_greedy_row():
    """Padded rows of a captured sampler graph read slots nobody wrote: they must hold a greedy row's neutral values
    (with zeros, top_k 0 kept the Triton kernel's rejection rounds going forever and hung the GPU)."""
    state = SamplingState(4, 1000, CPU, HostBuffers())
    state.set_row(1, SamplingParams(temperature=0.7, top_p=0.9, top_k=5), [1], [])
    state.batch([1], torch.tensor([1]), torch.tensor([3], dtype=torch.int32), [True])  # flushes slot 1's row
    p = state.params(torch.tensor([0, 1, 3]))
    assert p.greedy.tolist() == [True, False, True]
    assert p.temperature.tolist()[::2] == [1.0, 1.0] and p.top_p.tolist()[::2] == [1.0, 1.0]
    assert p.top_k.tolist() == [1000, 5, 1000] and p.repetition.tolist()[::2] == [1.0, 1.0]
