"""EngineClient: the one engine API every front uses — submit(request) -> async stream of Deltas.

The protocol alone, with what it hands out: model info, submit / abort, tokenize (off the caller's event loop),
cache warming, stats, page check, health. Fronts see nothing else: not the engine, not the scheduler. This module
imports no engine and no torch, so a front (or the API process) gets the interface without loading a model.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from minisgl_cli.types import (
    Completion,
    Delta,
    ErrorCode,
    GenerateRequest,
    ModelInfo,
    Prompt,
    SchedulerStats,
    TokenLogprob,
)

STALL_S = 30.0  # a scheduler loop silent this long is reported unhealthy (a step never takes that long)
ENGINE_GONE = "the engine is gone"  # how the error of a request whose engine died begins


class EngineGone(RuntimeError):
    """The engine died (or every replica did): nothing can run the request."""

    code = ErrorCode.UNAVAILABLE

    def __init__(self, reason: str):
        super().__init__(f"{ENGINE_GONE}: {reason}")


@dataclass
class PrefixWarm:
    """A prefix being prefilled into the radix cache: its length, and an event set once it is cached."""

    tokens: int
    done: threading.Event = field(default_factory=threading.Event)

    def wait(self, timeout: float | None = None) -> bool:
        return self.done.wait(timeout)


class EngineClient(Protocol):
    info: ModelInfo

    def submit(self, req: GenerateRequest) -> AsyncGenerator[Delta, None]:
        """Stream a request's output; closing the stream early aborts the request (its KV is freed)."""
        ...

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (chat template applied), computed off the event loop."""
        ...

    async def prompt(self, req: GenerateRequest) -> Prompt:
        """The prompt as the engine takes it, admitted where its ids are first known (AdmissionError where it cannot
        run): its ids (or their number, where a tokenizer worker keeps them) and, for a model that takes images
        (`info.images`), the images of its messages (ValueError for images a model does not take). A request made
        with it (`GenerateRequest(tokenized=...)`) runs it as it is."""
        ...

    def abort(self, rid: str) -> None: ...

    def insert_prefix(self, prefix: str | list[int]) -> PrefixWarm:
        """Prefill a prefix into the radix cache in the background."""
        ...

    def stats(self, timeout: float = 10.0) -> SchedulerStats: ...

    def check_pages(self, timeout: float = 10.0) -> None:
        """Raise AssertionError unless free + cached + in-use KV pages add up to the pool."""
        ...

    def healthy(self) -> bool:
        """The scheduler is alive and its loop is coming round."""
        ...

    def failure(self) -> str | None:
        """Why the engine is gone for good (a dead process or thread), in one line; None while it runs."""
        ...

    def close(self) -> None: ...


async def complete(client: EngineClient, req: GenerateRequest) -> Completion:
    """Run a request to the end and return the whole result (ValueError on an engine error)."""
    parts: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] | None = [] if req.params.wants_logprobs else None
    final: Delta | None = None
    async for d in client.submit(req):
        if d.error:
            raise ValueError(d.error)
        parts.append(d.text)
        ids.extend(d.token_ids)
        if logprobs is not None and d.logprobs:
            logprobs.extend(d.logprobs)
        final = d
    assert final is not None and final.stats is not None
    return Completion(req.rid, "".join(parts), ids, final.finish_reason, final.stats, logprobs)
