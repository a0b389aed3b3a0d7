"""Whether an expert process can run at all, read from the OS: the engine checks it while waiting on a call,
the api on /health and /status, so a stopped process is reported at once rather than after a timeout."""

from __future__ import annotations

import psutil


def is_stopped(pid: int | None) -> bool:
    """True for a process that exists but cannot run (SIGSTOP, a debugger): it will never answer."""
    try:
        return pid is not None and psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False
