"""A request/reply channel between two processes of one machine over a shared mapping: the two-rank ShmGroup
of cpu_kernels/csrc/all_reduce.cpp, each message a broadcast from its sender. The sides take turns (a message,
then one back), and a side that waits spins before it sleeps, so back-to-back exchanges make no system call: on
the 2-core EPYC VM a message over a socket pair cost the sender 20-130 us (waking the receiver), this 1-2 us.

The creating side (rank 0) makes the file under /dev/shm (O_EXCL, mode 0600) and passes its path to the other,
which maps it; the creator unlinks it once the other side has spoken, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

from hybrid.distributed.shm_communicator import FLAG_LINE
from hybrid.shm_orphans import create_owned

DEFAULT_CAPACITY = 4 << 20
SPIN_US = 2000
SEND_TIMEOUT_S = 10.0


class ChannelError(RuntimeError):
    """A message that does not fit, or a peer that stopped taking its turn."""


class ShmChannel:
    def __init__(self, path: str, rank: int, capacity: int, spin_us: int = SPIN_US):
        from cpu_kernels import _C

        self._C, self.path, self.rank, self.capacity = _C, path, rank, capacity
        size = 2 * FLAG_LINE + 4 * capacity
        fd = os.open(path, os.O_RDWR)
        try:
            if rank == 0:
                os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self.map, dtype=torch.uint8)
        self.group = _C.ShmGroup(self.buffer.data_ptr(), 2, rank, capacity, spin_us)
        self.seq = 0

    @classmethod
    def create(cls, name: str, capacity: int = DEFAULT_CAPACITY) -> ShmChannel:
        """Rank 0, on a new file; hand `path` (and `capacity`) to the other process."""
        path = str(create_owned(f"hybridd-{name}-{os.getuid()}-"))
        try:
            return cls(path, 0, capacity)
        except BaseException:
            os.unlink(path)
            raise

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def send(self, payload: bytes) -> None:
        if len(payload) + 8 > self.capacity:
            raise ChannelError(f"a {len(payload)}-byte message does not fit the {self.capacity}-byte channel")
        if not self._C.shm_broadcast_send_bytes(self.group, self.seq + 1, payload, int(SEND_TIMEOUT_S * 1e6)):
            raise ChannelError(f"the other side did not take its turn within {SEND_TIMEOUT_S:.0f} s")
        self.seq += 1

    def receive(self, timeout_s: float) -> bytes | None:
        """The other side's next message, or None when it has not come within timeout_s (call again)."""
        try:
            payload = self._C.shm_broadcast_receive_bytes(self.group, self.seq + 1, 1 - self.rank,
                                                          int(timeout_s * 1e6))
        except RuntimeError as e:  # a length past the buffer: the mapping was written by something else
            raise ChannelError(str(e)) from e
        if payload is not None:
            self.seq += 1
        return payload

    def close(self) -> None:
        self.buffer = None
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
            self.map.close()
