"""Child processes that must not outlive the process that started them (expert process, expert ranks, mask
process) watch it from a daemon thread."""

from __future__ import annotations

import os
import signal
import threading
import time


def exit_with_parent(pid: int, sig: int = signal.SIGTERM) -> None:
    """Sends this process `sig` once process `pid` is no longer its parent (run it on a daemon thread)."""
    while os.getppid() == pid:
        time.sleep(1.0)
    os.kill(os.getpid(), sig)


def watch_parent(pid: int, sig: int = signal.SIGTERM) -> None:
    """Starts exit_with_parent(pid, sig) on a daemon thread."""
    threading.Thread(target=exit_with_parent, args=(pid, sig), daemon=True, name="parent-watch").start()
