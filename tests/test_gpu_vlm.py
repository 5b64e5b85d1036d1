"""Qwen2-VL / Qwen2.5-VL on CUDA (tiny random models): the fused Triton RoPE taking M-RoPE's per-token tables,
the Triton attention, and decode through CUDA graphs reading each row's M-RoPE delta. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_vlm_engine import CHATS, N, hf_greedy

from minisgl_cli import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _greedy(model_dir, **kw) -> list[list[int]]:
    with LLM(str(model_dir), device="cuda", quantization="none", **kw) as llm:
        res = llm.generate(CHATS, SamplingParams(max_new_tokens=N, ignore_eos=True))
        llm.client.check_pages()
    return [r.token_ids for r in res]


@pytest.mark.parametrize("name", ["qwen2-vl", "qwen2.5-vl"])
def test_cuda_fp32_equals_hf_and_graph_decode_equals_eager(tiny_vlms, name):
    theirs = hf_greedy(tiny_vlms[name], CHATS)  # HF fp32 on the CPU: the reference
    assert _greedy(tiny_vlms[name], dtype="float32") == theirs
    # bf16: the decode graphs (each row's delta read through the static page-table rows) give the eager tokens.
    assert _greedy(tiny_vlms[name], dtype="bfloat16") == _greedy(tiny_vlms[name], dtype="bfloat16",
                                                                  disable_cuda_graph=True)
