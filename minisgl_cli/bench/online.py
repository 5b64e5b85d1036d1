"""The HTTP target: streams `/v1/completions` (or `/v1/chat/completions`) from any OpenAI-compatible server,
with Poisson arrivals at `request_rate` (inf: all at once) and at most `max_concurrency` requests in flight."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from typing import Any

import httpx

from minisgl_cli.bench.metrics import RequestTiming
from minisgl_cli.bench.target import OnDone, RunOutput
from minisgl_cli.bench.workloads import BenchRequest, Case

APIS = ("completions", "chat")


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model id the server lists at /v1/models ("default" when it lists none)."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout)
        r.raise_for_status()
        data = r.json().get("data") or []
        return data[0]["id"] if data else "default"
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "default"


def parse_sse_line(line: str) -> dict | None | str:
    """One SSE line -> its JSON payload; "[DONE]" for the end marker; None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    try:
        return json.loads(data)
    except json.JSONDecodeError:
        return None


def chunk_text(payload: dict, api: str) -> str | None:
    """A streamed chunk's generated text ("" when its tokens have no text yet, e.g. a server without a
    tokenizer); None for chunks that carry no tokens (the role, the finish reason, usage)."""
    choices = payload.get("choices") or []
    if not choices:
        return None
    c = choices[0]
    if api == "chat":
        delta = c.get("delta") or {}
        text = delta.get("content")
        return None if delta.get("role") or (text is None) or (not text and c.get("finish_reason")) else text
    text = c.get("text")
    return None if text is None or (not text and c.get("finish_reason")) else text


class HttpTarget:
    sequential = False

    def __init__(self, url: str, *, api: str = "completions", model: str | None = None, request_rate: float = math.inf,
                 tokenizer: Any = None, seed: int = 0, timeout_s: float = 600.0):
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}; choose one of {', '.join(APIS)}")
        self.url = url.rstrip("/")
        self.api = api
        self.model = model or served_model(self.url)
        self.request_rate = request_rate
        self.tokenizer = tokenizer  # counts output tokens when the server sends no usage
        self.seed = seed
        self.timeout_s = timeout_s
        self.name = f"server@{httpx.URL(self.url).host}:{httpx.URL(self.url).port}"

    def _payload(self, req: BenchRequest) -> tuple[str, dict]:
        common = {"model": self.model, "max_tokens": req.max_new_tokens, **req.sampling.wire(), "stream": True,
                  "stream_options": {"include_usage": True}}
        if req.ignore_eos:
            common["ignore_eos"] = True  # sglang / vLLM extension; other servers ignore it
        if self.api == "chat":
            text = req.prompt if req.prompt is not None else self._decode(req.input_ids)
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]}
        # Text when we have it (every server takes it), token ids otherwise (OpenAI allows a list of ints).
        prompt: str | list[int] = req.prompt if req.prompt is not None else req.input_ids
        return "/v1/completions", {**common, "prompt": prompt}

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("chat API with a token-id workload needs a tokenizer (pass --model)")
        return self.tokenizer.decode(ids)

    async def _one(self, http: httpx.AsyncClient, req: BenchRequest) -> RequestTiming:
        path, body = self._payload(req)
        timing = RequestTiming(prompt_tokens=req.prompt_tokens)
        parts: list[str] = []
        usage_tokens: int | None = None
        t0 = time.perf_counter()
        try:
            async with http.stream("POST", self.url + path, json=body) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")[:200]
                    raise RuntimeError(f"HTTP {resp.status_code}: {detail}")
                async for line in resp.aiter_lines():
                    payload = parse_sse_line(line)
                    if payload == "[DONE]":
                        break
                    if not isinstance(payload, dict):
                        continue
                    if payload.get("error"):
                        raise RuntimeError(str(payload["error"])[:200])
                    now = time.perf_counter() - t0
                    if (text := chunk_text(payload, self.api)) is not None:
                        if timing.ttft_s is None:
                            timing.ttft_s = now
                        timing.chunk_times_s.append(now)
                        parts.append(text)
                    if usage := payload.get("usage"):
                        usage_tokens = usage.get("completion_tokens", usage_tokens)
                        timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except Exception as exc:
            timing.success, timing.error = False, f"{type(exc).__name__}: {exc}"
        timing.latency_s = time.perf_counter() - t0
        timing.text = "".join(parts)
        timing.output_tokens = self._count(usage_tokens, timing)
        return timing

    def _count(self, usage_tokens: int | None, timing: RequestTiming) -> int:
        if usage_tokens is not None:
            return usage_tokens
        if self.tokenizer is not None and timing.text:
            return len(self.tokenizer.encode(timing.text, add_special_tokens=False))
        return len(timing.chunk_times_s)  # without usage or tokenizer: one token per chunk

    async def _run(
        self, requests: list[BenchRequest], max_concurrency: int | None, on_done: OnDone
    ) -> list[RequestTiming]:
        rng = random.Random(self.seed)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), limits=limits) as http:

            async def limited(req: BenchRequest) -> RequestTiming:
                if gate is None:
                    timing = await self._one(http, req)
                else:
                    async with gate:
                        timing = await self._one(http, req)
                on_done()
                return timing

            tasks = []
            for i, req in enumerate(requests):
                if i and math.isfinite(self.request_rate) and self.request_rate > 0:
                    await asyncio.sleep(rng.expovariate(self.request_rate))  # Poisson process: exponential gaps
                tasks.append(asyncio.create_task(limited(req)))
            return list(await asyncio.gather(*tasks))

    def warmup(self, requests: list[BenchRequest]) -> None:
        if requests:
            asyncio.run(self._run(requests, None, lambda: None))

    def run(self, case: Case, concurrency: int, on_done: OnDone) -> RunOutput:
        t0 = time.perf_counter()
        timings = asyncio.run(self._run(case.requests, concurrency, on_done))
        return RunOutput(timings, time.perf_counter() - t0)

    def close(self) -> None:
        pass
