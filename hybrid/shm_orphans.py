"""Shared-memory files named after the process that made them (a prefix holding the user id, then the pid and a
number), and removing those of this user whose process is gone. Python's resource tracker unlinks a killed
process's blocks, but not when it dies with it (a process group killed at once): such blocks stay in /dev/shm,
in RAM, until the machine restarts."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def owned_name(prefix: str, n: int) -> str:
    """The name of this process's n-th file under `prefix`."""
    return f"{prefix}{os.getpid()}-{n}"


_numbers = itertools.count()


def create_owned(prefix: str, directory: Path = SHM_DIR, is_dir: bool = False) -> Path:
    """A new empty file (or directory) of this process's under `prefix`: private, created exclusively, a name
    someone else took skipped; after removing those under `prefix` whose process is gone."""
    remove_orphans(prefix, directory)
    for _ in range(100):
        path = directory / owned_name(prefix, next(_numbers))
        try:
            if is_dir:
                path.mkdir(0o700)
            else:
                os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name under {directory / prefix}")


def remove_orphans(prefix: str, directory: Path = SHM_DIR) -> int:
    """Removes this user's files under `prefix` whose process is gone; returns how many. Another user's file of
    that name (planted in a shared /tmp, say) is left alone: it is not an orphan of ours, and not ours to
    remove."""
    removed = 0
    for path in directory.glob(f"{prefix}*"):
        m = re.fullmatch(re.escape(prefix) + r"(\d+)-\d+", path.name)
        if not m or psutil.pid_exists(int(m.group(1))):
            continue
        try:
            info = path.lstat()  # of the name itself: a symlink of ours is unlinked, never followed
            if info.st_uid != os.getuid():
                continue
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        except OSError:  # gone meanwhile, or not removable: either way no orphan of ours is left to count
            continue
        removed += 1
    return removed
