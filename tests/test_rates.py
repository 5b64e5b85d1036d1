"""The throughput figures of /metrics and the REPL cover a recent window, not the average since start."""

from __future__ import annotations

from minisgl_cli.scheduler.stats import RollingRate


def test_a_burst_reads_at_its_own_rate_then_fades_after_the_window():
    rate = RollingRate(window=10.0)
    t = 1000.0  # long after start: an average since start would read far lower
    for i in range(50):  # 256 tokens every 20 ms for a second: 12,800 tok/s
        rate.add(256, now=t + 0.02 * i)
    assert 12_000 < rate.rate(now=t + 1.0) < 13_500
    assert rate.rate(now=t + 5.0) < 3_000  # the burst is in the window, spread over 5 s now
    assert rate.rate(now=t + 11.0) == 0.0  # a window after it ended
