"""Server metrics: request counters, inflight gauge, latency windows and histograms, as JSON or Prometheus text.

The scheduler's own figures (queues, KV pages, cache hits, token rates; with --dp their sum and each
replica's own) come from `client.stats()`; this module adds what only the HTTP front sees (inflight,
rejections, disconnects, per-request latency) and renders both. Thread-safe: handlers, the ZMQ control
thread and /metrics all touch it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from typing import Any

from minisgl_cli.api.prometheus import escape_label, number, prometheus_family
from minisgl_cli.scheduler.stats import RollingRate
from minisgl_cli.types import ModelInfo, RequestStats, SchedulerStats

# Seconds; wide enough for a CPU box under load and a GPU alike.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Histogram:
    """Cumulative-bucket histogram in the Prometheus sense (count, sum, le-buckets)."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.count += 1
        self.sum += value
        for i, le in enumerate(self.buckets):
            if value <= le:
                self.counts[i] += 1


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class ServerMetrics:
    def __init__(self, window: int = 1000, rate_window_s: float = 10.0, recent: int = 20):
        self._lock = threading.Lock()
        self.started = time.time()
        self.inflight = 0
        self.requests: Counter[tuple[str, int]] = Counter()  # (endpoint, status) -> count
        self.rejected = 0  # 429s from the inflight cap
        self.disconnects = 0
        self.downscaled = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finished: Counter[str] = Counter()  # finish_reason -> count
        self.ttft = Histogram()
        self.e2e = Histogram()
        self._recent_ttft: deque[float] = deque(maxlen=window)
        self._recent_e2e: deque[float] = deque(maxlen=window)
        self._completions = RollingRate(rate_window_s)  # completion tokens of requests that finished lately
        self._recent: deque[dict[str, Any]] = deque(maxlen=recent)  # the last engine requests (the web page)
        self._ended = 0

    # --- recording -----------------------------------------------------------------------------
    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1
            self.rejected += status == 429

    def add_inflight(self, n: int) -> None:
        with self._lock:
            self.inflight += n

    def disconnect(self) -> None:
        with self._lock:
            self.disconnects += 1

    def downscale(self) -> None:
        with self._lock:
            self.downscaled += 1

    def finish(self, stats: RequestStats | None, reason: str | None, endpoint: str | None = None) -> None:
        """One engine request ended (completed, stopped, or aborted by a disconnect); `endpoint`: the route it came
        through (the page's table shows it)."""
        with self._lock:
            self.finished[reason or "error"] += 1
            self._ended += 1
            self._recent.append(_recent_entry(self._ended, stats, reason or "error", endpoint))
            if stats is None:
                return
            self.prompt_tokens += stats.prompt_tokens
            self.cached_tokens += stats.cached_tokens
            self.completion_tokens += stats.completion_tokens
            if stats.completion_tokens and reason in ("stop", "length"):
                self.ttft.observe(stats.ttft_s)
                self.e2e.observe(stats.latency_s)
                self._recent_ttft.append(stats.ttft_s)
                self._recent_e2e.append(stats.latency_s)
                self._completions.add(stats.completion_tokens)

    def recent(self) -> list[dict[str, Any]]:
        """The last engine requests, newest last: id, finish, tokens, TTFT / TPOT / latency in ms."""
        with self._lock:
            return list(self._recent)

    # --- rendering -----------------------------------------------------------------------------
    def to_json(self, sched: SchedulerStats, model: str, max_inflight: int | None,
                info: ModelInfo | None = None) -> dict[str, Any]:
        """`info`: the engine behind the server (its kernels: attention backend, sampler)."""
        with self._lock:
            ttft, e2e = list(self._recent_ttft), list(self._recent_e2e)
            return {
                "model": model,
                **({"engine": _engine_info(info)} if info is not None else {}),
                "uptime_s": round(time.time() - self.started, 3),
                "scheduler": sched.to_dict(),
                "server": {
                    "inflight": self.inflight,
                    "max_inflight_total": max_inflight,
                    "requests": {f"{ep} {st}": n for (ep, st), n in sorted(self.requests.items())},
                    "rejected_429": self.rejected,
                    "disconnects": self.disconnects,
                    "max_tokens_downscaled": self.downscaled,
                    "finished": dict(self.finished),
                    "prompt_tokens": self.prompt_tokens,
                    "cached_tokens": self.cached_tokens,
                    "completion_tokens": self.completion_tokens,
                },
                "latency": {
                    "window": len(e2e),
                    "ttft_ms": {"p50": _ms(_percentile(ttft, 0.5)), "p99": _ms(_percentile(ttft, 0.99))},
                    "e2e_ms": {"p50": _ms(_percentile(e2e, 0.5)), "p99": _ms(_percentile(e2e, 0.99))},
                },
                "process_cpu_seconds": _process_cpu(sched),
                "throughput": {
                    "completion_tok_s": round(self._completions.rate(), 3),
                    "decode_tok_s": round(sched.decode_tok_s, 3),
                    "prefill_tok_s": round(sched.prefill_tok_s, 3),
                    "spec_accepted_tok_s": round(sched.spec_accepted_tok_s, 3),
                },
            }

    def to_prometheus(self, sched: SchedulerStats, model: str, info: ModelInfo | None = None) -> str:
        """Prometheus text exposition format 0.0.4, written by hand (no client library needed)."""
        lines: list[str] = []
        label = f'model_name="{escape_label(model)}"'

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend(prometheus_family(name, kind, help_, samples))

        def one(labels: str = "") -> str:
            return "{" + ",".join(x for x in (label, labels) if x) + "}"

        def families(kind: str, rows: tuple[tuple[str, float | None, str], ...]) -> None:
            for name, value, help_ in rows:
                if value is not None:  # None: the engine has no such figure (hf, mlx): no series, not a 0
                    metric(name, kind, help_, [(one(), value)])

        with self._lock:
            if info is not None:
                labels = ",".join(f'{k}="{escape_label(v)}"' for k, v in _engine_info(info).items())
                metric("engine_info", "gauge", "The engine's kernels (value 1; the labels say which).",
                       [(one(labels), 1)])
            metric("num_requests_running", "gauge", "Requests in the decode batch.", [(one(), sched.running)])
            metric("num_requests_waiting", "gauge", "Requests queued for prefill.", [(one(), sched.waiting)])
            metric(
                "num_requests_inflight",
                "gauge",
                "Engine requests admitted by the HTTP front.",
                [(one(), self.inflight)],
            )
            families("gauge", (
                ("kv_tokens_total", sched.tokens_total, "KV pool size in tokens."),
                ("kv_tokens_free", sched.tokens_free, "Free KV tokens."),
                ("kv_tokens_cached", sched.tokens_cached, "KV tokens held by the prefix cache."),
                ("kv_tokens_in_use", sched.tokens_in_use, "KV tokens held by running requests."),
                ("prefill_throughput_tokens_per_second", sched.prefill_tok_s, "Rolling prefill rate."),
                ("decode_throughput_tokens_per_second", sched.decode_tok_s, "Decode speed of the last 10 s of steps."),
                ("decode_compiling", sched.decode_compiling,
                 "Engines still building their compiled CPU decode step (--torch-compile); eager until then."),
                ("decode_compiled", sched.decode_compiled, "Engines decoding through their compiled CPU decode step."),
                ("spec_accept_length", sched.spec_accept_length,
                 "Speculative decoding: tokens a request gains per verify step (its accepted drafts + 1)."),
                ("spec_accepted_tokens_per_second", sched.spec_accepted_tok_s,
                 "Speculative decoding: accepted draft tokens per second of decode (rolling)."),
            ))
            families("counter", (
                ("cache_hit_tokens_total", sched.cache_hit_tokens, "Prompt tokens served from the prefix cache."),
                ("cache_miss_tokens_total", sched.cache_miss_tokens, "Prompt tokens prefilled."),
                ("cache_hit_requests_total", sched.cache_hit_requests, "Requests with a prefix cache hit."),
                ("cache_miss_requests_total", sched.cache_miss_requests, "Requests without a prefix cache hit."),
                ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("generation_tokens_total", self.completion_tokens, "Generated tokens of finished requests."),
                ("requests_rejected_total", self.rejected, "Requests refused with 429 by the inflight cap."),
                ("requests_disconnected_total", self.disconnects, "Streams the client closed early."),
                ("max_tokens_downscaled_total", self.downscaled, "Requests whose max_tokens was cut under load."),
                ("retracted_requests_total", sched.retracted_requests, "Requests retracted to free KV."),
                ("spec_verifies_total", sched.spec_verifies, "Requests' verify steps that carried drafts."),
                ("spec_draft_tokens_total", sched.spec_draft_tokens, "Draft tokens verified."),
                ("spec_accepted_tokens_total", sched.spec_accepted_tokens, "Draft tokens accepted."),
            ))
            if sched.kv_bytes_total:  # an engine with a KV pool: its bytes, full and window pages together
                families("gauge", (
                    ("kv_bytes_total", sched.kv_bytes_total, "KV pool bytes (full and window pages)."),
                    ("kv_bytes_used", sched.kv_bytes_used, "KV bytes held by requests and the prefix cache."),
                ))
            if sched.window_tokens_total:  # sliding and full layers mixed: the sliding layers' window pages
                families("gauge", (
                    ("kv_window_tokens_total", sched.window_tokens_total,
                     "Sliding layers' window pool size in tokens (they keep only their window's KV)."),
                    ("kv_window_tokens_free", sched.window_tokens_free, "Free window-pool tokens."),
                ))
            if sched.state_slots_total:  # a linear-attention model: its recurrent-state slots (kvcache/state.py)
                families("gauge", (
                    ("state_slots_total", sched.state_slots_total, "Recurrent-state slots (linear-attention layers)."),
                    ("state_slots_free", sched.state_slots_free, "Recurrent-state slots no request holds."),
                ))
            if info is not None and info.images:  # a vision-language model on the engine
                families("counter", (
                    ("images_encoded_total", sched.images_encoded, "Images the vision tower encoded."),
                    ("image_cache_hits_total", sched.image_cache_hits,
                     "Images whose embeddings came from the engine's cache instead of the vision tower."),
                    ("vision_seconds_total", sched.vision_s, "Seconds the vision tower ran."),
                ))
            if sched.replicas:  # data parallel: each replica's own
                def each(values: list[float | None]) -> list[tuple[str, float]]:
                    return [(one(f'replica="{r.replica}"'), v) for r, v in zip(sched.replicas, values) if v is not None]

                reps = sched.replicas
                metric("replica_up", "gauge", "1 while the replica serves, 0 once it is out.",
                       each([float(r.alive) for r in reps]))
                metric("replica_requests_total", "counter", "Requests routed to the replica.",
                       each([r.requests for r in reps]))
                metric("replica_inflight", "gauge", "Requests routed to the replica and not finished (its load).",
                       each([r.inflight for r in reps]))
                metric("replica_cache_hit_rate", "gauge", "The replica's prefix cache hits over prompt tokens.",
                       each([r.stats.cache_hit_rate if r.stats else 0.0 for r in reps]))
            metric("process_cpu_seconds_total", "counter",
                   "CPU seconds (user + system) of each server process: the API, tokenizers, detokenizer, ranks.",
                   [(one(f'process="{escape_label(name)}"'), s) for name, s in _process_cpu(sched).items()])
            metric("http_requests_total", "counter", "HTTP requests by endpoint and status.",
                   [(one(f'endpoint="{ep}",status="{st}"'), n) for (ep, st), n in sorted(self.requests.items())])
            metric("request_success_total", "counter", "Engine requests by finish reason.",
                   [(one(f'finish_reason="{r}"'), n) for r, n in sorted(self.finished.items())])
            for name, hist, help_ in (
                ("time_to_first_token_seconds", self.ttft, "Time to first token."),
                ("e2e_request_latency_seconds", self.e2e, "End-to-end request latency."),
            ):
                samples = [(one(f'le="{number(le)}"'), c) for le, c in zip(hist.buckets, hist.counts)]
                samples.append((one('le="+Inf"'), hist.count))
                lines.append(f"# HELP minisgl_{name} {help_}")
                lines.append(f"# TYPE minisgl_{name} histogram")
                lines += [f"minisgl_{name}_bucket{lbl} {number(v)}" for lbl, v in samples]
                lines.append(f"minisgl_{name}_sum{one()} {number(hist.sum)}")
                lines.append(f"minisgl_{name}_count{one()} {hist.count}")
        return "\n".join(lines) + "\n"


