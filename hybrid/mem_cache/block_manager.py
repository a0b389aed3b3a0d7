"""Allocation of fixed-size KV-cache blocks to sequences."""

from __future__ import annotations

from collections import deque
from typing import Protocol


class HoldsBlocks(Protocol):
    """What the block manager allocates to: anything with a block table (a Sequence)."""

    block_table: list[int]


class BlockManager:
    """A free list of block ids; a sequence's block table grows as its tokens are computed."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, seq: HoldsBlocks, num_tokens: int) -> int:
        """Extra blocks for the cache to hold `num_tokens` tokens of seq."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: HoldsBlocks, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: HoldsBlocks, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        seq.block_table.extend(self.free.popleft() for _ in range(need))

    def release(self, seq: HoldsBlocks) -> None:
        self.free.extend(seq.block_table)
        seq.block_table = []
