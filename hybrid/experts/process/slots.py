"""Shared-memory call slots between an engine and the expert process: the per-layer data path.

One shared-memory block per client holds `num_slots` slots (two allow the dual-batch overlap to keep
two calls in flight). A slot is a small int64 control header, an error-text area, and the hidden
states, top-k ids, top-k weights and output of one per-layer MoE call, each 64-byte aligned. Calls are
copied in, signalled and served by C++ (cpu_kernels/csrc/slot_channel.*): spin, then a shared futex on
the sequence words.
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from cpu_kernels.thread_pool import env_microseconds

ALIGN = 64
CTRL_WORDS = 10  # int64 control words, as cpu_kernels/csrc/slot_channel.h's CtrlWord
ERROR_BYTES = 1024
DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1}
ECHO_LAYER = -1  # the server copies x to out without computing: measures the dispatch round trip alone
# Microseconds a waiter spins on a sequence word before sleeping on it: the server's slot loop waiting
# for the next call (HYBRIDD_DOORBELL_SPIN_US) and the engine waiting for a result (HYBRIDD_CLIENT_SPIN_US).
SPIN_US = env_microseconds("HYBRIDD_DOORBELL_SPIN_US", 20)
CLIENT_SPIN_US = env_microseconds("HYBRIDD_CLIENT_SPIN_US", SPIN_US)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets inside one slot for calls of up to max_tokens x max_topk (activations up to fp32)."""

    hidden: int
    max_tokens: int
    max_topk: int

    def __post_init__(self) -> None:
        if min(self.hidden, self.max_tokens, self.max_topk) < 1:
            raise ValueError("slot dimensions must be positive")

    @property
    def ctrl(self) -> int:
        return 0

    @property
    def error(self) -> int:
        return _align(8 * CTRL_WORDS)

    @property
    def x(self) -> int:
        return _align(self.error + ERROR_BYTES)

    @property
    def ids(self) -> int:
        return _align(self.x + 4 * self.max_tokens * self.hidden)

    @property
    def weights(self) -> int:
        return _align(self.ids + 4 * self.max_tokens * self.max_topk)

    @property
    def out(self) -> int:
        return _align(self.weights + 4 * self.max_tokens * self.max_topk)

    @property
    def size(self) -> int:
        return _align(self.out + 4 * self.max_tokens * self.hidden)


class ExpertSlots:
    """Views of every slot of one client's shared-memory block (created by the server, attached by the client)."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: SlotLayout, num_slots: int):
        if shm.size < layout.size * num_slots:
            raise ValueError(f"shared memory {shm.name} holds {shm.size} bytes, slots need {layout.size * num_slots}")
        self.shm, self.layout, self.num_slots = shm, layout, num_slots
        self._base = torch.frombuffer(shm.buf, dtype=torch.uint8, count=layout.size * num_slots)

    @classmethod
    def create(cls, name: str, layout: SlotLayout, num_slots: int) -> "ExpertSlots":
        return cls(shared_memory.SharedMemory(name=name, create=True, size=layout.size * num_slots), layout, num_slots)

    @classmethod
    def attach(cls, name: str, layout: SlotLayout, num_slots: int) -> "ExpertSlots":
        """Maps a block the server created. The server owns it: a client exiting must not unlink it, which
        Python < 3.13's resource tracker would do for every attached block."""
        try:
            shm = shared_memory.SharedMemory(name=name, track=False)
        except TypeError:
            shm = shared_memory.SharedMemory(name=name)
            resource_tracker.unregister(shm._name, "shared_memory")
        return cls(shm, layout, num_slots)

    def slot_ptr(self, slot: int) -> int:
        """Address of a slot in this process's mapping, for the C++ data path (cpu_kernels slot_channel)."""
        return self._base.data_ptr() + slot * self.layout.size

    def offsets(self):
        from cpu_kernels import _C

        lay = self.layout
        return _C.SlotOffsets(error=lay.error, error_bytes=ERROR_BYTES, x=lay.x, ids=lay.ids, weights=lay.weights,
                              out=lay.out, hidden=lay.hidden, max_tokens=lay.max_tokens, max_topk=lay.max_topk)

    def close(self) -> None:
        self._base = None
        try:
            self.shm.close()
        except BufferError:
            pass  # a view is still referenced somewhere; the mapping goes away with the process
