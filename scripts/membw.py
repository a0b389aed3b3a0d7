"""The memory system as benchmarks see it: the membw.c read-bandwidth probe (built and run here) and the
last-level cache size, so working sets can be made large enough that nothing is served from cache."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from cpu_kernels.thread_pool import unpin_child

SOURCE = Path(__file__).with_name("membw.c")


def _binary() -> Path:
    out = Path(tempfile.gettempdir()) / f"hybridd-membw-{os.getuid()}"
    if not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", str(SOURCE), "-o", str(out)], check=True)
    return out


def read_bandwidth_gbps(threads: int, mib: int = 1024, reps: int = 7) -> float:
    """Best-of-reps read bandwidth in GB/s over a buffer far larger than the caches."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="close")
    # unpin_child: the kernel pool pins the thread that calls it to one core, and a probe started from that
    # thread would otherwise run all its threads there and report half the bandwidth.
    res = subprocess.run([str(_binary()), str(mib), str(reps)], capture_output=True, text=True, env=env, check=True,
                         preexec_fn=unpin_child)
    line = res.stdout.strip().splitlines()[-1].split()
    return float(line[1])


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
