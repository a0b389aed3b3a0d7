"""The memory system as benchmarks see it: the membw.c read-bandwidth probe (built and run here), blocks of
measurements interleaved with probes, and the last-level cache size, so working sets can be made large enough
that nothing is served from cache."""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cpu_kernels.thread_pool import unpin_child

SOURCE = Path(__file__).with_name("membw.c")


def _binary() -> Path:
    out = Path(tempfile.gettempdir()) / f"hybridd-membw-{os.getuid()}"
    if not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", str(SOURCE), "-o", str(out)], check=True)
    return out


class BandwidthProbe:
    """A membw.c process that keeps its buffer between probes (started unpinned: the kernel pool pins the thread
    that calls it to one core, and a probe started from that thread would run all its threads there)."""

    def __init__(self, threads: int, mib: int = 1024):
        # passive: between probes its idle OpenMP threads would otherwise spin on the cores being measured
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="close", OMP_WAIT_POLICY="passive")
        self._proc = subprocess.Popen([str(_binary()), str(mib), "1", "serve"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env=env, preexec_fn=unpin_child)

    def gbps(self, reps: int = 2) -> float:
        """Best-of-reps read bandwidth in GB/s now."""
        self._proc.stdin.write(f"{reps}\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith("read_gbps"):
                return float(line.split()[1])
        raise RuntimeError(f"membw exited with {self._proc.wait()}")

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait()

    def __enter__(self) -> BandwidthProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class Interleaved:
    """Rates of measurement blocks run between probes, each block's over the mean of the probes either side."""

    rates: list[float]
    probes: list[float]
    call_s: list[float] = field(default_factory=list)  # seconds per call in each block, for blocks of calls

    @property
    def fractions(self) -> list[float]:
        return [r / ((a + b) / 2) for r, a, b in zip(self.rates, self.probes, self.probes[1:])]

    @property
    def fraction(self) -> float:
        """Median of the blocks' fractions of the bandwidth measured around them."""
        return statistics.median(self.fractions)

    @property
    def rate(self) -> float:
        return statistics.median(self.rates)

    @property
    def bandwidth(self) -> float:
        return statistics.median(self.probes)


def interleaved(probe: BandwidthProbe, block: Callable[[int], float], rounds: int) -> Interleaved:
    """probe, block(0), probe, block(1), ..., block(rounds - 1), probe. The machine's bandwidth moves within
    seconds on shared hosts, so a fraction of it compares a block only with probes taken right around it."""
    probes, rates = [probe.gbps()], []
    for r in range(rounds):
        rates.append(block(r))
        probes.append(probe.gbps())
    return Interleaved(rates, probes)


# Blocks of calls last about BLOCK_S seconds: long enough to average over calls, short next to the seconds
# over which the bandwidth of a shared host moves.
BLOCK_S = 0.15


def calls_per_block(call_s: float) -> int:
    return max(1, round(BLOCK_S / call_s))


def interleaved_calls(probe: BandwidthProbe, call: Callable[[int], int], per_block: int,
                      rounds: int) -> Interleaved:
    """Blocks of per_block calls between probes: call(i) for i = 0, 1, ... runs one call and returns the bytes
    it read; a block's rate is its bytes over its wall time."""
    call_s = []

    def block(b: int) -> float:
        start = time.perf_counter()
        read = sum(call(i) for i in range(b * per_block, (b + 1) * per_block))
        call_s.append((time.perf_counter() - start) / per_block)
        return read / (call_s[-1] * per_block) / 1e9

    res = interleaved(probe, block, rounds)
    res.call_s = call_s
    return res


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """Size of the largest cache sysfs lists for CPU 0 (the shared L3 on x86 servers)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index[0-9]*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=default)
