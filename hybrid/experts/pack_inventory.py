"""The packs under $HYBRIDD_HOME/packs and what each is worth keeping: a pack is as large as a model's experts
(hundreds of GB for DeepSeek-V3), and one whose checkpoint changed, moved or was deleted is never mapped again."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from hybrid.config.home import hybridd_home
from hybrid.experts.pack import EXPERTS_FILE, INDEX_FILE, PACK_VERSION, model_fingerprint

CURRENT, STALE, ORPHANED, INCOMPLETE, UNKNOWN = "current", "stale", "orphaned", "incomplete", "unknown"


@dataclass(frozen=True)
class PackEntry:
    """One pack directory: `state` is current (an engine would map it), stale (its checkpoint changed since, or
    an older pack version), orphaned (its checkpoint is gone), incomplete (packing was interrupted) or unknown
    (an older pack naming its checkpoint by a relative path, which is kept)."""

    path: Path
    state: str
    nbytes: int
    model_dir: str | None = None
    format: str | None = None

    @property
    def removable(self) -> bool:
        return self.state not in (CURRENT, UNKNOWN)


def packs_root() -> Path:
    return hybridd_home() / "packs"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and not f.is_symlink())


def inspect_pack(path: Path) -> PackEntry:
    nbytes = _size(path)
    try:
        index = json.loads((path / INDEX_FILE).read_text())
        model_dir, fmt = str(index["model_dir"]), index.get("format")
    except (OSError, ValueError, KeyError, TypeError):
        return PackEntry(path, INCOMPLETE, nbytes)
    if not (path / EXPERTS_FILE).is_file():
        return PackEntry(path, INCOMPLETE, nbytes, model_dir, fmt)
    try:
        current = (index.get("version") == PACK_VERSION
                   and index.get("model_fingerprint") == model_fingerprint(model_dir))
    except OSError:
        current = False
    if current:
        return PackEntry(path, CURRENT, nbytes, model_dir, fmt)
    if not Path(model_dir).is_absolute():  # written from another directory: its checkpoint cannot be found
        return PackEntry(path, UNKNOWN, nbytes, model_dir, fmt)
    state = STALE if (Path(model_dir) / "config.json").is_file() else ORPHANED
    return PackEntry(path, state, nbytes, model_dir, fmt)


def list_packs() -> list[PackEntry]:
    """Every directory under the packs root, by name."""
    root = packs_root()
    if not root.is_dir():
        return []
    return [inspect_pack(p) for p in sorted(root.iterdir()) if p.is_dir() and not p.is_symlink()]


def remove_pack(entry: PackEntry) -> None:
    """Deletes a pack directory. A process still mapping its file keeps its pages until it unmaps them."""
    if entry.path.resolve().parent != packs_root().resolve():
        raise ValueError(f"{entry.path} is not under {packs_root()}")
    shutil.rmtree(entry.path)
