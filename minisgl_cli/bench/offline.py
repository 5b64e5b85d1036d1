"""The engine target: requests through `EngineClient.submit` (the engine in this process or as processes:
runtime/start.py), at most `concurrency` in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from minisgl_cli.bench.metrics import RequestTiming
from minisgl_cli.bench.target import ClientClock, OnDone, RunOutput
from minisgl_cli.bench.workloads import BenchRequest, Case
from minisgl_cli.client.protocol import EngineClient
from minisgl_cli.types import GenerateRequest

COMPILE_WAIT_S = 900.0  # the longest a warm-up waits for the engine's CPU decode to compile


class EngineTarget:
    sequential = False

    def __init__(self, client: EngineClient, name: str = "minisgl", remote: bool = False):
        self.client = client
        self.name = name
        self.remote = remote  # the engine runs in other processes: this one's CPU is the client's alone

    async def _one(self, req: BenchRequest) -> RequestTiming:
        # The timings need the tokens as they come, the text only at the end: no per-token decode beside the engine.
        params = dataclasses.replace(req.sampling.params(req.max_new_tokens, req.ignore_eos), stream_text=False)
        timing = RequestTiming(prompt_tokens=req.prompt_tokens)
        parts: list[str] = []
        t0 = time.perf_counter()
        try:
            async for delta in self.client.submit(GenerateRequest(input_ids=req.input_ids, params=params)):
                now = time.perf_counter() - t0
                if delta.error:
                    timing.success, timing.error = False, delta.error
                    break
                if delta.token_ids:
                    if timing.ttft_s is None:
                        timing.ttft_s = now
                    timing.chunk_times_s.append(now)
                    timing.output_tokens += len(delta.token_ids)
                parts.append(delta.text)  # whole in the last delta (stream_text off), which may carry no token
                if delta.stats is not None and self.client.info.prefix_cache is not None:  # else n/a
                    timing.cached_tokens = delta.stats.cached_tokens
                if delta.stats is not None and self.client.info.speculative:
                    timing.drafted_tokens = delta.stats.drafted_tokens
        except Exception as exc:  # one failed request is a data point, not the end of the run
            timing.success, timing.error = False, f"{type(exc).__name__}: {exc}"
        timing.latency_s = time.perf_counter() - t0
        timing.text = "".join(parts)
        return timing

    async def _run(self, requests: list[BenchRequest], concurrency: int, on_done: OnDone) -> list[RequestTiming]:
        gate = asyncio.Semaphore(max(1, concurrency))

        async def limited(req: BenchRequest) -> RequestTiming:
            async with gate:  # the clock starts inside: time queued in the client is not the engine's
                timing = await self._one(req)
            on_done()
            return timing

        return list(await asyncio.gather(*(limited(r) for r in requests)))

    def warmup(self, requests: list[BenchRequest]) -> None:
        # Measure the engine as it serves once warm: a CPU decode still compiling would time eager steps
        # and share the cores with the compiler (cpu_step/compiled.py).
        deadline = time.monotonic() + COMPILE_WAIT_S
        while self.client.stats().decode_compiling and time.monotonic() < deadline:
            time.sleep(0.5)
        if requests:
            asyncio.run(self._run(requests, len(requests), lambda: None))

    def run(self, case: Case, concurrency: int, on_done: OnDone) -> RunOutput:
        clock = ClientClock()
        timings = asyncio.run(self._run(case.requests, concurrency, on_done))
        used = clock.stop()
        return RunOutput(timings, used.wall_s, [used] if self.remote else [], clock.started_at)

    def close(self) -> None:
        self.client.close()
