"""The multi-process runtime on the CPU: detokenizer, tokenizer workers and TP scheduler ranks (gloo) as
real child processes. TP 2 must give the same greedy tokens as one process."""

from __future__ import annotations

import asyncio

import pytest

from minisgl_cli.client import LocalClient, complete
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.runtime.launch import launch
from minisgl_cli.scheduler.scheduler import SchedulerConfig
from minisgl_cli.server.launch import free_port
from minisgl_cli.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

CHATS = [[{"role": "user", "content": q}] for q in
         ("What is the capital of France?", "Name three colors.", "Count from one to five.")]


def _greedy(client, n: int = 12) -> list[list[int]]:
    async def run():
        reqs = [GenerateRequest(messages=m, params=SamplingParams(max_new_tokens=n + i, ignore_eos=True))
                for i, m in enumerate(CHATS)]
        return await asyncio.gather(*(complete(client, r) for r in reqs))

    return [c.token_ids for c in asyncio.run(run())]


def _launch(model: str, tp: int, num_tokenizer: int = 0):
    rt = RuntimeConfig(tp_size=tp, dist_init_addr=f"127.0.0.1:{free_port()}", num_tokenizer=num_tokenizer)
    return launch(EngineConfig(model=model, max_total_tokens=2048), SchedulerConfig(), rt)


def _same_tokens_as_one_process(model: str, tp: int, num_tokenizer: int = 0) -> None:
    local = LocalClient(EngineConfig(model=model, max_total_tokens=2048))
    try:
        want = _greedy(local)
    finally:
        local.close()
    remote = _launch(model, tp, num_tokenizer)
    try:
        assert remote.info.tp_size == tp
        assert _greedy(remote) == want
        remote.check_pages()
    finally:
        remote.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_equals_one_process_on_tiny_models(tiny_model_dirs, arch):
    _same_tokens_as_one_process(str(tiny_model_dirs[arch]), tp=2)


def test_tp2_equals_one_process_on_the_default_model(default_model_dir):
    # SmolLM2 has 9 query / 3 KV heads: rank 0 takes 2 KV heads (6 query), rank 1 one (3).
    _same_tokens_as_one_process(str(default_model_dir), tp=2, num_tokenizer=2)
