"""On CUDA an out-of-vocabulary token id that reached the device would be a device-side assert, after which the
engine (its CUDA context) serves nothing more. Admission refuses it first, in the client (where the ids are first known;
the scheduler trusts our clients), so the request gets a clear error and the next one runs as before (issue 27).
Skipped without CUDA; tests/test_isolation.py runs the same refusals on the CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = [1, 2, 3, 4, 5]


def refused_before_the_device(device: str) -> None:
    """The check itself, on `device`: each way an id can be out of range, through LLM.generate, as the client refuses
    it; the engine answers alike after."""
    from minisgl_cli import LLM
    from minisgl_cli.types import SamplingParams

    greedy = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with LLM("qwen3-0.6b", load_format="dummy", device=device, max_total_tokens=4096) as llm:
        vocab = llm.client.info.vocab_size
        before = llm.generate(PROMPT, greedy)[0].token_ids
        bad = [([1, vocab + 5], greedy, vocab + 5),
               (PROMPT, SamplingParams(max_new_tokens=4, stop_token_ids=[vocab]), vocab),
               (PROMPT, SamplingParams(max_new_tokens=4, logit_bias={vocab + 1: 5.0}), vocab + 1),
               ([-1, 2], greedy, -1)]
        for prompt, params, token in bad:
            with pytest.raises(ValueError, match=f"token id {token} in .* is out of range"):
                llm.generate(prompt, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()  # a device-side assert would surface here
        assert llm.generate(PROMPT, greedy)[0].token_ids == before
        llm.client.check_pages()


def test_an_out_of_vocabulary_id_never_reaches_the_gpu_and_the_engine_goes_on():
    refused_before_the_device("cuda")


def test_a_kv_pool_larger_than_the_gpu_is_refused_in_one_line():
    """--max-total-tokens past the memory the weights leave: a one-line error naming both sizes, not CUDA's OOM."""
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine

    with pytest.raises(ValueError, match=r"--max-total-tokens 100,000,000 needs a .* GiB KV pool and .* GiB of cuda"):
        Engine(EngineConfig(model="qwen3-0.6b", load_format="dummy", max_total_tokens=100_000_000))
    torch.cuda.empty_cache()
