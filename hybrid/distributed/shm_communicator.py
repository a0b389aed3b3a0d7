"""Collectives between the ranks of one machine over a shared mapping with lock-free flags (the C++ side is
cpu_kernels/csrc/all_reduce.cpp): no gloo and no system call on the hot path. The all-reduce is a kernel on the
rank's `ShmCollectives`, which numbers the group's operations, so a CPU decode program records it.

The group's first rank creates the file under /dev/shm (O_EXCL, mode 0600) and hands its name to the others
through torch.distributed; once every rank has mapped it the file is unlinked, so nothing is left behind when a
rank dies, and every rank's pid is in it, so a rank waiting on one that died fails at once with
CommunicationError. A tensor larger than a buffer is reduced in pieces.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from cpu_kernels.moe import recordable
from hybrid.distributed.communicator import CommunicationError, Communicator
from hybrid.shm_orphans import create_owned

FLAG_LINE = 64
# Per rank and parity: one decode step's hidden states for hundreds of rows, or a step message of a long prefill.
DEFAULT_CAPACITY = 8 << 20
SPIN_US = 2000
# A peer that has not reached the same collective by then is dead or stuck (they run the same step).
TIMEOUT_S = 300.0
POLL_S = 1.0


class ShmCommunicator(Communicator):
    name = "shm"

    def __init__(self, group: dist.ProcessGroup | None, ranks: list[int], capacity: int = DEFAULT_CAPACITY,
                 alive: Callable[[], bool] = lambda: True):
        from cpu_kernels import _C

        self.rank, self.world = ranks.index(dist.get_rank()), len(ranks)
        self.capacity, self.alive = capacity, alive
        size = len(ranks) * FLAG_LINE + 2 * len(ranks) * capacity
        names: list[str | None] = [None]
        if self.rank == 0:
            names = [str(create_owned(f"hybridd-tp-{os.getuid()}-"))]
        try:
            if self.rank == 0:
                fd = os.open(names[0], os.O_RDWR)
                try:
                    os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
            dist.broadcast_object_list(names, src=ranks[0], group=group)
            fd = os.open(names[0], os.O_RDWR)
            try:
                self.map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)
            self.group = _C.ShmGroup(self.buffer.data_ptr(), self.world, self.rank, capacity, SPIN_US)
            _C.shm_publish_pid(self.group)
            dist.barrier(group=group)
        finally:  # every rank has it mapped, or the group failed to form: either way the name goes
            if self.rank == 0:
                os.unlink(names[0])
        # A rank that dies then fails its peers' collectives at once (not at TIMEOUT_S), where every rank's pid
        # means the same process here: all ranks in this pid namespace.
        own = _C.shm_pid_namespace(self.group, self.rank)
        if own and all(_C.shm_pid_namespace(self.group, r) == own for r in range(self.world)):
            self.group = _C.ShmGroup(self.buffer.data_ptr(), self.world, self.rank, capacity, SPIN_US, watch=True)
        # Numbers every operation; its all_reduce is a kernel, recorded into a rank's decode programs.
        self.collectives = _C.ShmCollectives(self.group, int(TIMEOUT_S * 1e6))
        self._C = _C

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous() or t.device.type != "cpu":
            raise CommunicationError(f"the shared-memory all-reduce sums contiguous float32 / bfloat16 CPU tensors, "
                                     f"got {t.dtype} on {t.device}")
        recordable(self.collectives).all_reduce(t.data_ptr(), t.numel(), t.dtype == torch.bfloat16)
        return t

    def broadcast(self, payload: bytes | None, root: int = 0) -> bytes:
        if self.rank == root:
            if len(payload) + 8 > self.capacity:  # refused before any rank sees it: the group stays in step
                raise ValueError(f"a {len(payload)}-byte message does not fit the {self.capacity}-byte "
                                 "shared-memory buffer")
            seq = self.collectives.next_seq()
            if not self._C.shm_broadcast_send_bytes(self.group, seq, payload, int(TIMEOUT_S * 1e6)):
                raise CommunicationError(f"tensor-parallel rank {self.rank}: a peer did not finish operation "
                                         f"{seq - 2} within {TIMEOUT_S:.0f} s")
            return payload
        seq = self.collectives.next_seq()
        # The root may be idle for hours (no requests): wait in slices and give up only if it is gone.
        try:
            while (message := self._C.shm_broadcast_receive_bytes(self.group, seq, root, int(POLL_S * 1e6))) is None:
                if not self.alive():
                    raise CommunicationError(f"tensor-parallel rank {self.rank}: the driving rank is gone")
        except RuntimeError as e:  # a length past the buffer: the mapping was written by something else
            raise CommunicationError(f"tensor-parallel rank {self.rank}: {e}") from e
        return message

    def close(self) -> None:
        self.collectives.close()  # a decode program recorded over it may outlive this communicator
        self.buffer = None
        with contextlib.suppress(BufferError):  # a tensor view still alive: the mapping goes with the process
            self.map.close()
