"""The HTTP target: streams `/v1/completions` (or `/v1/chat/completions`) from any OpenAI-compatible server,
with Poisson arrivals at `request_rate` (inf: all at once) and at most `max_concurrency` requests in flight,
spread over `client_procs` worker processes so that the client is never what limits the figure.

Each worker takes every N-th request, its part of the concurrency and of the rate (N Poisson processes at r/N
make one at r); their timings come back merged in the run's order, with each worker's CPU seconds."""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import queue
import time
from typing import Any

import httpx

from minisgl_cli.bench.http_client import Send, Sent, Share, run_share, worker
from minisgl_cli.bench.metrics import RequestTiming
from minisgl_cli.bench.target import ClientCpu, OnDone, RunOutput
from minisgl_cli.bench.workloads import BenchRequest, Case
from minisgl_cli.process_cpu import usable_cores

APIS = ("completions", "chat")
STREAMS_PER_PROC = 32  # the default: one client process per this many streams in flight, up to the cores
START_TIMEOUT_S = 60.0  # a client worker that is not ready by then failed to start


def default_client_procs(concurrency: int) -> int:
    """One client process per STREAMS_PER_PROC streams in flight, at most one per core this process may use."""
    return max(1, min(math.ceil(concurrency / STREAMS_PER_PROC), usable_cores()))


def served_model(url: str, timeout: float = 10.0) -> str:
    """The first model id the server lists at /v1/models ("default" when it lists none)."""
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=timeout)
        r.raise_for_status()
        data = r.json().get("data") or []
        return data[0]["id"] if data else "default"
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return "default"


