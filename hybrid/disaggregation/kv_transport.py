"""How a sequence's KV blocks travel from the prefill engine's pool to the decode engine's: one interface and
its transports.

The sender `put`s the KV of some blocks of its pool and gets a KVTicket, a small typed value that travels in the
hand-off message; the receiver `get`s the ticket's KV into blocks of its own pool (any ids); the sender `drop`s
the ticket once the receiver has it (or gave up), which frees what the transport held. Both pools must have the
same layout (model, dtype, block size): the ticket carries it and `get` refuses a mismatch.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod

import torch

from hybrid.config import ConfigError
from hybrid.disaggregation.handoff import KVTicket
from hybrid.mem_cache.kv_pool import KVPool


class KVTransferError(RuntimeError):
    """A ticket whose KV cannot be read (gone, or of another layout)."""


def pool_layout(pool: KVPool) -> str:
    """The layout two pools must share to exchange blocks: per layer, each cache tensor's block shape and dtype."""
    return ";".join(",".join(f"{list(t.shape[1:])}{t.dtype}" for t in layer) for layer in pool.caches)


class KVTransport(ABC):
    name: str

    @abstractmethod
    def put(self, pool: KVPool, block_ids: list[int]) -> KVTicket:
        """Copies (or shares) the KV of block_ids, in their order, out of pool."""

    @abstractmethod
    def get(self, ticket: KVTicket, pool: KVPool, block_ids: list[int]) -> None:
        """Writes the ticket's blocks, in order, into block_ids of pool; raises KVTransferError."""

    @abstractmethod
    def drop(self, ticket: KVTicket) -> None:
        """Frees what the ticket holds; dropping twice is harmless."""

    def close(self) -> None:
        """Frees every ticket this transport put and has not dropped."""

    def check(self, ticket: KVTicket, pool: KVPool, block_ids: list[int]) -> None:
        if ticket.transport != self.name:
            raise KVTransferError(f"a {ticket.transport} ticket given to the {self.name} transport")
        if ticket.layout != pool_layout(pool):
            raise KVTransferError("the KV was made by an engine with another cache layout (model, dtype or block "
                                  f"size): {ticket.layout} vs {pool_layout(pool)}")
        if len(block_ids) != ticket.num_blocks:
            raise KVTransferError(f"the ticket holds {ticket.num_blocks} blocks, {len(block_ids)} were given")


def cache_tensors(pool: KVPool) -> list[torch.Tensor]:
    """Every cache tensor of the pool, layer by layer: the order a ticket's KV is kept in."""
    return [cache for layer in pool.caches for cache in layer]


def gather(pool: KVPool, block_ids: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.caches[0][0].device)
    return [cache.index_select(0, index) for cache in cache_tensors(pool)]


def scatter(pool: KVPool, block_ids: list[int], tensors: list[torch.Tensor]) -> None:
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.caches[0][0].device)
    for cache, src in zip(cache_tensors(pool), tensors, strict=True):
        cache.index_copy_(0, index, src.to(cache.device, non_blocking=True))


def packed_nbytes(pool: KVPool, num_blocks: int) -> int:
    """Bytes of num_blocks blocks of every cache tensor, packed one after another."""
    return sum(num_blocks * c[0].numel() * c.element_size() for c in cache_tensors(pool))


def pack(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copies gathered blocks into a uint8 buffer, one tensor after another."""
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        flat[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
        offset += n


def unpack(flat: torch.Tensor, pool: KVPool, num_blocks: int) -> list[torch.Tensor]:
    """Views of a packed uint8 buffer as num_blocks blocks of each of the pool's cache tensors (pack's inverse)."""
    views, offset = [], 0
    for cache in cache_tensors(pool):
        n = num_blocks * cache[0].numel() * cache.element_size()
        views.append(flat[offset:offset + n].view(cache.dtype).view(num_blocks, *cache.shape[1:]))
        offset += n
    return views


class LocalKVTransport(KVTransport):
    """Both engines in one process (tests): the ticket names copies kept in a dict."""

    name = "local"

    def __init__(self) -> None:
        self.held: dict[str, list[torch.Tensor]] = {}
        self._next = 0

    def put(self, pool: KVPool, block_ids: list[int]) -> KVTicket:
        self._next += 1
        name = str(self._next)
        self.held[name] = gather(pool, block_ids)
        return KVTicket(self.name, name, len(block_ids), pool_layout(pool))

    def get(self, ticket: KVTicket, pool: KVPool, block_ids: list[int]) -> None:
        self.check(ticket, pool, block_ids)
        if ticket.name not in self.held:
            raise KVTransferError(f"KV {ticket.name} is gone")
        scatter(pool, block_ids, self.held[ticket.name])

    def drop(self, ticket: KVTicket) -> None:
        self.held.pop(ticket.name, None)

    def close(self) -> None:
        self.held.clear()


CUDA_TRANSPORTS = ("cuda-ipc", "cuda-ipc-pool")


def transport_for(device: torch.device) -> KVTransport:
    """The transport between two engine processes whose pools are on `device`'s kind: shared memory for the CPU,
    CUDA IPC for GPUs: a packed copy per hand-off, or with HYBRIDD_KV_TRANSPORT=cuda-ipc-pool the sender's pool
    mapped once (shared_pool_transport.py; not yet measured on a GPU, so not the default)."""
    if device.type == "cuda":
        kind = os.environ.get("HYBRIDD_KV_TRANSPORT", "cuda-ipc")
        if kind not in CUDA_TRANSPORTS:
            raise ConfigError(f"HYBRIDD_KV_TRANSPORT={kind!r}: the CUDA transports are {', '.join(CUDA_TRANSPORTS)}")
        if kind == "cuda-ipc-pool":
            from hybrid.disaggregation.shared_pool_transport import CudaIpcPoolKVTransport

            return CudaIpcPoolKVTransport()
        from hybrid.disaggregation.cuda_ipc_transport import CudaIpcKVTransport

        return CudaIpcKVTransport()
    from hybrid.disaggregation.shm_kv_transport import SharedMemoryKVTransport

    return SharedMemoryKVTransport()
