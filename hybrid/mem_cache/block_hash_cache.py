"""The prefix cache by chained block hashes (vLLM's automatic prefix caching): a full block of tokens is
identified by the hash of its token ids chained with the previous block's hash, the chain starting from a salt
that names what else changes a block's content (the model and compute dtype), chained with a request's own
cache_salt where it has one, so salted requests share blocks only with their salt. Equal hashes mean equal prefixes,
so a new sequence reuses the longest run of its leading blocks found in the index. Unused cached blocks are
evicted least recently used first, only when a new block is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from hybrid.mem_cache.prefix_cache import CachingSequence, PrefixCache


class BlockHashCache(PrefixCache):
    def __init__(self, block_size: int, salt: bytes):
        self.block_size, self.salt = block_size, salt
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.parked: OrderedDict[int, None] = OrderedDict()

    def hashes(self, seq: CachingSequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of seq's first num_blocks full blocks, extending the ones it already has."""
        chain, size = seq.block_hashes, self.block_size
        while len(chain) < num_blocks:
            i = len(chain)
            h = hashlib.blake2b(chain[-1] if chain else self.start(seq.cache_salt), digest_size=16)
            h.update(array("q", seq.token_ids[i * size:(i + 1) * size]).tobytes())
            chain.append(h.digest())
        return chain[:num_blocks]

    def start(self, cache_salt: str | None) -> bytes:
        """The chain's start: the cache's salt, or (a request's salt) a hash of both, which no salt-free chain
        and no other salt reaches."""
        if cache_salt is None:
            return self.salt
        return hashlib.blake2b(self.salt + b"\0" + cache_salt.encode(), digest_size=16, person=b"cache_salt").digest()

    def match(self, seq: CachingSequence, max_blocks: int) -> list[int]:
        blocks = []
        for h in self.hashes(seq, max_blocks):
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def index(self, seq: CachingSequence) -> None:
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_indexed_blocks:
            return
        hashes = self.hashes(seq, full)
        for i in range(seq.num_indexed_blocks, full):
            block = seq.block_table[i]
            # A block computed again by a sequence that started before the first copy was indexed keeps its
            # content unindexed: one block per hash, the other is freed when its sequence lets go of it.
            if block not in self.hash_of and hashes[i] not in self.block_of:
                self.block_of[hashes[i]] = block
                self.hash_of[block] = hashes[i]
        seq.num_indexed_blocks = full

    def holds(self, block: int) -> bool:
        return block in self.hash_of

    def park(self, block: int) -> None:
        self.parked[block] = None

    def revive(self, block: int) -> None:
        del self.parked[block]

    def evict(self) -> int:
        block, _ = self.parked.popitem(last=False)
        del self.block_of[self.hash_of.pop(block)]
        return block

    @property
    def num_evictable(self) -> int:
        return len(self.parked)

    @property
    def num_cached(self) -> int:
        return len(self.hash_of)
