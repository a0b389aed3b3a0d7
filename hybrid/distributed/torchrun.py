"""Whether this process is a rank that torchrun started, read from its environment without importing torch (the
CLI asks before it decides whether it needs torch at all)."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ
