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


def test_the_decode_rate_reads_the_speed_of_the_steps_not_the_idle_time_after_them():
    """/metrics' decode_tok_s: a request decoding at 20 tok/s reads 20 until its steps leave the window, however
    long after it ended /metrics is read (it used to read 5.5 here: the idle time counted)."""
    rate = RollingRate(window=10.0, active=True)
    t = 1000.0
    for i in range(61):  # one token every 50 ms for 3 s
        rate.add(1, now=t + 0.05 * i)
    assert 19.5 < rate.rate(now=t + 3.0) < 20.5
    assert 19.5 < rate.rate(now=t + 9.0) < 20.5  # read 6 s after the request ended
    assert rate.rate(now=t + 14.0) == 0.0
