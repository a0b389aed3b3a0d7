"""The packs under $HYBRIDD_HOME/packs and what each is worth keeping: a pack is as large as a model's experts
(hundreds of GB for DeepSeek-V3), and one whose checkpoint changed, moved or was deleted is never mapped again."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from hybrid.config.home import hybridd_home
from hybrid.experts.pack import (
    EXPERTS_FILE,
    INDEX_FILE,
    LOCK_FILE,
    PACK_VERSION,
    PARTIAL_SUFFIX,
    model_fingerprint,
    pack_lock,
)

CURRENT, STALE, ORPHANED, INCOMPLETE, PACKING, UNKNOWN = (
    "current", "stale", "orphaned", "incomplete", "packing", "unknown")


@dataclass(frozen=True)
class PackEntry:
    """One pack directory: `state` is current (an engine would map it), stale (its checkpoint changed since, or
    an older pack version), orphaned (no checkpoint where it was packed from: deleted, moved, or on a drive not
    mounted now), incomplete (packing was interrupted), packing (being written now) or unknown (unreadable, or
    an older pack naming its checkpoint by a relative path). Only stale and incomplete ones are pruned by
    default: an orphaned pack still serves a checkpoint that was moved."""

    path: Path
    state: str
    nbytes: int
    model_dir: str | None = None
    format: str | None = None

    def removable(self, orphaned: bool = False) -> bool:
        return self.state in (STALE, INCOMPLETE) or (orphaned and self.state == ORPHANED)


def packs_root() -> Path:
    return hybridd_home() / "packs"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and not f.is_symlink())


def inspect_pack(path: Path) -> PackEntry:
    nbytes = _size(path)
    with pack_lock(path, wait=False) as free:
        if not free:
            return PackEntry(path, PACKING, nbytes)
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


def _is_pack(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and any(
        (path / name).exists() for name in (INDEX_FILE, EXPERTS_FILE, EXPERTS_FILE + PARTIAL_SUFFIX, LOCK_FILE))


def list_packs() -> list[PackEntry]:
    """Every pack directory under the packs root, by name (other directories, such as lost+found, are not
    packs); one that cannot be read is listed as unknown."""
    root = packs_root()
    if not root.is_dir():
        return []
    entries = []
    for path in sorted(root.iterdir()):
        try:
            if _is_pack(path):
                entries.append(inspect_pack(path))
        except OSError:
            entries.append(PackEntry(path, UNKNOWN, 0))
    return entries


def remove_pack(entry: PackEntry) -> None:
    """Deletes a pack directory. A process still mapping its file keeps its pages until it unmaps them."""
    if entry.path.resolve().parent != packs_root().resolve():
        raise ValueError(f"{entry.path} is not under {packs_root()}")
    shutil.rmtree(entry.path)
