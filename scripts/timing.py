"""Median wall time of repeated calls, the statistic every benchmark here reports."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[int], object], reps: int) -> float:
    """Median seconds of fn(0), ..., fn(reps - 1)."""
    times = []
    for r in range(reps):
        t = time.perf_counter()
        fn(r)
        times.append(time.perf_counter() - t)
    return statistics.median(times)
