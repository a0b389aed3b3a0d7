"""Which cores each rank on a machine runs on: whole NUMA nodes per rank where there are enough of them (the
rank's weights then live in its node's memory), else an even split of the cores."""

from __future__ import annotations


def rank_cpus(local_rank: int, local_world: int) -> list[int]:
    """The cores of rank `local_rank` of `local_world` ranks on this machine (HYBRIDD_NUMA_NODES overrides the
    topology, e.g. "0;1" for two one-core nodes)."""
    from cpu_kernels.thread_pool import numa_nodes

    nodes = numa_nodes()
    if len(nodes) >= local_world:
        per = len(nodes) // local_world
        return [c for node in nodes[local_rank * per:(local_rank + 1) * per] for c in node]
    cpus = [c for node in nodes for c in node]
    if len(cpus) < local_world:
        return [cpus[local_rank % len(cpus)]]
    per = len(cpus) // local_world
    return cpus[local_rank * per:(local_rank + 1) * per]
