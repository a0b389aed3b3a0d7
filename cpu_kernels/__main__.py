"""`python -m cpu_kernels`: the CPU features found and the kernel path chosen."""

from __future__ import annotations

from cpu_kernels.cpu_features import PATHS, best_path, cpu_flags
from cpu_kernels.moe import kernel_isa_name
from cpu_kernels.thread_pool import POOL_SPIN_US, numa_nodes, pool_layout


def main() -> None:
    flags = cpu_flags()
    wanted = sorted({f for _, needed in PATHS for f in needed})
    print("cpu features: " + " ".join(f"{f}{'+' if f in flags else '-'}" for f in wanted))
    print(f"best instruction set: {best_path()}")
    print(f"kernel path: {kernel_isa_name()}")
    print(f"numa nodes: {len(numa_nodes())} ({'; '.join(','.join(map(str, n)) for n in numa_nodes())})")
    cpus, nodes = pool_layout()
    print(f"thread pool cores: {','.join(map(str, cpus))} (thread 0 is the calling thread), sub-pool per core: "
          f"{','.join(map(str, nodes))}")
    print(f"idle workers poll {POOL_SPIN_US} us before sleeping (HYBRIDD_POOL_SPIN_US)")


if __name__ == "__main__":
    main()
