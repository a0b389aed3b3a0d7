"""Which cores the kernel thread pool runs on: the process's allowed CPUs, grouped by NUMA node into sub-pools."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch


def _cpulist(text: str) -> list[int]:
    cpus = []
    for part in text.strip().split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        elif part:
            cpus.append(int(part))
    return cpus


def env_microseconds(name: str, default: int) -> int:
    """A spin time in microseconds from the environment variable `name`, refused naming it when it is not one."""
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**31:
        raise ValueError(f"{name}={text!r}: wants microseconds, an integer in [0, 2**31)")
    return value


# Read once: the kernel pool pins the thread that calls it, and a mask read after that would be one core.
ALLOWED_CPUS = sorted(os.sched_getaffinity(0))

# Microseconds an idle pool worker polls for the next call before sleeping on a futex. Waking a sleeping
# worker took ~200 us on a KVM guest (2-core Zen 3: a 1 MB fp8 linear followed by an 80 us RMSNorm, in a loop,
# took 383 us per pair with 50 us of spin and 180 us with 1000), and a decode step leaves 100-500 us of torch
# work between kernel calls, so workers keep polling through a step. HYBRIDD_POOL_SPIN_US overrides it.
POOL_SPIN_US = env_microseconds("HYBRIDD_POOL_SPIN_US", 2000)
# The spin of pools whose cores another hybridd process computes on between their calls (the engine and its
# expert process): a polling worker would take turns on a core the other process's worker needs.
SHARED_CORE_SPIN_US = 50


def restrict_cpus(cpus: list[int]) -> None:
    """Confines this process, and the kernel pool it has not started yet, to `cpus` (a parallel rank's NUMA
    node): the pool lays its threads over ALLOWED_CPUS at its first call."""
    global ALLOWED_CPUS
    os.sched_setaffinity(0, cpus)
    ALLOWED_CPUS = sorted(os.sched_getaffinity(0))


def unpin_child() -> None:
    """preexec_fn for processes started from a thread the pool pinned: give them every allowed core back."""
    os.sched_setaffinity(0, ALLOWED_CPUS)


_torch_team = threading.local()


def start_torch_threads() -> None:
    """Starts the calling thread's torch (OpenMP) worker threads on every allowed core, if torch would use
    more than this has started. A thread the pool pinned keeps one core, and threads inherit their creator's
    mask: torch starts a thread's team at its first large op, so a team started after the first kernel call
    would share that one core (an index_add_ took 60 ms instead of 0.1 ms on two cores)."""
    n = torch.get_num_threads()
    if getattr(_torch_team, "threads", 1) >= n:
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALLOWED_CPUS)
    try:
        torch.zeros(n << 16).add_(1)  # 2n of torch's 32768-element grains: one parallel region of n threads
    finally:
        os.sched_setaffinity(0, own)
    _torch_team.threads = n


def numa_nodes() -> list[list[int]]:
    """Allowed CPUs of each NUMA node (one node holding every allowed CPU where sysfs says nothing).
    HYBRIDD_NUMA_NODES="0-15;16-31" overrides the topology (cpulists separated by ';'): to keep the pool on
    some nodes, or to run the multi-node task split on a one-node machine."""
    allowed = ALLOWED_CPUS
    override = os.environ.get("HYBRIDD_NUMA_NODES", "").strip()
    if override:
        try:
            lists = [_cpulist(part) for part in override.split(";")]
        except ValueError:
            raise ValueError(f"HYBRIDD_NUMA_NODES={override!r}: wants cpulists separated by ';', e.g. "
                             "\"0-15;16-31\"") from None
    else:
        lists = [_cpulist((node / "cpulist").read_text())
                 for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"), key=lambda p: int(p.name[4:]))]
    nodes = [cpus for cpus in ([c for c in lst if c in allowed] for lst in lists) if cpus]
    if override and not nodes:
        raise ValueError(f"HYBRIDD_NUMA_NODES={override!r} names none of this process's CPUs {allowed}")
    return nodes or [allowed]


def pool_layout(num_threads: int | None = None) -> tuple[list[int], list[int]]:
    """(core, NUMA node) of each of `num_threads` pool threads (default: every allowed core), filling one node
    before the next. Thread 0 is the calling thread, pinned to the first core from its first kernel call on."""
    placed = [(cpu, n) for n, cpus in enumerate(numa_nodes()) for cpu in cpus]
    count = len(placed) if num_threads is None else num_threads
    if count < 1:
        raise ValueError(f"the kernel thread pool needs at least one thread, got {count}")
    chosen = [placed[i % len(placed)] for i in range(count)]
    used = sorted({n for _, n in chosen})  # sub-pools are numbered 0.. over the nodes actually used
    return [c for c, _ in chosen], [used.index(n) for _, n in chosen]
