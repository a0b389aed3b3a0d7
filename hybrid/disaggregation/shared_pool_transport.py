"""A KV transport that shares the sender's whole KV pool once instead of a packed copy per hand-off.

The per-hand-off CUDA IPC transport (cuda_ipc_transport.py) allocates a buffer, packs the blocks into it and
shares it, and the receiver opens the buffer's allocator segment and closes it again. Other projects measured that
open and close at milliseconds to hundreds of milliseconds, and the decode engine waits for them. Here every
cache tensor of the sender's pool is shared once; the handles travel with every ticket, so a restarted decode
engine finds them too. The receiver maps them once per sender and keeps them mapped. A hand-off then carries block
ids, and the receiver copies those blocks from the mapped pool into its own on the device.

This is safe because the prefill engine keeps a handed-off sequence's blocks parked until the decode engine
answers (HandoffDone), so the blocks are read in place. A ticket from another sender (a restarted prefill process)
unmaps the previous one's pool.

`HYBRIDD_KV_TRANSPORT=cuda-ipc-pool` selects it between CUDA engines (kv_transport.transport_for).
"""

from __future__ import annotations

import os
import uuid
from abc import abstractmethod

import msgspec
import torch

from hybrid.disaggregation.handoff import KVTicket
from hybrid.disaggregation.kv_transport import KVTransferError, KVTransport, cache_tensors, pool_layout
from hybrid.mem_cache.kv_pool import KVPool


class PoolRef(msgspec.Struct, array_like=True):
    """A ticket's handle: whose pool (`sender`, unique per pool and process), its tensors' handles and rows (blocks
    including the extra ones; the two pools may differ in size), and the blocks to read."""

    sender: str
    rows: int
    handles: list[bytes]
    blocks: list[int]


class SharedPoolKVTransport(KVTransport):
    """The transport's logic over a way to share one tensor between processes (`share` / `open`), and the
    synchronization that makes a sender's writes visible to them (`publish`)."""

    def __init__(self) -> None:
        self._exported: dict[int, tuple[str, list[bytes]]] = {}  # id(pool) -> (sender key, handles)
        self._mapped: tuple[str, list[torch.Tensor]] | None = None  # the sender whose pool is mapped, its tensors
        self._next = 0

    @abstractmethod
    def share(self, flat: torch.Tensor) -> bytes:
        """A handle another process can open to a flat uint8 view of a cache tensor."""

    @abstractmethod
    def open(self, handle: bytes) -> torch.Tensor:
        """The flat uint8 tensor a handle names, mapped into this process."""

    @abstractmethod
    def publish(self, pool: KVPool) -> None:
        """Waits until the pool's writes so far are visible to the receiver's process."""

    def put(self, pool: KVPool, block_ids: list[int]) -> KVTicket:
        exported = self._exported.get(id(pool))
        if exported is None:
            handles = [self.share(c.view(-1).view(torch.uint8)) for c in cache_tensors(pool)]
            exported = self._exported[id(pool)] = (f"{os.getpid()}-{uuid.uuid4().hex}", handles)
        self.publish(pool)
        self._next += 1
        rows = cache_tensors(pool)[0].shape[0]
        ref = PoolRef(exported[0], rows, exported[1], list(block_ids))
        return KVTicket(self.name, str(self._next), len(block_ids), pool_layout(pool), msgspec.msgpack.encode(ref))

    def get(self, ticket: KVTicket, pool: KVPool, block_ids: list[int]) -> None:
        self.check(ticket, pool, block_ids)
        try:
            ref = msgspec.msgpack.decode(ticket.handle, type=PoolRef)
        except msgspec.DecodeError as e:
            raise KVTransferError(f"a malformed {self.name} ticket: {e}") from None
        if len(ref.blocks) != ticket.num_blocks or any(not 0 <= b < ref.rows for b in ref.blocks):
            raise KVTransferError(f"the ticket's blocks {ref.blocks} are not {ticket.num_blocks} of the sender's "
                                  f"{ref.rows}")
        dst = cache_tensors(pool)
        src = self._sender_pool(ref, dst)
        device = dst[0].device
        src_index = torch.tensor(ref.blocks, dtype=torch.long, device=src[0].device)
        dst_index = torch.tensor(block_ids, dtype=torch.long, device=device)
        for s, d in zip(src, dst, strict=True):
            d.index_copy_(0, dst_index, s.index_select(0, src_index).to(device, non_blocking=True))
        self.publish(pool)  # the sender may free the blocks once this returns

    def _sender_pool(self, ref: PoolRef, like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sender's cache tensors, shaped as this pool's with the sender's rows, mapped on first use."""
        if self._mapped is not None and self._mapped[0] == ref.sender:
            return self._mapped[1]
        self._mapped = None  # first: a restarted sender's memory is unmapped even if the new one fails to open
        if len(ref.handles) != len(like):
            raise KVTransferError(f"the sender shares {len(ref.handles)} cache tensors, this pool has {len(like)}")
        tensors = []
        for handle, t in zip(ref.handles, like):
            try:
                flat = self.open(handle)
            except (RuntimeError, msgspec.DecodeError) as e:
                raise KVTransferError(f"cannot open the KV pool shared by the prefill engine: {e}") from None
            if flat.numel() != ref.rows * t[0].numel() * t.element_size():
                raise KVTransferError("the shared KV pool is not the size its ticket says")
            tensors.append(flat.view(t.dtype).view(ref.rows, *t.shape[1:]))
        self._mapped = (ref.sender, tensors)
        return tensors

    def drop(self, ticket: KVTicket) -> None:
        """Nothing to free: the blocks are the sender's, which its engine frees."""

    def close(self) -> None:
        self._exported.clear()
        self._mapped = None


class CudaIpcPoolKVTransport(SharedPoolKVTransport):
    name = "cuda-ipc-pool"

    def share(self, flat: torch.Tensor) -> bytes:
        from hybrid.disaggregation.cuda_ipc_transport import share

        if not flat.is_cuda:
            raise KVTransferError(f"the {self.name} transport carries KV pools on CUDA devices; use shm for the CPU")
        return share(flat)

    def open(self, handle: bytes) -> torch.Tensor:
        from hybrid.disaggregation.cuda_ipc_transport import open_shared

        return open_shared(handle)

    def publish(self, pool: KVPool) -> None:
        torch.cuda.synchronize(cache_tensors(pool)[0].device)
