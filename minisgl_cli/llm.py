"""LLM: the synchronous Python API — `LLM(model=...).generate(prompts or chats, params)`."""

from __future__ import annotations

import asyncio
from dataclasses import fields, replace
from typing import cast

from minisgl_cli.backends import in_process_client
from minisgl_cli.client.protocol import complete
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.scheduler.config import SchedulerConfig
from minisgl_cli.types import Completion, GenerateRequest, SamplingParams

LLMInput = str | list[int] | list[dict]  # one prompt: text, token ids or a chat


class LLM:
    """Offline generation over the same client the servers use. Extra keyword arguments go to
    EngineConfig or SchedulerConfig by name (e.g. attention_backend="torch", cache="naive", engine="hf").
    A Qwen2-VL / Qwen2.5-VL model takes chats whose parts hold images: {"type": "image", "image": <PIL image>}."""

    def __init__(self, model: str | None = None, **kwargs):
        names = {f.name for f in fields(SchedulerConfig)}
        sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in names})
        engine = EngineConfig(model=model, **{k: v for k, v in kwargs.items() if k not in names})
        self.client = in_process_client(engine, sched)  # engine="hf" / "mlx": those engines
        # The scheduler refuses requests past its queue bound: a larger batch is fed in as the queue drains.
        self.window = sched.max_queued_requests or None

    @staticmethod
    def _request(prompt: LLMInput, params: SamplingParams) -> GenerateRequest:
        if isinstance(prompt, str):
            return GenerateRequest(prompt=prompt, params=params)
        if prompt and isinstance(prompt[0], dict):
            return GenerateRequest(messages=prompt, params=params)
        return GenerateRequest(input_ids=list(cast(list[int], prompt)), params=params)  # no dict first: token ids

    def generate(
        self, prompts: LLMInput | list[LLMInput], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """One Completion per prompt, all run concurrently (continuous batching; past the scheduler's queue bound,
        max_queued_requests, the rest are submitted as earlier ones finish)."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict)))
        batch = cast(list[LLMInput], [prompts] if single else list(prompts))  # `single` told the two shapes apart
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)

        async def run() -> list[Completion]:
            # The whole text is all a Completion holds: decoded once per request at its end, not per token.
            reqs = [self._request(p, replace(sp, stream_text=False)) for p, sp in zip(batch, plist)]
            window = asyncio.Semaphore(self.window or len(reqs) or 1)

            async def one(r: GenerateRequest) -> Completion:
                async with window:
                    return await complete(self.client, r)

            return list(await asyncio.gather(*(one(r) for r in reqs)))

        return asyncio.run(run())

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
