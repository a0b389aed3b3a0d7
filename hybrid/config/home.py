"""Where hybridd keeps its files: $HYBRIDD_HOME, default ~/.hybridd (pid file, logs, sockets, expert packs), and
how they are made private to their user whatever the umask: directories 0700, files 0600."""

from __future__ import annotations

import os
from pathlib import Path

PRIVATE_UMASK = 0o077


def hybridd_home() -> Path:
    return Path(os.environ.get("HYBRIDD_HOME", Path.home() / ".hybridd"))


def make_private_dir(path: Path) -> None:
    """Creates `path` and its missing parents mode 0700 (mkdir's parents would follow the umask)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)


def open_private(path: Path, flags: int = os.O_WRONLY | os.O_CREAT | os.O_APPEND) -> int:
    """A file descriptor on `path`, which is mode 0600 whether it existed or not."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def write_private(path: Path, text: str) -> None:
    """Replaces `path` atomically with `text`, mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "w") as f:
        f.write(text)
    os.replace(tmp, path)
