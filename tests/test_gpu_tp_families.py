"""The new families at TP 2 on two GPUs (NCCL): greedy ids equal transformers fp32 -- and so TP 1 -- for MLA
(DeepSeek-V3), a Gated DeltaNet hybrid (Qwen3.5), sliding windows with sinks and MoE (gpt-oss) and Gemma 3's
local / global layers, cold and cached (examples/two_gpu.sh runs it on a two-GPU machine)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_checkpoint
from test_deepseek import make_tiny_deepseek
from test_hf_parity import EXACT, hf_greedy
from test_hybrid import make_hybrid
from test_sliding_window import WINDOW

from minisgl_cli import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
N_NEW = 16


def _prompts() -> list[list[int]]:
    """Short prompts, one past several prefill chunks and past the window."""
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (1, 7, 19, 45)]


def _build(family: str, root, tokenizer_dir):
    if family == "deepseek_v3":
        return make_tiny_deepseek("v3", root / family, tokenizer_dir)
    if family == "qwen3_5":
        return make_hybrid("qwen3_5", root / family, tokenizer_dir)
    if family == "gemma3":
        return make_tiny_checkpoint("gemma3", root / family, tokenizer_dir, sliding_window=WINDOW,
                                    num_hidden_layers=6, query_pre_attn_scalar=24)
    return make_tiny_checkpoint("gpt_oss", root / family, tokenizer_dir, sliding_window=WINDOW, num_hidden_layers=4,
                                num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, swiglu_limit=1.5)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5", "gpt_oss", "gemma3"])
def test_new_families_at_tp_2_answer_as_transformers(tmp_path_factory, tokenizer_dir, monkeypatch, family):
    model_dir = _build(family, tmp_path_factory.mktemp(family), tokenizer_dir)
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=N_NEW, ignore_eos=True)] * len(prompts)
    with LLM(str(model_dir), device="cuda", tp_size=2, max_prefill_tokens=12, **EXACT) as llm:
        cold = [r.token_ids for r in llm.generate(prompts, params)]
        cached = [r.token_ids for r in llm.generate(prompts, params)]
    # The reference runs on the CPU in fp32; where fla-core imports, transformers would take its Triton kernels for
    # Qwen3.5's gated delta rule, CPU tensors included (not exact): its torch path is the one it takes when exporting.
    monkeypatch.setattr("transformers.integrations.hub_kernels.is_torchdynamo_exporting", lambda: True)
    assert cold == cached == hf_greedy(model_dir, prompts, N_NEW)
