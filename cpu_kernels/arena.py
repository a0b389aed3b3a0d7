"""Memory that the intermediates of several kernel programs share when at most one of them runs at a time (the
decode programs of one engine, one per batch size).

While a program records into an `Arena` (cpu_kernels/program.py), every tensor it allocates is a range of the
arena's block, and a range whose tensors Python has dropped is handed out again to the recording's later
allocations (first fit). That reuse is safe because a tensor no Python object can reach is touched by no later
kernel call: the recorded calls that used the range all come before those that use it again. It requires that
recorded code pass addresses to kernels only from live tensors (never an address kept as an int, or held by a
C++ object, past its tensor), which the kernels' Python wrappers do. A program then
needs about one layer's live intermediates instead of every layer's, and every program of an arena starts at
its beginning, so the block is as large as the largest program's peak, not the sum of all.

A recording that needs more than the block goes on with plain allocations to learn how much; the caller grows
the arena and records again. Programs recorded into a block the arena has left keep that block alive and are
stale (`generation`): their owner records them again.
"""

from __future__ import annotations

import weakref

import torch

ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Arena:
    def __init__(self) -> None:
        self.block = torch.empty(0, dtype=torch.uint8)
        self.generation = 0

    @property
    def nbytes(self) -> int:
        return self.block.numel()

    def grow(self, nbytes: int) -> None:
        """A new block of at least nbytes; programs recorded into the old one become stale."""
        self.block = torch.empty(_align(nbytes), dtype=torch.uint8)
        self.generation += 1


class ArenaAllocator:
    """One recording's ranges of an arena's block; `peak` is the most of it the recording needed at once, and
    `fits` whether that was within the block."""

    def __init__(self, arena: Arena):
        self.block, self.generation = arena.block, arena.generation
        self._buffer = self.block.numpy()
        self._free: list[tuple[int, int]] = []  # [start, stop) ranges below peak, sorted, neighbours merged
        self.peak = 0
        self.fits = True

    def place(self, fresh: torch.Tensor) -> torch.Tensor:
        """A tensor of fresh's shape, strides and dtype over a free range of the block: fresh itself when the
        range lies past the block's end (the recording then only measures what it needs)."""
        n = _align(fresh.untyped_storage().nbytes())
        start = self._take(n)
        placed = fresh
        if start + n > self.block.numel():
            self.fits = False
        elif n:
            placed = torch.frombuffer(self._buffer, dtype=torch.uint8, count=n, offset=start).view(fresh.dtype)
            placed = placed.as_strided(fresh.shape, fresh.stride())
        # The storage outlives every view of the tensor: its range is free once nothing can reach it.
        weakref.finalize(placed.untyped_storage(), self._give, start, n)
        return placed

    def _take(self, n: int) -> int:
        for i, (a, b) in enumerate(self._free):
            if b - a >= n:
                self._free[i:i + 1] = [(a + n, b)] if b - a > n else []
                return a
        start = self.peak
        if self._free and self._free[-1][1] == self.peak:  # a free range at the top: extend it
            start = self._free.pop()[0]
        self.peak = start + n
        return start

    def _give(self, start: int, n: int) -> None:
        if not n:
            return
        ranges = sorted(self._free + [(start, start + n)])
        merged = [ranges[0]]
        for a, b in ranges[1:]:
            if a == merged[-1][1]:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        self._free = merged
