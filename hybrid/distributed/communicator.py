"""The collectives a tensor-parallel group needs (sum a tensor over the ranks, send the driver's step to the
others) behind one interface, and their torch.distributed (gloo) implementation: the reference and the fallback
where the ranks do not share a machine. The shared-memory one is in shm_communicator.py."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from cpu_kernels import _C

# A collective could not finish: a peer rank died, hung or sent something unreadable. The shared-memory all-reduce
# raises it from C++, in an eager call or a replayed decode program alike.
CommunicationError = _C.CommunicationError


class Communicator(ABC):
    """Collectives among `world` ranks; every rank calls the same operations in the same order."""

    name: str
    rank: int
    world: int

    @abstractmethod
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums `t` over the ranks, in place; returns it. Every rank ends with the same bits."""

    @abstractmethod
    def broadcast(self, payload: bytes | None, root: int = 0) -> bytes:
        """The root's payload, on every rank (the root passes it, the others pass None)."""

    def close(self) -> None:
        """Releases what the communicator maps or holds."""


class GlooCommunicator(Communicator):
    """torch.distributed collectives on a gloo group."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int]):
        self.group, self.ranks = group, ranks
        self.rank, self.world = ranks.index(dist.get_rank()), len(ranks)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, payload: bytes | None, root: int = 0) -> bytes:
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=self.ranks[root], group=self.group)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None and payload
                else torch.empty(int(length), dtype=torch.uint8))
        if int(length):
            dist.broadcast(data, src=self.ranks[root], group=self.group)
        return payload if payload is not None else data.numpy().tobytes()
