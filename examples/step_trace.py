"""Read the scheduler's step traces (MINISGL_STEP_TRACE_DIR, scheduler/profile.py's StepTrace) and summarise each
burst of work: a run of launches with no idle gap over --gap seconds, i.e. one draw of a benchmark (or a warm-up).
What a slow draw did differently shows here: a few long steps (a compile, a collection) or many slower ones, fewer
rows a decode step (requests arriving late, or held back for pages), more prefill.

    MINISGL_STEP_TRACE_DIR=/tmp/trace minisgl bench ... ; python examples/step_trace.py /tmp/trace
    python examples/step_trace.py /tmp/trace --by-rows      # a step's ms by its kind and rows, over the whole trace

Columns: wall s (first to last launch), steps, decode steps, mean rows of a decode step, prefill tokens, the mean,
p99 and longest gap between launches in ms (a step's wall time), and the seconds spent in decode steps with fewer
than 90% of the burst's largest decode batch (the ramp up and the tail); the scheduler process's garbage collection
over the burst and its longest between two launches, in ms; with a benchmark's windows, the seconds from a draw's
start to its first launch and from its last launch to its end (the fronts' own share of the draw).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Burst:
    wall_s: float
    steps: int
    decode_steps: int
    mean_rows: float
    prefill_tokens: int
    mean_gap_ms: float
    p99_gap_ms: float
    max_gap_ms: float
    thin_s: float  # seconds of decode steps under 90% of the burst's largest batch
    gc_ms: float  # the scheduler's garbage collection over the burst
    gc_max_ms: float  # its longest between two launches
    lead_s: float = 0.0  # a window's start to its first launch: the fronts' ramp (requests on their way in)
    trail_s: float = 0.0  # its last launch to the window's end: the last tokens on their way out

    def line(self) -> str:
        return (f"{self.wall_s:7.2f} {self.steps:6d} {self.decode_steps:6d} {self.mean_rows:7.1f} "
                f"{self.prefill_tokens:9,d} {self.mean_gap_ms:7.2f} {self.p99_gap_ms:7.2f} {self.max_gap_ms:8.1f} "
                f"{self.thin_s:6.2f} {self.gc_ms:7.1f} {self.gc_max_ms:7.1f} {self.lead_s:6.3f} {self.trail_s:6.3f}")


HEADER = f"{'wall s':>7} {'steps':>6} {'decode':>6} {'rows':>7} {'prefill':>9} {'gap ms':>7} {'p99':>7} " \
         f"{'max':>8} {'thin s':>6} {'gc ms':>7} {'gc max':>7} {'lead s':>6} {'trail':>6}"


Launch = tuple[float, str, int, int, float]  # time, mode, rows, tokens, gc ms since the launch before


def read(path: Path) -> list[Launch]:
    """Each launch in one trace file."""
    out = []
    for line in path.read_text().splitlines()[1:]:
        t, mode, rows, tokens, _running, _waiting, gc_ms = line.split("\t")
        out.append((float(t), mode, int(rows), int(tokens), float(gc_ms)))
    return out


def bursts(launches: list[Launch], gap_s: float) -> list[Burst]:
    groups: list[list[Launch]] = []
    for launch in launches:
        if not groups or launch[0] - groups[-1][-1][0] > gap_s:
            groups.append([])
        groups[-1].append(launch)
    return [summarise(g) for g in groups if len(g) > 1]


def summarise(g: list[Launch]) -> Burst:
    gaps = [(b[0] - a[0], a) for a, b in zip(g, g[1:])]
    ms = sorted(d * 1e3 for d, _ in gaps)
    decode = [x for x in g if x[1] == "decode"]
    top = max((x[2] for x in decode), default=0)
    thin = sum(d for d, a in gaps if a[1] == "decode" and a[2] < 0.9 * top)
    rows = statistics.mean(x[2] for x in decode) if decode else 0.0
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return Burst(g[-1][0] - g[0][0], len(g), len(decode), rows, sum(x[3] for x in g if x[1] == "prefill"),
                 statistics.mean(ms), p99, ms[-1], thin, sum(x[4] for x in g[1:]), max(x[4] for x in g[1:]))


def windowed(launches: list[Launch], windows: list[tuple[float, float]]) -> list[Burst]:
    """One burst per (start, seconds) window: a benchmark's draws by their own clocks (bench JSON's started_at)."""
    out = []
    for t0, d in windows:
        g = [x for x in launches if t0 <= x[0] <= t0 + d]
        if len(g) > 1:
            out.append(dataclasses.replace(summarise(g), lead_s=g[0][0] - t0, trail_s=t0 + d - g[-1][0]))
    return out


def report(trace_dir: Path, gap_s: float = 0.3, windows: list[tuple[float, float]] | None = None) -> list[str]:
    """One header and a line per burst (or per window, where given), for each trace file under trace_dir."""
    lines = []
    for path in sorted(trace_dir.glob("*-trace.tsv")):
        found = windowed(read(path), windows) if windows else bursts(read(path), gap_s)
        if found:
            lines += [f"{path.name}: {len(found)} burst(s)", "  " + HEADER] + ["  " + b.line() for b in found]
    return lines


def by_rows(trace_dir: Path, rows: int = 16) -> list[str]:
    """A step's time (the gap to the next launch) by its mode and rows (rows past `rows` counted as `rows`+), over
    each trace file: how many, the median and p10 / p90 in ms (steps before an idle gap over 1 s left out)."""
    lines = []
    for path in sorted(trace_dir.glob("*-trace.tsv")):
        launches = read(path)
        times: dict[tuple[str, int], list[float]] = {}
        for a, b in zip(launches, launches[1:]):
            if b[0] - a[0] <= 1.0:
                times.setdefault((a[1], min(a[2], rows)), []).append((b[0] - a[0]) * 1e3)
        lines.append(f"{path.name}:")
        for (mode, n), ms in sorted(times.items()):
            ms.sort()
            p10, p90 = ms[len(ms) // 10], ms[len(ms) * 9 // 10]
            lines.append(f"  {mode:7s} {n:>4}{'+' if n == rows else ' '} rows: {len(ms):>5} steps, median "
                         f"{statistics.median(ms):.1f} ms, p10 {p10:.1f}, p90 {p90:.1f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--gap", type=float, default=0.3, help="idle seconds that end a burst")
    ap.add_argument("--by-rows", action="store_true", help="each step's time by its mode and rows instead")
    args = ap.parse_args()
    print("\n".join(by_rows(args.trace_dir) if args.by_rows else report(args.trace_dir, args.gap)))


if __name__ == "__main__":
    main()
