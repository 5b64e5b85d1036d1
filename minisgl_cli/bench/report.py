"""Bench results and how they are shown: rich table, the reference stack's summary lines, JSON, PNG plot."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from minisgl_cli.bench.metrics import BenchMetrics
from minisgl_cli.bench.target import ClientCpu

_DISTS = ("ttft", "tpot", "itl", "e2e_latency")
_STATS = ("mean", "median", "std", "p90", "p95", "p99")


@dataclass
class BenchResult:
    """One engine on one case at one concurrency."""

    engine: str
    case: str
    concurrency: int
    num_requests: int
    metrics: BenchMetrics
    case_params: dict[str, Any] = field(default_factory=dict)
    client_cpu: list[ClientCpu] = field(default_factory=list)  # each client process's, where measured
    started_at: float = 0.0  # time.time() as the run began: lines the run up with a server's step trace

    def flat(self) -> dict[str, Any]:
        """bench_serving's flat names: request_throughput, mean_ttft_ms, p99_itl_ms, ..."""
        m = self.metrics
        out: dict[str, Any] = {
            "engine": self.engine, "case": self.case, "concurrency": self.concurrency,
            "num_requests": self.num_requests, "completed": m.completed, "failed": m.failed,
            "started_at": self.started_at, "duration_s": m.duration_s, "total_input_tokens": m.total_input_tokens,
            "total_output_tokens": m.total_output_tokens, "total_cached_tokens": m.total_cached_tokens,
            "request_throughput": m.request_throughput, "input_throughput": m.input_throughput,
            "output_throughput": m.output_throughput, "total_throughput": m.total_throughput,
        }
        for d in _DISTS:
            dist = getattr(m, f"{d}_ms")
            for s in _STATS:
                out[f"{s}_{d}_ms"] = getattr(dist, s)
        if m.total_drafted_tokens is not None:
            out["total_drafted_tokens"] = m.total_drafted_tokens
            out["accept_length"] = m.accept_length
        out["case_params"] = self.case_params
        if self.client_cpu:
            out["client_procs"] = len(self.client_cpu)
            out["client_cpu_seconds"] = [round(u.cpu_s, 3) for u in self.client_cpu]
            out["client_core_share"] = [round(u.core_share, 3) for u in self.client_cpu]
            out["client_gc_seconds"] = [round(u.gc_s, 3) for u in self.client_cpu]
            out["client_gc_longest_seconds"] = [round(u.gc_max_s, 3) for u in self.client_cpu]
        return out


@dataclass
class BenchReport:
    meta: dict[str, Any]
    results: list[BenchResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # skipped peers, dummy-weight caveats, ...

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": [r.flat() for r in self.results],
                "summary": summary_lines(self), "notes": self.notes}

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")


# --- the reference stack's summary lines ----------------------------------------------------------


def _totals(results: list[BenchResult]) -> tuple[float, float]:
    """(throughput tok/s, duration s) over a set of runs: all output tokens over all run time."""
    tokens = sum(r.metrics.total_output_tokens for r in results)
    duration = sum(r.metrics.duration_s for r in results)
    return (tokens / duration if duration > 0 else 0.0), duration


def _concurrency(results: list[BenchResult]) -> str:
    return "/".join(str(c) for c in sorted({r.concurrency for r in results}))


def _output_tokens(results: list[BenchResult]) -> int:
    return sum(r.metrics.total_output_tokens for r in results)


def _cached(results: list[BenchResult]) -> int | None:
    """Prompt tokens the prefix cache served; None for a stack without one (the HF baselines)."""
    counts = [r.metrics.total_cached_tokens for r in results]
    return None if all(c is None for c in counts) else sum(c or 0 for c in counts)


def summary_line(label: str, results: list[BenchResult]) -> str:
    """The reference stack's line, then what the figure was measured under: requests in flight, output tokens and
    prompt tokens served from a prefix cache, so two lines compare only as far as these agree."""
    tp, dur = _totals(results)
    cached = _cached(results)
    prompt = sum(r.metrics.total_input_tokens for r in results)
    cache = "no prefix cache" if cached is None else f"cached_prompt_tokens={cached}/{prompt}"
    return (f"{label} summary: throughput={tp:.2f} tok/s, duration={dur:.3f}s "
            f"(concurrency={_concurrency(results)}, output_tokens={_output_tokens(results)}, {cache})")


def comparison_line(ours: list[BenchResult], base: list[BenchResult]) -> str:
    """The reference stack's line, then the three things besides the engine that move it: the two sides'
    concurrency, their output tokens (the throughputs are per output token, the durations are not) and the prompt
    tokens our prefix cache served."""
    (tp, dur), (btp, bdur) = _totals(ours), _totals(base)
    ratio = tp / btp if btp > 0 else float("inf")
    word = "faster" if dur <= bdur else "slower"
    out, bout = _output_tokens(ours), _output_tokens(base)
    tokens = "same output tokens" if out == bout else f"output tokens {out} vs {bout}"
    cached = _cached(ours)
    cache = "" if cached is None else f", {cached} prompt tokens cached"
    return (f"Comparison: streaming {word} by {abs(bdur - dur):.3f}s with x{ratio:.2f} throughput "
            f"(concurrency {_concurrency(ours)} vs {_concurrency(base)}, {tokens}{cache})")


