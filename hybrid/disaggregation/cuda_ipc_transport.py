"""The KV transport between engine processes whose KV pools are on CUDA devices: CUDA IPC, no host memory.

The sender gathers the blocks into one device buffer and shares it through a CUDA IPC handle (torch's own
`reduce_tensor`: the allocation's handle, offsets, the cross-process reference counter and an event); the
receiver opens it and copies the blocks into its pool: on the same GPU a device-to-device copy, on another GPU a
peer copy. The handle travels as plain fields (no pickle from a socket). The sender keeps the buffer until the
ticket is dropped; the receiver synchronizes before returning, so the sender may free it once told.
"""

from __future__ import annotations

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from hybrid.disaggregation.handoff import KVTicket
from hybrid.disaggregation.kv_transport import (
    KVTransferError,
    KVTransport,
    gather,
    pack,
    packed_nbytes,
    pool_layout,
    scatter,
    unpack,
)
from hybrid.mem_cache.kv_pool import KVPool


class CudaIpcHandle(msgspec.Struct, array_like=True):
    """rebuild_cuda_tensor's arguments for a flat uint8 tensor, without its class and dtype objects."""

    size: list[int]
    stride: list[int]
    offset: int
    device: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


def share(flat: torch.Tensor) -> bytes:
    rebuild, args = reduce_tensor(flat)
    if rebuild is not rebuild_cuda_tensor or args[4] is not torch.TypedStorage or args[5] != torch.uint8:
        raise KVTransferError("this torch shares CUDA tensors in a way the cuda-ipc transport does not know")
    (_, size, stride, offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
     event_handle, event_sync) = args
    return msgspec.msgpack.encode(CudaIpcHandle(list(size), list(stride), offset, device, handle, size_bytes,
                                                offset_bytes, ref_handle, ref_offset, event_handle, event_sync))


def open_shared(blob: bytes) -> torch.Tensor:
    h = msgspec.msgpack.decode(blob, type=CudaIpcHandle)
    return rebuild_cuda_tensor(torch.Tensor, torch.Size(h.size), tuple(h.stride), h.offset, torch.TypedStorage,
                               torch.uint8, h.device, h.handle, h.storage_size_bytes, h.storage_offset_bytes, False,
                               h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required)


class CudaIpcKVTransport(KVTransport):
    name = "cuda-ipc"

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}
        self._next = 0

    def put(self, pool: KVPool, block_ids: list[int]) -> KVTicket:
        if not pool.caches[0][0].is_cuda:
            raise KVTransferError("the cuda-ipc transport carries KV pools on CUDA devices; use shm for the CPU")
        flat = torch.empty(packed_nbytes(pool, len(block_ids)), dtype=torch.uint8, device=pool.caches[0][0].device)
        pack(gather(pool, block_ids), flat)
        self._next += 1
        name = str(self._next)
        self.held[name] = flat
        return KVTicket(self.name, name, len(block_ids), pool_layout(pool), share(flat))

    def get(self, ticket: KVTicket, pool: KVPool, block_ids: list[int]) -> None:
        self.check(ticket, pool, block_ids)
        try:
            flat = open_shared(ticket.handle)
        except (RuntimeError, msgspec.DecodeError) as e:
            raise KVTransferError(f"cannot open the KV shared by the prefill engine: {e}") from None
        if flat.numel() < packed_nbytes(pool, ticket.num_blocks):
            raise KVTransferError("the shared KV is smaller than its ticket says")
        scatter(pool, block_ids, unpack(flat, pool, ticket.num_blocks))
        torch.cuda.synchronize(pool.caches[0][0].device)

    def drop(self, ticket: KVTicket) -> None:
        self.held.pop(ticket.name, None)

    def close(self) -> None:
        self.held.clear()
