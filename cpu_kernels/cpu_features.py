"""Which x86 SIMD extensions this CPU has, read from /proc/cpuinfo, and the best kernel path they allow.

The avx512 path needs AVX-512 F/BW/VL/DQ (Skylake-SP and later); the avx512_vnni path VNNI (int8/int4) too
(Cascade Lake, Ice Lake); the avx512_bf16 path BF16, VBMI (fp8 byte tables) and GFNI (fp8 bit maps) on top of
that, as csrc/moe.cpp checks; the amx path is that one plus
AMX tiles, which Linux must also grant the process (csrc/amx.cpp asks)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
AVX512_VNNI = AVX512 | {"avx512_vnni"}
AVX512_BF16 = AVX512_VNNI | {"avx512_bf16", "avx512vbmi", "gfni"}
PATHS = [
    ("amx", AVX512_BF16 | {"amx_tile", "amx_bf16", "amx_int8"}),
    ("avx512_bf16", AVX512_BF16),
    ("avx512_vnni", AVX512_VNNI),
    ("avx512", AVX512),
    ("avx2", {"avx2", "fma"}),
]


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def best_path(flags: frozenset[str] | None = None) -> str:
    """The fastest kernel path every required flag of which is present; 'generic' otherwise."""
    flags = cpu_flags() if flags is None else flags
    for name, needed in PATHS:
        if needed <= flags:
            return name
    return "generic"
