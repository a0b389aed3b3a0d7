"""The prefix-cache interface the block manager allocates through: which cached KV blocks a new sequence can
reuse, which of its computed blocks become reusable, and which unused cached block to give up for a new one.

The block manager owns reference counts and the plain free list; a prefix cache owns what cached blocks hold
and the order in which unused ones are evicted. A block is in exactly one place: in use by sequences (ref > 0),
free without content, or cached and unused (evictable).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol


class CachingSequence(Protocol):
    """What the block manager and a prefix cache read and keep on a sequence (a Sequence)."""

    token_ids: list[int]
    cache_salt: str | None  # a request's own salt: its blocks match only blocks of the same salt
    num_computed_tokens: int
    block_table: list[int]
    block_hashes: list[bytes]
    num_indexed_blocks: int


class PrefixCache(ABC):
    @abstractmethod
    def match(self, seq: CachingSequence, max_blocks: int) -> list[int]:
        """The cached blocks holding seq's first full blocks, longest run first to last, at most max_blocks."""

    @abstractmethod
    def index(self, seq: CachingSequence) -> None:
        """Makes seq's full blocks whose KV is computed reusable by later sequences."""

    @abstractmethod
    def holds(self, block: int) -> bool:
        """Whether the block holds cached content (so it is parked, not freed, when no sequence uses it)."""

    @abstractmethod
    def park(self, block: int) -> None:
        """A cached block no sequence uses any more: evictable, most recently used."""

    @abstractmethod
    def revive(self, block: int) -> None:
        """A parked block that a sequence uses again: no longer evictable."""

    @abstractmethod
    def evict(self) -> int:
        """Forgets the least recently used parked block's content and returns the block."""

    @property
    @abstractmethod
    def num_evictable(self) -> int:
        """Parked blocks: free for allocation, reusable until evicted."""

    @property
    @abstractmethod
    def num_cached(self) -> int:
        """Blocks holding cached content, in use or parked."""
