"""Where hybridd keeps its files: $HYBRIDD_HOME, default ~/.hybridd (pid file, logs, sockets, expert packs)."""

from __future__ import annotations

import os
from pathlib import Path


def hybridd_home() -> Path:
    return Path(os.environ.get("HYBRIDD_HOME", Path.home() / ".hybridd"))
