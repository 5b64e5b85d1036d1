"""Process CPU: a process's user + system seconds, from /proc/<pid>/stat (Linux; elsewhere unknown), and the cores
this process may use."""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the process has used so far; None where it is gone or /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The name (field 2) is in parentheses and may hold spaces: the fields that follow start after the last ")".
    fields = stat[stat.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime: fields 14 and 15 of stat(5)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask on Linux, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
