"""Which cores the kernel thread pool runs on: the process's allowed CPUs, grouped by NUMA node."""

from __future__ import annotations

import os
from pathlib import Path


def _cpulist(text: str) -> list[int]:
    cpus = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


# Read once: the kernel pool pins the thread that calls it, and a mask read after that would be one core.
ALLOWED_CPUS = sorted(os.sched_getaffinity(0))


def unpin_child() -> None:
    """preexec_fn for processes started from a thread the pool pinned: give them every allowed core back."""
    os.sched_setaffinity(0, ALLOWED_CPUS)


def numa_nodes() -> list[list[int]]:
    """Allowed CPUs of each NUMA node (one node holding every allowed CPU where sysfs says nothing)."""
    allowed = ALLOWED_CPUS
    nodes = []
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpus = [c for c in _cpulist((node / "cpulist").read_text()) if c in allowed]
        if cpus:
            nodes.append(cpus)
    return nodes or [allowed]


def default_cpus(num_threads: int | None = None) -> list[int]:
    """Cores for `num_threads` pool threads (default: every allowed core), filling one NUMA node before the next.
    Thread 0 is the calling thread, pinned to the first of them from its first kernel call on."""
    cpus = [c for node in numa_nodes() for c in node]
    n = len(cpus) if num_threads is None else num_threads
    if n < 1:
        raise ValueError(f"the kernel thread pool needs at least one thread, got {n}")
    return [cpus[i % len(cpus)] for i in range(n)]
