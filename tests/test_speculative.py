"""Speculative decoding's verify steps (scheduler/speculative.py): a decode step carrying draft tokens gives exactly the
tokens decoding gives without them -- greedy and seeded sampled, with penalties, logit bias, logprobs, stop strings,
max_tokens and a JSON-schema grammar -- in the default CPU mode (int4) and the exact one, and holds no page of a
rejected draft afterwards. The drafts here come from an oracle that replays the answer without speculation and spoils
some of it, so every step accepts a part of what it proposes."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.core.host import HostBuffers
from minisgl_cli.engine.sampler import create_sampler, sample
from minisgl_cli.engine.sampling_state import SamplingState
from minisgl_cli.scheduler import speculative
from minisgl_cli.scheduler.speculative import DraftBudget, accepted_run

CHATS = [[{"role": "user", "content": p}] for p in (
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a KV cache is in one sentence.")]
EXACT = dict(dtype="float32", quantization="none", deterministic=True)


class Oracle:
    """Proposes what the answer without speculation said next, every `spoil`-th proposal with one token wrong."""

    name = "oracle"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], spoil: int = 3):
        self.answers, self.spoil, self.calls, self.released = answers, spoil, 0, 0

    def propose(self, reqs, budgets):
        out = []
        for req, n in zip(reqs, budgets):
            done = len(req.output_ids)
            d = list(self.answers.get(tuple(req.input_ids), [])[done : done + n])
            self.calls += 1
            if d and self.calls % self.spoil == 0:
                d[len(d) // 2] = (d[len(d) // 2] + 1) % 1000
            out.append(d)
        return out

    def release(self, req) -> None:
        self.released += 1

    def close(self) -> None:
        pass


def _with_oracle(monkeypatch, llm_kw: dict, prompts, params, k: int = 3):
    """(answers without speculation, answers with the oracle's drafts, the speculating engine's stats)."""
    with LLM(**llm_kw) as llm:
        plain = llm.generate(prompts, params)
        ids = [llm.client.tokenizer.apply_chat_template(p) for p in prompts]
    oracle = Oracle({tuple(i): c.token_ids for i, c in zip(ids, plain)})
    monkeypatch.setattr(speculative, "create_proposer", lambda cfg, engine: oracle)
    with LLM(**llm_kw, speculative_algorithm="ngram", speculative_num_draft_tokens=k) as llm:
        spec = llm.generate(prompts, params)
        llm.client.check_pages()
        stats = llm.client.stats()
    assert oracle.released == len(prompts)
    return plain, spec, stats


def _same(plain, spec) -> None:
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.text for c in spec] == [c.text for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
    for a, b in zip(spec, plain):  # logprobs: the same up to log_softmax's rounding at another row count
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.token_id == y.token_id and math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
            assert [t.token_id for t in x.top] == [t.token_id for t in y.top]


@pytest.mark.slow
def test_greedy_and_seeded_sampling_with_drafts_equal_plain_decode_in_the_default_mode(monkeypatch):
    """The int4 default: greedy rows, and sampled rows with a seed, penalties and a logit bias, draw the same tokens
    (a verify row is a decode row: same kernels, same attention, same uniform at its position)."""
    params = [
        SamplingParams(max_new_tokens=24, ignore_eos=True),
        SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=5, presence_penalty=0.5, logprobs=True,
                       top_logprobs=2),
        SamplingParams(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=3, logit_bias={11: 3.0}),
    ]
    plain, spec, stats = _with_oracle(monkeypatch, {}, CHATS, params)
    _same(plain, spec)
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # some drafts kept, some rejected
    assert stats.decode_tokens == sum(len(c.token_ids) - 1 for c in spec)
    assert stats.steps < sum(len(c.token_ids) for c in spec) // len(CHATS)  # fewer steps than tokens per request


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 5])
def test_exact_mode_greedy_with_stop_strings_max_tokens_logprobs_and_grammar(monkeypatch, k):
    """--deterministic fp32: stop strings and max_tokens cut inside an accepted run, logprobs at every position, a JSON
    schema's mask on every verify row (drafts it refuses are trimmed)."""
    schema = json.dumps({"type": "object", "required": ["city", "population"],
                         "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}})
    chats = [[{"role": "user", "content": p}] for p in (
        "What is the capital of France?", "Write a haiku about the sea.", "Give the capital of France as JSON.",
        "List three prime numbers.")]
    params = [
        SamplingParams(max_new_tokens=24, stop=["."]),
        SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=True, top_logprobs=3),
        SamplingParams(max_new_tokens=24, json_schema=schema),
        SamplingParams(max_new_tokens=24, stop=[" and", "\n"], ignore_eos=True),
    ]
    plain, spec, stats = _with_oracle(monkeypatch, EXACT, chats, params, k=k)
    _same(plain, spec)
    assert plain[0].finish_reason == "stop" and "." not in plain[0].text
    assert len(plain[1].token_ids) == 7
    assert plain[2].text.startswith('{"city": "')
    assert stats.spec_accepted_tokens > 0


@pytest.mark.slow
def test_overlap_scheduling_with_drafts_and_aborts_leaves_no_page_held(monkeypatch, tiny_model_dirs):
    """Overlap on (forced on the CPU): verify steps run non-overlapped, plain steps around them overlapped; 24
    concurrent requests, a third aborted midway, give the plain answers and leave every page accounted for."""
    from test_scheduler import run_concurrently, settle, workload

    work = workload(24, seed=3)
    kw = dict(model=str(tiny_model_dirs["llama"]), overlap_on_cpu=True, max_running_requests=8)
    with LLM(**kw) as llm:
        alone = asyncio.run(run_concurrently(llm, work))
    oracle = Oracle({tuple(ids): out for (ids, _), out in zip(work, alone)}, spoil=2)
    monkeypatch.setattr(speculative, "create_proposer", lambda cfg, engine: oracle)
    with LLM(**kw, speculative_algorithm="ngram", speculative_num_draft_tokens=3) as llm:
        got = asyncio.run(run_concurrently(llm, work, abort_every=3))
        settle(llm)
        stats = llm.client.stats()
    assert sum(g is None for g in got) == 8
    assert all(g == a for g, a in zip(got, alone) if g is not None)
    assert stats.spec_accepted_tokens > 0 and stats.tokens_in_use == 0


def test_a_verify_step_draws_from_the_target_distribution():
    """The acceptance rule on a synthetic distribution (8 tokens): a row whose draft d has p(d) = 0.3 keeps it with
    probability 0.3, and the token it outputs is distributed as p (chi-square over 20,000 seeded rows), the rejected
    ones as p without d, renormalised."""
    vocab, n = 8, 20_000
    p = torch.tensor([0.05, 0.3, 0.15, 0.1, 0.2, 0.05, 0.1, 0.05])
    draft = 1
    state = SamplingState(n, vocab, torch.device("cpu"), HostBuffers())
    for slot in range(n):
        state.admit(slot, SamplingParams(temperature=1.0, seed=slot), [3], [])
    slots = list(range(n))
    # Each request: rows [x, d]: row 0 draws the token d stands for, row 1 the one after (unused here).
    rows = state.batch([s for s in slots for _ in (0, 1)], torch.tensor([s for s in slots for _ in (0, 1)]),
                       torch.tensor([1, 2] * n), [True] * 2 * n, drafts=[[draft]] * n)
    logits = p.log().repeat(2 * n, 1)
    drawn = sample(logits, rows, state, create_sampler(torch.device("cpu"), vocab)).next_ids.view(n, 2)[:, 0]
    kept = torch.tensor([accepted_run([draft], [t]) for t in drawn.tolist()])
    assert abs(kept.float().mean().item() - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)
    out = torch.bincount(drawn, minlength=vocab).float()
    chi2 = ((out - n * p) ** 2 / (n * p)).sum().item()
    assert chi2 < 24.3  # 7 degrees of freedom, p = 0.001
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()
    rejected = drawn[kept == 0]
    got = torch.bincount(rejected, minlength=vocab).float()
    expected = rejected.numel() * residual
    mask = expected > 0
    assert got[draft] == 0
    assert ((got[mask] - expected[mask]) ** 2 / expected[mask]).sum().item() < 22.5  # 6 degrees of freedom


def test_draft_budget_grows_with_acceptance_and_backs_off_when_nothing_is_accepted():
    b = DraftBudget(4)
    assert b.wants(0) == 4
    b.update(4, 2, 4, outputs=3)
    assert b.wants(3) == 2
    b.update(2, 2, 4, outputs=6)
    assert b.wants(6) == 3
    b.update(3, 0, 4, outputs=7)  # nothing accepted: none next step, a probe of one after it
    assert b.wants(7) == 0 and b.wants(8) == 1
    b.update(1, 0, 4, outputs=9)  # the probe failed: wait twice as long
    assert [b.wants(o) for o in (9, 10, 11)] == [0, 0, 1]
    for o in range(12, 200, 2):
        b.update(1, 0, 4, outputs=o)
    assert b.resume_at - 198 == speculative.MAX_WAIT
    b.update(1, 1, 4, outputs=300)
    assert b.wants(300) == 2
