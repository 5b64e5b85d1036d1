"""Failure injection for tests: make chosen steps of a live engine raise, as an OOM or a kernel fault caught and
reported would, and run requests through a client collecting what each one got."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.types import ErrorCode, GenerateRequest, SamplingParams


class InjectedFault(RuntimeError):
    """What an injected failure raises."""


def is_verify(fb: ForwardBatch) -> bool:
    """A decode step with more rows than requests: speculative decoding's verify step."""
    return fb.is_decode and fb.num_tokens > len(set(fb.req_rows.tolist()))


@dataclass
class StepFaults:
    """Patches `engine.forward` (every step runs it once: `step` is forward then sample) so that a step for which
    `when(fb)` holds raises `InjectedFault`: before the device runs it (`after_forward=False`: its KV never written),
    or after the forward wrote its KV, before sampling (`after_forward=True`: a sampler failing). `limit` caps them."""

    engine: Any
    when: Callable[[ForwardBatch], bool]
    after_forward: bool = False
    limit: int = 1 << 30
    raised: int = 0
    steps: list[str] = field(default_factory=list)  # each step's kind as it came, "!" marking the faulted ones

    def __enter__(self) -> StepFaults:
        real = self.engine.forward

        def forward(fb: ForwardBatch):
            kind = "verify" if is_verify(fb) else fb.mode
            fire = self.raised < self.limit and self.when(fb)
            self.steps.append(kind + ("!" if fire else ""))
            if not fire:
                return real(fb)
            self.raised += 1
            if self.after_forward:
                real(fb)
                raise InjectedFault(f"injected: a {kind} step failed after its forward")
            raise InjectedFault(f"injected: a {kind} step raised before the device ran it")

        self.engine.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.forward  # the class's method again


def every_nth(n: int, mode: str | None = None) -> Callable[[ForwardBatch], bool]:
    """The n-th step (1-based) of `mode` ("prefill", "decode", "verify"; None: any)."""
    seen = [0]

    def when(fb: ForwardBatch) -> bool:
        kind = "verify" if is_verify(fb) else fb.mode
        if mode is None or kind == mode:
            seen[0] += 1
            return seen[0] == n
        return False

    return when


def at_random(p: float, seed: int) -> Callable[[ForwardBatch], bool]:
    rng = random.Random(seed)
    return lambda fb: rng.random() < p


@dataclass
class Outcome:
    token_ids: list[int]
    error_code: ErrorCode | None = None

    @property
    def failed(self) -> bool:
        return self.error_code is not None


async def run_all(client, work: list[tuple[list[int], SamplingParams]]) -> list[Outcome]:
    """Every (prompt ids, params) at once through `client`: what each got, and its error code if it failed."""
    async def one(ids: list[int], params: SamplingParams) -> Outcome:
        out = Outcome([])
        async for d in client.submit(GenerateRequest(input_ids=ids, params=params)):
            out.token_ids += d.token_ids
            if d.error is not None:
                out.error_code = d.error_code or ErrorCode.ENGINE_FAILED
        return out

    return list(await asyncio.gather(*(one(ids, p) for ids, p in work)))


def run(client, ids: list[int], params: SamplingParams) -> Outcome:
    return asyncio.run(run_all(client, [(ids, params)]))[0]