def _recent_entry(seq: int, stats: RequestStats | None, reason: str, endpoint: str | None) -> dict[str, Any]:
    s = stats or RequestStats()
    tpot = (s.latency_s - s.ttft_s) / (s.completion_tokens - 1) if s.completion_tokens > 1 else None
    return {"id": seq, "at": round(time.time(), 3), "api": endpoint, "finish": reason, "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens, "completion_tokens": s.completion_tokens,
            "ttft_ms": _ms(s.ttft_s) if s.completion_tokens else None,
            "tpot_ms": _ms(tpot) if tpot is not None else None,
            "latency_ms": _ms(s.latency_s) if stats is not None else None}


def _process_cpu(sched: SchedulerStats) -> dict[str, float]:
    """CPU seconds by process: this one ("api": with an in-process engine, the engine's too) and the engine's."""
    return {"api": round(time.process_time(), 3), **{k: round(v, 3) for k, v in sched.process_cpu_s.items()}}


def _engine_info(info: ModelInfo) -> dict[str, str]:
    return {"engine": info.engine, "device": info.device, "attention_backend": info.attention_backend,
            "sampler": info.sampler, "speculative": info.speculative or "none"}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)



def media_prometheus(media: dict[str, Any], model: str) -> str:
    """The media worker's figures (MediaService.metrics) in the text format."""
    label = f'model_name="{escape_label(model)}"'
    one = "{" + label + "}"
    lines: list[str] = []
    for name, kind, help_, value in (
        ("media_jobs_queued", "gauge", "Image / video jobs waiting for the media worker.", media["queued"]),
        ("media_jobs_running", "gauge", "Image / video jobs in the worker's pipeline call.", media["running"]),
        ("media_work_in_flight", "gauge", "Megapixel-steps admitted and not finished.", media["work_in_flight"]),
        ("media_jobs_completed_total", "counter", "Media jobs that returned their result.", media["jobs"]["completed"]),
        ("media_jobs_cancelled_total", "counter", "Media jobs cancelled (hang-up, DELETE)", media["jobs"]["cancelled"]),
        ("media_jobs_failed_total", "counter", "Media jobs that failed in the worker.", media["jobs"]["failed"]),
        ("media_steps_total", "counter", "Denoise steps the media worker ran (per job).", media["steps"]),
        ("media_step_seconds_mean", "gauge", "Mean seconds of a denoise step.", media["step_ms"]["mean"] / 1000),
        ("media_batch_size_mean", "gauge", "Mean images per pipeline call.", media["batches"]["mean_size"]),
    ):
        lines += prometheus_family(name, kind, help_, [(one, value)])
    lines += prometheus_family("media_jobs_refused_total", "counter", "Media requests refused, by HTTP status.",
                               [("{" + f'{label},status="{s}"' + "}", n) for s, n in media["jobs"]["refused"].items()])
    lines += prometheus_family("media_batches_total", "counter", "Pipeline calls, by images in the call.",
                               [("{" + f'{label},size="{s}"' + "}", n) for s, n in media["batches"]["sizes"].items()])
    return "\n".join(lines) + "\n"