class HttpTarget:
    sequential = False

    def __init__(self, url: str, *, api: str = "completions", model: str | None = None, request_rate: float = math.inf,
                 tokenizer: Any = None, seed: int = 0, timeout_s: float = 600.0, client_procs: int | None = None):
        if api not in APIS:
            raise ValueError(f"unknown api {api!r}; choose one of {', '.join(APIS)}")
        if client_procs is not None and client_procs < 1:
            raise ValueError("--client-procs must be >= 1")
        self.url = url.rstrip("/")
        self.api = api
        self.model = model or served_model(self.url)
        self.request_rate = request_rate
        self.tokenizer = tokenizer  # counts output tokens when the server sends no usage
        self.seed = seed
        self.timeout_s = timeout_s
        self.client_procs = client_procs  # None: default_client_procs(concurrency)
        self.name = f"server@{httpx.URL(self.url).host}:{httpx.URL(self.url).port}"

    def _send(self, req: BenchRequest) -> Send:
        common = {"model": self.model, "max_tokens": req.max_new_tokens, **req.sampling.wire(), "stream": True,
                  "stream_options": {"include_usage": True}}
        if req.ignore_eos:
            common["ignore_eos"] = True  # sglang / vLLM extension; other servers ignore it
        if self.api == "chat":
            text = req.prompt if req.prompt is not None else self._decode(req.input_ids)
            return Send("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": text}]},
                        req.prompt_tokens)
        # Text when we have it (every server takes it), token ids otherwise (OpenAI allows a list of ints).
        prompt: str | list[int] = req.prompt if req.prompt is not None else req.input_ids
        return Send("/v1/completions", {**common, "prompt": prompt}, req.prompt_tokens)

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("chat API with a token-id workload needs a tokenizer (pass --model)")
        return self.tokenizer.decode(ids)

    def _timing(self, sent: Sent) -> RequestTiming:
        """The request's timing with its output tokens counted: the server's usage, else the text re-tokenized,
        else (no usage, no tokenizer) one token per chunk."""
        t = sent.timing
        if sent.usage_tokens is not None:
            t.output_tokens = sent.usage_tokens
        elif self.tokenizer is not None and t.text:
            t.output_tokens = len(self.tokenizer.encode(t.text, add_special_tokens=False))
        else:
            t.output_tokens = len(t.chunk_times_s)
        return t

    def _shares(self, requests: list[BenchRequest], concurrency: int | None, procs: int) -> list[Share]:
        sends = [self._send(r) for r in requests]
        procs = max(1, min(procs, len(sends), concurrency or len(sends)))
        shares = []
        for n in range(procs):
            conc = None if concurrency is None else concurrency // procs + (n < concurrency % procs)
            index = list(range(n, len(sends), procs))
            shares.append(Share(index, [sends[i] for i in index], conc, self.request_rate / procs, self.seed + n))
        return shares

    def _run(self, requests: list[BenchRequest], concurrency: int | None, on_done: OnDone,
             procs: int) -> RunOutput:
        shares = self._shares(requests, concurrency, procs)
        if len(shares) == 1:  # in this process: nothing to spread
            run = asyncio.run(run_share(self.url, shares[0], self.timeout_s, lambda i: on_done()))
            return RunOutput([self._timing(s) for s in run.sents], run.cpu.wall_s, [run.cpu], run.started_at)
        return self._spread(shares, len(requests), on_done)

    def _spread(self, shares: list[Share], total: int, on_done: OnDone) -> RunOutput:
        """Run each share in its own worker process from one common start; merge their results in request order."""
        ctx = mp.get_context("spawn")  # no fork of a process that may hold torch and its threads
        events = ctx.Queue()
        start = ctx.Event()
        procs = [ctx.Process(target=worker, args=(n, self.url, share, self.timeout_s, start, events),
                             name=f"minisgl bench client {n}", daemon=True) for n, share in enumerate(shares)]
        for p in procs:
            p.start()
        try:
            ready = 0
            deadline = time.monotonic() + START_TIMEOUT_S
            while ready < len(procs):
                ready += self._event(events, procs, deadline)[0] == "ready"
            t0, wall_t0 = time.perf_counter(), time.time()
            start.set()
            timings: list[RequestTiming | None] = [None] * total
            cpu: list[ClientCpu] = [ClientCpu(0.0, 0.0)] * len(procs)
            ends: list[float] = []
            while len(ends) < len(procs):
                event = self._event(events, procs, None)
                if event[0] == "done":
                    on_done()
                elif event[0] == "result":
                    n, run = event[1:]
                    for i, sent in zip(shares[n].index, run.sents):
                        timings[i] = self._timing(sent)
                    cpu[n] = run.cpu
                    ends.append(run.t0 + run.cpu.wall_s)
            assert all(t is not None for t in timings)
            return RunOutput([t for t in timings if t is not None], max(ends) - t0, cpu, wall_t0)
        finally:
            for p in procs:
                p.join(5)
                if p.exitcode is None:
                    p.kill()
                    p.join(1)

    @staticmethod
    def _event(events: Any, procs: list, deadline: float | None) -> tuple:
        """The next worker event; RuntimeError when a worker failed, died, or none was ready by the deadline."""
        while True:
            try:
                event = events.get(timeout=0.5)
            except queue.Empty:
                event = None
            if event is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise RuntimeError(f"the bench's client workers did not start within {START_TIMEOUT_S:.0f}s")
                if dead := [p for p in procs if p.exitcode not in (None, 0)]:
                    raise RuntimeError(f"bench client worker {dead[0].name} exited with code {dead[0].exitcode}")
                continue
            if event[0] == "error":
                raise RuntimeError(f"bench client worker {event[1]} failed:\n{event[2]}")
            return event

    def procs_for(self, concurrency: int) -> int:
        return self.client_procs or default_client_procs(concurrency)

    def warmup(self, requests: list[BenchRequest]) -> None:
        if requests:
            self._run(requests, None, lambda: None, 1)

    def run(self, case: Case, concurrency: int, on_done: OnDone) -> RunOutput:
        return self._run(case.requests, concurrency, on_done, self.procs_for(concurrency))

    def close(self) -> None:
        pass
