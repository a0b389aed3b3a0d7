"""Allocation of fixed-size KV-cache blocks to sequences, with reference counts so that sequences can share
the blocks of a common prefix through a prefix cache (prefix_cache.py)."""

from __future__ import annotations

from collections import deque

from hybrid.mem_cache.prefix_cache import CachingSequence, PrefixCache


class BlockManager:
    """Blocks in use carry a reference count; freed blocks go back to the free list, or, when they hold cached
    content, to the prefix cache, which keeps them reusable until a new block needs one."""

    def __init__(self, num_blocks: int, block_size: int, prefix_cache: PrefixCache | None = None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: deque[int] = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.cache = prefix_cache

    @property
    def num_free(self) -> int:
        """Blocks a sequence can be given: empty ones and cached ones no sequence uses."""
        return len(self.free) + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached if self.cache else 0

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, seq: CachingSequence, num_tokens: int) -> int:
        """Extra blocks for the cache to hold `num_tokens` tokens of seq."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_grow(self, seq: CachingSequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free

    def _take(self) -> int:
        block = self.free.popleft() if self.free else self.cache.evict()
        self.ref[block] = 1
        return block

    def grow(self, seq: CachingSequence, num_tokens: int) -> None:
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {need} blocks, {self.num_free} free")
        seq.block_table.extend(self._take() for _ in range(need))

    def match_prefix(self, seq: CachingSequence) -> int:
        """Gives a sequence without blocks the cached blocks of its longest cached prefix of full blocks, always
        leaving at least one token to compute; returns the tokens reused (its num_computed_tokens now)."""
        if self.cache is None or seq.block_table:
            return 0
        for block in self.cache.match(seq, (len(seq.token_ids) - 1) // self.block_size):
            if self.ref[block] == 0:
                self.cache.revive(block)
            self.ref[block] += 1
            seq.block_table.append(block)
        seq.num_indexed_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_indexed_blocks * self.block_size
        return seq.num_computed_tokens

    def cache_computed(self, seq: CachingSequence) -> None:
        """Makes the sequence's newly computed full blocks reusable."""
        if self.cache is not None:
            self.cache.index(seq)

    def release(self, seq: CachingSequence) -> None:
        """Drops the sequence's references; with its blocks goes its computed KV (num_computed_tokens 0), undoing
        match_prefix as well as grow. Cached blocks are parked tail first, so that an evicting cache gives up a
        sequence's last blocks before its prefix; empty ones rejoin the free list in table order."""
        emptied = []
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if self.cache is not None and self.cache.holds(block):
                    self.cache.park(block)
                else:
                    emptied.append(block)
        self.free.extend(reversed(emptied))
        seq.block_table = []
        seq.num_indexed_blocks = 0
        seq.num_computed_tokens = 0
