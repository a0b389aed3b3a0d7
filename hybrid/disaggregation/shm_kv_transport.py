"""The KV transport between engine processes on one machine's CPU: one shared-memory file per hand-off.

The sender writes the blocks' KV into a file under /dev/shm (private to the user, created exclusively) and
unlinks it when dropped; the receiver maps the file (no read copy) and copies the blocks into its pool. Files of a
sender that died are removed by the next transport made on the machine (their pid is in the name).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

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
from hybrid.shm_orphans import SHM_DIR, owned_name, remove_orphans

PREFIX = f"hybridd-kv-{os.getuid()}-"


class SharedMemoryKVTransport(KVTransport):
    name = "shm"

    def __init__(self, directory: Path = SHM_DIR):
        self.directory = directory
        self.held: set[str] = set()
        self._next = 0
        remove_orphans(PREFIX, directory)

    def _path(self, name: str) -> Path:
        if not name.startswith(PREFIX) or "/" in name:
            raise KVTransferError(f"{name!r} is not a hand-off file name")
        return self.directory / name

    def put(self, pool: KVPool, block_ids: list[int]) -> KVTicket:
        nbytes = packed_nbytes(pool, len(block_ids))
        self._next += 1
        name = owned_name(PREFIX, self._next)
        path = self._path(name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))  # ENOSPC now, rather than SIGBUS when a page is written
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.held.add(name)
        pack(gather(pool, block_ids), torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8))
        return KVTicket(self.name, name, len(block_ids), pool_layout(pool))

    def get(self, ticket: KVTicket, pool: KVPool, block_ids: list[int]) -> None:
        self.check(ticket, pool, block_ids)
        path = self._path(ticket.name)
        nbytes = packed_nbytes(pool, ticket.num_blocks)
        try:
            if path.stat().st_size < nbytes:
                raise KVTransferError(f"the KV file {path} is shorter than its ticket says")
            mapped = torch.from_file(str(path), shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        except FileNotFoundError:
            raise KVTransferError(f"the KV file {path} is gone") from None
        scatter(pool, block_ids, unpack(mapped, pool, ticket.num_blocks))

    def drop(self, ticket: KVTicket) -> None:
        if ticket.name in self.held:
            self.held.discard(ticket.name)
            self._path(ticket.name).unlink(missing_ok=True)

    def close(self) -> None:
        for name in list(self.held):
            self._path(name).unlink(missing_ok=True)
        self.held.clear()
