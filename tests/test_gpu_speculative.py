"""Speculative decoding on the GPU: verify steps through the CUDA-graph decode path (captured up to k + 1 rows a
request), with overlap scheduling around them, give the plain answers and leave no page held. Skipped without CUDA."""

from __future__ import annotations

import asyncio

import pytest
import torch
from conftest import needs_default_model
from test_speculative import Oracle

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.scheduler import speculative

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_oracle_drafts_through_cuda_graphs_and_overlap_give_the_plain_tokens(tiny_model_dirs, monkeypatch):
    """fp32 on the GPU (the kernels pick their arithmetic by batch size, so bf16 near-ties could flip; the tiny
    model's logits are far apart in fp32): greedy and seeded sampled rows, 16 concurrent requests."""
    from test_scheduler import run_concurrently, workload

    work = workload(16, seed=5)
    kw = dict(model=str(tiny_model_dirs["llama"]), dtype="float32", max_running_requests=16)
    with LLM(**kw) as llm:
        assert llm.client.info.overlap
        alone = asyncio.run(run_concurrently(llm, work))
    oracle = Oracle({tuple(ids): out for (ids, _), out in zip(work, alone)}, spoil=2)
    monkeypatch.setattr(speculative, "create_proposer", lambda cfg, engine: oracle)
    with LLM(**kw, speculative_algorithm="ngram", num_speculative_tokens=4) as llm:
        got = asyncio.run(run_concurrently(llm, work))
        llm.client.check_pages()
        stats = llm.client.stats()
    assert got == alone
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_ngram_on_real_weights_accepts_a_copied_paragraph():
    """The default model (its GGUF's weights, bf16 on the GPU) copying a paragraph: drafts are accepted, pages kept
    exact."""
    from test_speculative import LOOKUP

    needs_default_model()  # the GPU machines lack the GGUF package (too big to carry)
    with LLM(speculative_algorithm="ngram") as llm:
        out = llm.generate(LOOKUP[0][0], SamplingParams(max_new_tokens=48, ignore_eos=True))[0]
        llm.client.check_pages()
    assert out.stats.accept_length > 1.5
