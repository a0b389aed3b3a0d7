"""Where the ranks that one process starts on this machine meet (a local --tp / --pp run, SmallEP's expert ranks):
a torch FileStore in a private directory, and gloo and NCCL connecting over loopback.

Neither torch default is private: a TCPStore listens on every interface, and gloo binds the address the host name
resolves to (on many servers the LAN address), both without authentication, so anyone who reaches the port could
read or write the run's keys or connect to a rank. A file in a directory only its user can enter, and sockets on
loopback, are reachable from this machine by this user's processes (and root) alone. torchrun's own multi-machine
runs keep torchrun's store: that one has to be on the network.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from hybrid.shm_orphans import create_owned

STORE_ENV = "HYBRIDD_LOCAL_STORE"  # a started rank opens the store at this path
# Loopback is Linux's "lo". Gloo reads its setting when a group is built, NCCL once per process, at its first
# communicator.
GLOO_LOOPBACK = {"GLOO_SOCKET_IFNAME": "lo"}
NCCL_LOOPBACK = {"NCCL_SOCKET_IFNAME": "lo"}
_PREFIX = f"hybridd-store-{os.getuid()}-"


class LocalStore:
    """The store of a run this process starts: it holds the directory; each started rank opens the store from
    `child_env()` with `open_local_store`."""

    def __init__(self, world: int, timeout: timedelta):
        self.dir = create_owned(_PREFIX, Path(tempfile.gettempdir()), is_dir=True)
        self.path = self.dir / "store"
        self.store = _file_store(self.path, world, timeout)

    def child_env(self) -> dict[str, str]:
        return {STORE_ENV: str(self.path), **GLOO_LOOPBACK, **NCCL_LOOPBACK}

    def close(self) -> None:
        """Removes the directory (the ranks' groups keep working: they only use the store to connect)."""
        shutil.rmtree(self.dir, ignore_errors=True)


def started_locally() -> bool:
    """Whether this process is a rank that another hybridd process started here (not torchrun)."""
    return STORE_ENV in os.environ


def open_local_store(world: int, timeout: timedelta) -> dist.FileStore:
    """The store of the run that started this rank."""
    path = Path(os.environ[STORE_ENV])
    if not path.parent.is_dir():
        raise RuntimeError(f"the run's store {path} is gone (the process that started this rank has exited)")
    return _file_store(path, world, timeout)


@contextmanager
def on_loopback() -> Iterator[None]:
    """Gloo groups built inside connect over loopback; the process's own setting comes back afterwards (a group
    keeps the device it was built with)."""
    saved = {k: os.environ.get(k) for k in GLOO_LOOPBACK}
    os.environ.update(GLOO_LOOPBACK)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _file_store(path: Path, world: int, timeout: timedelta) -> dist.FileStore:
    store = dist.FileStore(str(path), world)
    store.set_timeout(timeout)
    return store
