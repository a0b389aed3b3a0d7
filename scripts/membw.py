"""Builds and runs the membw.c read-bandwidth probe so benchmarks can report results against it."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("membw.c")


def _binary() -> Path:
    out = Path(tempfile.gettempdir()) / f"hybridd-membw-{os.getuid()}"
    if not out.exists() or out.stat().st_mtime < SOURCE.stat().st_mtime:
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", str(SOURCE), "-o", str(out)], check=True)
    return out


def read_bandwidth_gbps(threads: int, mib: int = 1024, reps: int = 7) -> float:
    """Best-of-reps read bandwidth in GB/s over a buffer far larger than the caches."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_PROC_BIND="close")
    res = subprocess.run([str(_binary()), str(mib), str(reps)], capture_output=True, text=True, env=env, check=True)
    line = res.stdout.strip().splitlines()[-1].split()
    return float(line[1])
