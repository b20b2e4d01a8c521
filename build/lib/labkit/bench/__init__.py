"""Benchmarks: ``python -m labkit bench NAME``. Timings are compared side by side in one run,
as ratios, because wall-clock times on a shared machine are noisy."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def median_time(fn: Callable[[], Any], iters: int, warmup: int = 1) -> tuple[float, Any]:
    """Call ``fn`` ``warmup`` times untimed, then ``iters`` times timed; return
    ``(median seconds per call, the last call's return value)``."""
    value = None
    for _ in range(warmup):
        value = fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value
