"""Logprobs and grammar masks on the GPU: through the CUDA-graph decode path and overlap scheduling, the same
tokens and logprobs as eager decoding without overlap; grammars hold under overlap. Skipped without CUDA."""

from __future__ import annotations

import json
import re

import pytest
import torch

from minisgl_cli import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["answer", "n"], "additionalProperties": False}


def _prompts(n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 30000, (8 + 5 * i,), generator=g).tolist() for i in range(n)]


def _logprob_params() -> list[SamplingParams]:
    return [
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=5),
        SamplingParams(max_new_tokens=12, ignore_eos=True),  # no logprobs in the same batch
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, temperature=0.8, seed=3),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2, presence_penalty=0.5,
                       logit_bias={5: 2.0}),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True, top_k=20, top_p=0.9, temperature=0.7,
                       seed=4),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True),
    ]


def _run(**kw):
    with LLM("qwen3-0.6b", load_format="dummy", max_total_tokens=16384, **kw) as llm:
        out = llm.generate(_prompts(), _logprob_params())
        llm.client.check_pages()
    return out


def test_logprobs_through_cuda_graphs_and_overlap_match_eager():
    graphs = _run()  # CUDA graphs for decode, overlap scheduling: the defaults on CUDA
    eager = _run(disable_cuda_graph=True, disable_overlap=True)
    for g, e, p in zip(graphs, eager, _logprob_params()):
        if p.greedy:
            assert g.token_ids == e.token_ids
        if e.logprobs is None:
            assert g.logprobs is None
            continue
        assert len(g.logprobs) == len(g.token_ids)
        assert [t.token_id for t in g.logprobs] == g.token_ids
        # A sampled row may part ways once bf16 noise tips a draw: compare up to there.
        n = next((i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), len(g.token_ids))
        assert n > 0
        got = torch.tensor([t.logprob for t in g.logprobs[:n]])
        want = torch.tensor([t.logprob for t in e.logprobs[:n]])
        assert torch.allclose(got, want, atol=2e-2), (got, want)  # bf16 logits: graph and eager kernels differ
    greedy = graphs[0].logprobs
    assert all(t.top[0].token_id == t.token_id and len(t.top) == 5 for t in greedy)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random Qwen2 with the default model's tokenizer (grammars need one)."""
    from conftest import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2", tokenizer_dir)


def test_grammars_hold_under_graphs_and_overlap(tiny_dir):
    pytest.importorskip("xgrammar")
    params = [SamplingParams(max_new_tokens=24, json_schema=json.dumps(ANSWER), logprobs=True, top_logprobs=3),
              SamplingParams(max_new_tokens=16, regex=r"(yes|no), [a-c]{1,5}\.", temperature=0.9, seed=7),
              SamplingParams(max_new_tokens=24, json_schema=json.dumps(ANSWER), frequency_penalty=0.5),
              SamplingParams(max_new_tokens=8)]
    runs = []
    for kw in ({}, {"disable_cuda_graph": True, "disable_overlap": True}):
        # A KV pool of what the test needs, not 85% of the GPU: the two engines overlap while the second builds.
        with LLM(str(tiny_dir), max_total_tokens=16384, **kw) as llm:
            runs.append(llm.generate([[{"role": "user", "content": "yes or no?"}]] * len(params), params))
            llm.client.check_pages()
    fast, slow = runs
    for out in (fast[0], fast[2]):
        assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"answer", "n"}
    assert re.fullmatch(r"(yes|no), [a-c]{1,5}\.", fast[1].text)
    assert fast[0].logprobs is not None and all(t.top[0].token_id == t.token_id for t in fast[0].logprobs)
    # Masked logits leave greedy choices alone up to bf16 noise: the constrained greedy outputs agree.
    assert fast[0].text == slow[0].text and fast[2].text == slow[2].text
