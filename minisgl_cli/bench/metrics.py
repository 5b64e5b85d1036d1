"""Benchmark metrics from per-request timings, named as in sglang/vLLM bench_serving (pure functions).

Definitions (all per request, times relative to when the request was sent):
  * TTFT  = time of the first streamed token - send time;
  * E2E   = time of the last token - send time;
  * TPOT  = (E2E - TTFT) / (output_tokens - 1), only for requests with more than one output token;
  * ITL   = every gap between two consecutive streamed chunks (a chunk may carry several tokens).
Throughputs divide totals by the wall-clock duration of the whole run, not by summed latencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """What one request did, as seen by the client that sent it."""

    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None  # None when the target cannot stream (HF batched generate)
    latency_s: float = 0.0  # E2E
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each streamed chunk, from send
    cached_tokens: int | None = None  # prefix-cache hit, when the target knows it
    drafted_tokens: int | None = None  # output tokens that were accepted drafts, when the target speculates
    success: bool = True
    error: str | None = None
    text: str = ""

    @property
    def itl_s(self) -> list[float]:
        t = self.chunk_times_s
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens <= 1:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class Dist:
    """A latency distribution in milliseconds (bench_serving reports ms)."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    p90: float = 0.0
    p95: float = 0.0
    p99: float = 0.0
    count: int = 0


@dataclass
class BenchMetrics:
    """One run (one engine, one case, one concurrency) summarized with bench_serving's names."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    total_cached_tokens: int | None
    request_throughput: float  # req/s
    input_throughput: float  # tok/s
    output_throughput: float  # tok/s
    total_throughput: float  # (input + output) tok/s
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_latency_ms: Dist
    total_drafted_tokens: int | None = None  # speculative decoding: accepted draft tokens (None: not speculating)

    @property
    def accept_length(self) -> float | None:
        """Output tokens per engine step of a request (speculative decoding; None without it)."""
        if self.total_drafted_tokens is None:
            return None
        steps = self.total_output_tokens - self.total_drafted_tokens
        return self.total_output_tokens / steps if steps > 0 else 1.0


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return 0.0
    if not 0.0 <= p <= 100.0:
        raise ValueError("percentile must be in [0, 100]")
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values_s: list[float]) -> Dist:
    """Mean/median/std/p90/p95/p99 of values in seconds, reported in milliseconds."""
    if not values_s:
        return Dist()
    ms = [v * 1000.0 for v in values_s]
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))  # population std, as numpy.std
    return Dist(mean, percentile(ms, 50), std, percentile(ms, 90), percentile(ms, 95), percentile(ms, 99), len(ms))


def compute_metrics(timings: list[RequestTiming], duration_s: float) -> BenchMetrics:
    """Aggregate a run's request timings; failed requests count only in `failed`."""
    ok = [t for t in timings if t.success]
    total_in = sum(t.prompt_tokens for t in ok)
    total_out = sum(t.output_tokens for t in ok)
    cached = [t.cached_tokens for t in ok if t.cached_tokens is not None]
    drafted = [t.drafted_tokens for t in ok if t.drafted_tokens is not None]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return BenchMetrics(
        completed=len(ok),
        failed=len(timings) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        total_cached_tokens=sum(cached) if cached else None,
        request_throughput=per_s(len(ok)),
        input_throughput=per_s(total_in),
        output_throughput=per_s(total_out),
        total_throughput=per_s(total_in + total_out),
        ttft_ms=distribution([t.ttft_s for t in ok if t.ttft_s is not None]),
        tpot_ms=distribution([x for t in ok if (x := t.tpot_s) is not None]),
        itl_ms=distribution([g for t in ok for g in t.itl_s]),
        e2e_latency_ms=distribution([t.latency_s for t in ok]),
        total_drafted_tokens=sum(drafted) if drafted else None,
    )
