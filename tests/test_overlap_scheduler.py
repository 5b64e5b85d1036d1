"""Overlap scheduling (next step launched before the last one's tokens are read) gives the same greedy
tokens as the plain loop -- with chunking, aborts, retraction and a too-small pool -- and leaks no page.

Overlap is a CUDA feature; `overlap_on_cpu` runs the same machinery on the CPU to check its logic.
"""

from __future__ import annotations

import asyncio

import pytest

from minisgl_cli import LLM, SamplingParams
from tests.test_scheduler import run_concurrently, settle, workload


@pytest.fixture(scope="module")
def alone(tiny_model_dirs):
    work = workload(24)
    with LLM(str(tiny_model_dirs["llama"]), cache="naive") as llm:
        return [llm.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids for ids, n in work]


@pytest.mark.parametrize("kw", [
    {},
    {"max_prefill_tokens": 16},
    {"policy": "decode-first"},
    {"max_total_tokens": 300, "page_size": 4},
    {"max_total_tokens": 300, "page_size": 1, "max_running_requests": 8},
])
def test_overlap_matches_running_alone(tiny_model_dirs, alone, kw):
    with LLM(str(tiny_model_dirs["llama"]), overlap_on_cpu=True, **kw) as llm:
        assert llm.client.info.overlap
        got = asyncio.run(run_concurrently(llm, workload(24), abort_every=7))
        settle(llm)
    assert [g for g in got if g is not None] == [r for g, r in zip(got, alone) if g is not None]
    assert sum(g is None for g in got) == 4  # i % 7 == 1


def test_overlap_stops_exactly_at_max_new_tokens_and_eos(tiny_model_dirs):
    with LLM(str(tiny_model_dirs["llama"]), overlap_on_cpu=True) as llm:
        ref = llm.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
        for n in (1, 2, 5):
            out = llm.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
            assert out.token_ids == ref[:n] and out.finish_reason == "length"
        stop = ref[3]
        out = llm.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))[0]
        assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
        settle(llm)


def test_disable_overlap_flag_and_env(tiny_model_dirs, monkeypatch):
    with LLM(str(tiny_model_dirs["llama"]), overlap_on_cpu=True, disable_overlap=True) as llm:
        assert not llm.client.info.overlap
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "1")
    with LLM(str(tiny_model_dirs["llama"]), overlap_on_cpu=True) as llm:
        assert not llm.client.info.overlap


def test_penalties_see_every_token_under_overlap(tiny_model_dirs):
    """A penalized request must not sample before its previous token is counted: same tokens as the plain loop."""
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15]]
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=1.5),
              SamplingParams(max_new_tokens=20, ignore_eos=True, presence_penalty=2.0),
              SamplingParams(max_new_tokens=16, ignore_eos=True)]
    outs = []
    for overlap in (False, True):
        with LLM(str(tiny_model_dirs["llama"]), overlap_on_cpu=overlap) as llm:
            assert llm.client.info.overlap == overlap
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
            settle(llm)
    assert outs[0] == outs[1]
    assert len(set(outs[0][0])) > 3  # the penalty really changed the greedy path (no single repeated token)
