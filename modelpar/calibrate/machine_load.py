"""How busy this machine's CPUs are with other work, read just before a calibration and just after it.

A profile measured on cores that other processes share prices the machine slower than it runs when quiet, and a
cached profile is reused by every later run (``calibrate.cache``): seen here, a best fp32 GEMM of 131 GFLOP/s measured
beside another session's tests, 174 quiet. The calibration records the share (``HardwareProfile.cpu_busy``)
and says so when it is high (``profiles.busy_warning``), with how to measure again. It reads it twice, before its
processes start and after they end (``busier``): work that begins during a calibration is still running just after
it (seen, likely so: a first run's short calibration read 0% busy before it, as another session began running
tests, and measured the layer 1.34x the quiet profile's).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["busier", "cpu_busy_share"]


def _proc_stat() -> tuple[int, int]:
    """(all CPU time, idle time) in clock ticks since boot: /proc/stat's first line (user nice system idle iowait irq
    softirq steal; guest time is inside user already)."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return sum(ticks), ticks[3] + ticks[4]


def cpu_busy_share(window_s: float = 0.5, read: Callable[[], tuple[int, int]] = _proc_stat) -> float | None:
    """The share (0 to 1) of this machine's CPU time spent outside idle during ``window_s`` in which this process
    sleeps: other processes' work. None where it cannot be read (no /proc/stat)."""
    try:
        total0, idle0 = read()
        time.sleep(window_s)
        total1, idle1 = read()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return None if total <= 0 else min(1.0, max(0.0, 1 - (idle1 - idle0) / total))


def busier(before: float | None, after: float | None) -> float | None:
    """The calibration's busy share: the larger of the readings before and after it (None if neither was read)."""
    known = [share for share in (before, after) if share is not None]
    return max(known) if known else None
