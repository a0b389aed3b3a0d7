"""Builds the cpu_kernels C++ extension; everything else is in pyproject.toml.

No -march flags: the AVX-512 kernels carry per-function target attributes and are chosen at run time,
so the same build runs (more slowly) on CPUs without those extensions instead of dying with SIGILL.
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "cpu_kernels._C",
            sources=[
                "cpu_kernels/csrc/all_reduce.cpp",
                "cpu_kernels/csrc/amx.cpp",
                "cpu_kernels/csrc/attention.cpp",
                "cpu_kernels/csrc/binding.cpp",
                "cpu_kernels/csrc/elementwise.cpp",
                "cpu_kernels/csrc/logits_scan.cpp",
                "cpu_kernels/csrc/moe.cpp",
                "cpu_kernels/csrc/norm.cpp",
                "cpu_kernels/csrc/rope.cpp",
                "cpu_kernels/csrc/row_ops.cpp",
                "cpu_kernels/csrc/routing.cpp",
                "cpu_kernels/csrc/slot_channel.cpp",
                "cpu_kernels/csrc/thread_pool.cpp",
                "cpu_kernels/csrc/tile_dot_avx2.cpp",
                "cpu_kernels/csrc/tile_dot_avx512f.cpp",
                "cpu_kernels/csrc/tile_dot_vnni.cpp",
                "cpu_kernels/csrc/tile_layout.cpp",
            ],
            include_dirs=["cpu_kernels/csrc"],
            # -ffp-contract=off: a product and a sum written apart round apart, also in functions built for
            # FMA CPUs (GCC would fuse them there); FMAs happen only where the code calls an fmadd intrinsic.
            extra_compile_args=["-O3", "-std=c++20", "-ffp-contract=off", "-Wall", "-Wextra",
                                "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
        )
    ],
)