def summary_lines(report: BenchReport) -> list[str]:
    """Per concurrency level, the engine against the HF streaming baseline, in the reference stack's words, each
    line saying what its figure was measured under:

        Streaming chat summary: throughput=37.16 tok/s, duration=10.387s (concurrency=4, output_tokens=386,
            cached_prompt_tokens=0/336)
        Baseline HF streaming chat summary: throughput=17.69 tok/s, duration=21.825s (concurrency=1,
            output_tokens=386, no prefix cache)
        Comparison: streaming faster by 11.438s with x2.10 throughput (concurrency 4 vs 1, same output tokens,
            0 prompt tokens cached)
    """
    engines = [
        e for e in dict.fromkeys(r.engine for r in report.results) if e not in ("hf-stream", "hf-batched", "llama-cpp")
    ]
    hf = [r for r in report.results if r.engine == "hf-stream"]
    levels = list(dict.fromkeys(r.concurrency for r in report.results if r.engine in engines))
    lines: list[str] = []
    for engine in engines:
        for c in levels:
            ours = [r for r in report.results if r.engine == engine and r.concurrency == c]
            if not ours:
                continue
            if len(levels) > 1 or len(engines) > 1:
                lines.append(f"[{engine} concurrency={c}]")
            lines.append(summary_line("Streaming chat", ours))
            if hf:
                lines.append(summary_line("Baseline HF streaming chat", hf))
                lines.append(comparison_line(ours, hf))
    return lines


# --- rich table ---------------------------------------------------------------------------------


def _ms(x: float, n: int) -> str:
    return f"{x:.1f}" if n else "-"


def _client(r: BenchResult) -> str:
    """The client processes and the busiest one's share of a core: "4x max 35%"."""
    if not r.client_cpu:
        return "-"
    return f"{len(r.client_cpu)}x max {max(u.core_share for u in r.client_cpu):.0%}"


def results_table(report: BenchReport) -> Table:
    t = Table(title=f"minisgl bench — {report.meta.get('model', '?')} on {report.meta.get('device', '?')}")
    client = any(r.client_cpu for r in report.results)  # the column only where a client measured itself
    spec = any(r.metrics.accept_length is not None for r in report.results)  # and where an engine speculated
    for col in ("engine", "case", "conc", "reqs", "ok", "in tok", "out tok", "cached", "dur s", "req/s",
                "out tok/s", "total tok/s", "TTFT p50/p99 ms", "TPOT p50 ms", "ITL p50 ms", "E2E p50/p99 ms",
                *(["accept len"] if spec else []), *(["client CPU"] if client else [])):
        t.add_column(col, justify="left" if col in ("engine", "case") else "right")
    for r in report.results:
        m = r.metrics
        t.add_row(  # escaped: "minisgl[hf]" is a name, not rich markup
            escape(r.engine), escape(r.case), str(r.concurrency), str(r.num_requests), str(m.completed),
            str(m.total_input_tokens), str(m.total_output_tokens),
            "-" if m.total_cached_tokens is None else str(m.total_cached_tokens),
            f"{m.duration_s:.2f}", f"{m.request_throughput:.2f}", f"{m.output_throughput:.1f}",
            f"{m.total_throughput:.1f}",
            f"{_ms(m.ttft_ms.median, m.ttft_ms.count)}/{_ms(m.ttft_ms.p99, m.ttft_ms.count)}",
            _ms(m.tpot_ms.median, m.tpot_ms.count), _ms(m.itl_ms.median, m.itl_ms.count),
            f"{m.e2e_latency_ms.median:.1f}/{m.e2e_latency_ms.p99:.1f}",
            *([f"{m.accept_length:.2f}" if m.accept_length is not None else "-"] if spec else []),
            *([_client(r)] if client else []),
        )
    return t


def print_report(report: BenchReport, console: Console) -> None:
    console.print(results_table(report))
    for note in report.notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    for line in summary_lines(report):
        console.print(line, highlight=False, markup=False, soft_wrap=True)


# --- plot ---------------------------------------------------------------------------------------


def write_plot(report: BenchReport, path: str | Path) -> None:
    """Three panels: output throughput, TTFT and E2E latency (median bar, p99 tick) per engine per case.

    matplotlib is imported here only: it is an optional extra (`pip install 'minisgl[bench]'`).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or 'minisgl[bench]')") from None

    # Cases along x; one bar series per (engine, concurrency), so a sweep and a c=1 baseline sit side by side.
    groups = list(dict.fromkeys(r.case for r in report.results))
    series = list(dict.fromkeys((r.engine, r.concurrency) for r in report.results))
    by_key = {(r.engine, r.concurrency, r.case): r for r in report.results}
    fig, axes = plt.subplots(3, 1, figsize=(max(7.0, 0.5 * len(groups) * len(series) + 3), 11))
    width = 0.8 / max(1, len(series))
    panels = [
        ("output throughput (tok/s)", lambda m: (m.output_throughput, None)),
        (
            "TTFT ms (bar p50, tick p99)",
            lambda m: (m.ttft_ms.median, m.ttft_ms.p99) if m.ttft_ms.count else (0.0, None),
        ),
        ("E2E latency ms (bar p50, tick p99)", lambda m: (m.e2e_latency_ms.median, m.e2e_latency_ms.p99)),
    ]
    for ax, (title, pick) in zip(axes, panels):
        for i, (engine, conc) in enumerate(series):
            xs, bars, ticks = [], [], []
            for g, group in enumerate(groups):
                r = by_key.get((engine, conc, group))
                if r is None:
                    continue
                bar, tick = pick(r.metrics)
                x = g - 0.4 + width * (i + 0.5)
                xs.append(x)
                bars.append(bar)
                if tick is not None:
                    ticks.append((x, tick))
            ax.bar(xs, bars, width=width * 0.95, label=f"{engine} c={conc}")
            if ticks:
                ax.scatter([x for x, _ in ticks], [y for _, y in ticks], marker="_", s=200, color="black", zorder=3)
        ax.set_title(title)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"minisgl bench: {report.meta.get('model', '?')} on {report.meta.get('device', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
