"""A greedy answer does not depend on what is cached or batched beside it, in the default CPU mode (the bundled
GGUF's int4 weights, bf16 activations where the CPU has AVX-512 BF16): the parity prompts answered cold, with their
prompts cached, and inside a batch of 16 other requests give the same tokens (issue 27)."""

from __future__ import annotations

import functools

import pytest
import torch
from test_hf_parity import PROMPTS

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.layers import cpu_gemm, quant
from minisgl_cli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import RowParallelLinear
from minisgl_cli.layers.moe import MoE

CHATS = [[{"role": "user", "content": p}] for p in PROMPTS]
ANSWER = SamplingParams(max_new_tokens=32, ignore_eos=True)
# Other requests of other lengths, decoding beside the parity prompts from their prefill to their last token.
OTHERS = [[{"role": "user", "content": f"Count from {i} to {4 * i} in words, then say why {i} is {kind}."}]
          for i, kind in zip(range(1, 17), ["odd", "even"] * 8)]
BESIDE = SamplingParams(max_new_tokens=48, ignore_eos=True)


def test_parity_prompts_answer_alike_cold_cached_and_in_a_batch_of_16():
    with LLM(cache="naive", attention_backend="torch") as llm:
        assert llm.client.info.quantization == "int4"
        cold = [llm.generate(chat, ANSWER)[0] for chat in CHATS]  # one at a time, nothing reused
    with LLM(attention_backend="torch") as llm:
        batch = llm.generate(CHATS + OTHERS, [ANSWER] * len(CHATS) + [BESIDE] * len(OTHERS))[: len(CHATS)]
        cached = [llm.generate(chat, ANSWER)[0] for chat in CHATS]  # all but the last prompt token cached
        llm.client.check_pages()
    assert all(c.stats.cached_tokens == c.stats.prompt_tokens - 1 for c in cached)
    cold_ids = [c.token_ids for c in cold]
    assert [c.token_ids for c in cached] == cold_ids
    assert [c.token_ids for c in batch] == cold_ids


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_moe_model_in_int4_answers_alike_cold_cached_and_in_a_batch(tiny_moe_dirs, arch):
    """The same for a MoE model in the int4 mode: its router and dense experts (extend) run the dense linears' GEMMs,
    its decode rows the experts' int4 copies, each a row's result whatever the rows beside it."""
    model = str(tiny_moe_dirs[arch])
    with LLM(model, quantization="int4", cache="naive", attention_backend="torch") as llm:
        cold = [llm.generate(chat, ANSWER)[0] for chat in CHATS]
    with LLM(model, quantization="int4", attention_backend="torch") as llm:
        batch = llm.generate(CHATS + OTHERS, [ANSWER] * len(CHATS) + [BESIDE] * len(OTHERS))[: len(CHATS)]
        cached = [llm.generate(chat, ANSWER)[0] for chat in CHATS]
        llm.client.check_pages()
    assert all(c.stats.cached_tokens == c.stats.prompt_tokens - 1 for c in cached)
    cold_ids = [c.token_ids for c in cold]
    assert len(set(map(tuple, cold_ids))) > 1  # the prompts get answers of their own
    assert [c.token_ids for c in cached] == cold_ids
    assert [c.token_ids for c in batch] == cold_ids


def _rows_alike(f, x: torch.Tensor) -> bool:
    """f gives each row of x the same result alone as among all of x's rows."""
    whole = f(x)
    return all(torch.equal(f(x[i : i + 1]), whole[i : i + 1]) for i in (0, x.shape[0] - 1))


def test_each_kernel_gives_a_row_the_same_result_whatever_the_rows_beside_it():
    """The kernels a step's rows go through in the default CPU mode, alone and in a batch of 17 rows: the int4 and
    int8 decode kernels, the dense GEMM of prefill steps (oneDNN's one-row kernel rounds otherwise: run as two), and
    the int8 LM head (fbgemm quantizes its input with one scale: anchors fix it), and a MoE block's router and
    experts."""
    torch.manual_seed(0)
    dtype = cpu_gemm._BF16_NATIVE or torch.float32  # the engine's beside quantized weights
    kernels = Kernels(cpu_gemm=cpu_gemm.for_quantized("auto"))  # as the engine's in those modes
    x = torch.randn(17, 1536).to(dtype)
    for method in (quant.Int4Method(), quant.Int8Method()):
        torch.set_default_dtype(dtype)  # as the engine builds its model
        try:
            down = RowParallelLinear(1536, 576, method=method, kernels=kernels)  # K = 1536: oneDNN's one row differs
        finally:
            torch.set_default_dtype(torch.float32)
        down.load_shard("weight", torch.randn(576, 1536) * 0.05)
        down.finish_loading()
        assert _rows_alike(functools.partial(down, decode=True), x), method.name
        assert _rows_alike(down, x), f"{method.name} dense"
    embed = VocabParallelEmbedding(4096, 576)
    head = ParallelLMHead(4096, 576, kernels=kernels, method=quant.Int4Method().for_lm_head(), tied=embed)
    embed.load_shard("weight", torch.randn(4096, 576))
    head.finish_loading()
    assert _rows_alike(head.logits, torch.randn(17, 576))
    fp32 = torch.randn(17, 1536)
    w = torch.randn(576, 1536) * 0.05
    assert _rows_alike(lambda r: cpu_gemm.linear(r, w, None, kernels.cpu_gemm), fp32)
    # A MoE block in the int4 mode: router and dense experts (extend), the experts' int4 copies (decode)
    torch.set_default_dtype(dtype)
    try:
        block = MoE(8, 2, 1536, 256, True, TPInfo(), kernels, copies=quant.Int4Method())
    finally:
        torch.set_default_dtype(torch.float32)
    for p in block.parameters():
        p.data.normal_(0, 0.05)
    block.experts.finish_loading()
    assert _rows_alike(functools.partial(block, decode=False), x) and _rows_alike(block.gate, x)
    assert _rows_alike(functools.partial(block, decode=True), x)


def test_deterministic_decodes_eagerly_with_one_fp32_gemm_kernel_and_refuses_a_compile():
    cfg = EngineConfig(device="cpu", deterministic=True, torch_compile="auto", compile_in_process=True)
    assert cfg.cpu_gemm == "invariant"
    assert cfg.decode_step("int4", torch.bfloat16, tp_size=1, own_process=True) == "off"
    with pytest.raises(ValueError, match="--torch-compile on"):
        EngineConfig(device="cpu", deterministic=True, torch_compile="on")
    with pytest.raises(ValueError, match="MINISGL_CPU_GEMM"):
        EngineConfig(device="cpu", deterministic=True, cpu_gemm="fp16")
