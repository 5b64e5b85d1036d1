"""Greedy token ids equal HF transformers fp32 on the same weights: SmolLM2 and tiny Llama/Qwen2/Qwen3 and
Qwen3-MoE/Mixtral.

Our side runs the exact mode, pinned (`--dtype float32 --quantization none`): on CPU the default model
otherwise runs its GGUF's 4-bit weights (tests/test_quant.py checks that mode's quality)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from minisgl_cli import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Zürich, Kraków and 東京 are cities. Name one more:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


def hf_greedy(model_dir, prompt_ids: list[list[int]], n: int, **options) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0, min_new_tokens=n, **options)
            out.append(gen[0, len(ids):].tolist())
    return out


EXACT = dict(dtype="float32", quantization="none")  # the mode that equals HF fp32 token for token


def ours_greedy(model_dir, prompt_ids: list[list[int]], n: int, repetition_penalty: float = 1.0,
                **kw) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, repetition_penalty=repetition_penalty)
    with LLM(str(model_dir), attention_backend="torch", **EXACT, **kw) as llm:
        res = llm.generate(prompt_ids, [params] * len(prompt_ids))
        llm.client.check_pages()
    return [r.token_ids for r in res]


def cold_and_cached(model_dir, prompts: list[list[int]], n: int, backend: str = "torch",
                    **kw) -> tuple[list[list[int]], list[list[int]]]:
    """(cold, cached): every prompt's `n` greedy tokens in the exact mode, then all of them again (now each prompt's
    KV comes from the radix cache); `max_prefill_tokens` 12 cuts long prompts into chunks."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    with LLM(str(model_dir), attention_backend=backend, max_prefill_tokens=12, **EXACT, **kw) as llm:
        cold = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        cached = [r.token_ids for r in llm.generate(prompts, [params] * len(prompts))]
        llm.client.check_pages()
    return cold, cached


def test_smollm2_greedy_matches_hf_fp32(default_model_dir):
    from minisgl_cli.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    assert ours_greedy(default_model_dir, ids, 32) == hf_greedy(default_model_dir, ids, 32)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_tiny_models_greedy_match_hf(tiny_model_dirs, tiny_moe_dirs, arch):
    model_dir = {**tiny_model_dirs, **tiny_moe_dirs}[arch]
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 33, 64)]
    theirs = hf_greedy(model_dir, ids, 24)
    assert len({tuple(t) for t in theirs}) > 1, "degenerate tiny model: outputs do not depend on the prompt"
    assert ours_greedy(model_dir, ids, 24) == theirs


def test_repetition_penalty_matches_hf(tiny_model_dirs):
    """HF's repetition penalty (over prompt and output; positive logits divided, negative multiplied), token for
    token, with the requests batched together on our side (each row its own seen-token set)."""
    model_dir = tiny_model_dirs["qwen2"]
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 33)]
    theirs = hf_greedy(model_dir, ids, 24, repetition_penalty=1.5)
    assert theirs != hf_greedy(model_dir, ids, 24), "the penalty changed nothing: the test could not tell"
    assert ours_greedy(model_dir, ids, 24, repetition_penalty=1.5) == theirs
