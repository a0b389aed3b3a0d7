"""`hybridd pack`: a checkpoint's routed experts packed once into one mappable file, with a progress bar;
`hybridd packs`: the packs there are, and the removal of those no model uses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub) -> None:
    pk = sub.add_parser("pack", help="pack a checkpoint's routed experts into one mappable file")
    pk.add_argument("model_dir")
    pk.add_argument("--experts", choices=["bf16", "fp8", "int8", "int4"],
                    help="expert format (default: the checkpoint's, fp8 stays fp8)")
    pk.add_argument("--out", help="pack directory (default: $HYBRIDD_HOME/packs/NAME-HASH-FORMAT)")
    pk.add_argument("--verify", action="store_true", help="re-read the pack and check every checksum")
    pk.add_argument("--quiet", action="store_true", help="no progress bar")
    pk.set_defaults(func=cmd_pack)
    ps = sub.add_parser("packs", help="list the packs under $HYBRIDD_HOME/packs, and remove those no model uses")
    ps.add_argument("--prune", action="store_true",
                    help="delete the stale packs (their checkpoint changed) and those whose packing was interrupted")
    ps.add_argument("--orphaned", action="store_true",
                    help="with --prune, also those whose checkpoint is not where it was packed from (deleted, or "
                         "moved: a moved one is packed again at its next start)")
    ps.add_argument("--json", action="store_true", help="print the list as JSON")
    ps.set_defaults(func=cmd_packs)


def cmd_pack(a: argparse.Namespace) -> int:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from hybrid.config import ModelConfig
    from hybrid.experts.kernel_experts import default_expert_format
    from hybrid.experts.pack import default_pack_dir, expert_bytes_to_read, verify_pack, write_pack

    config = ModelConfig.from_dir(a.model_dir)
    fmt = a.experts or default_expert_format(config)
    out = Path(a.out) if a.out else default_pack_dir(a.model_dir, fmt)
    columns = (TextColumn("packing {task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, transient=True, disable=a.quiet) as bar:
        task = bar.add_task(f"{config.model_dir.name} experts as {fmt}", total=expert_bytes_to_read(config))
        wrote = write_pack(a.model_dir, out, fmt, progress=lambda n: bar.advance(task, n))
    if a.verify:
        verify_pack(out)
    print(f"{out}: {'packed' if wrote else 'already up to date'}{' and verified' if a.verify else ''}")
    return 0


def cmd_packs(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hybrid.experts.pack_inventory import list_packs, packs_root, remove_pack

    entries = list_packs()
    if a.orphaned and not a.prune:
        raise ValueError("--orphaned says which packs --prune deletes: give --prune too")
    removed = [e for e in entries if e.removable(a.orphaned)] if a.prune else []
    for e in removed:
        remove_pack(e)
    if a.json:
        print(json.dumps([{"path": str(e.path), "state": e.state, "bytes": e.nbytes, "model_dir": e.model_dir,
                           "format": e.format, "removed": e in removed} for e in entries], indent=1))
        return 0
    console = Console()
    if not entries:
        console.print(f"no packs under {packs_root()}")
        return 0
    table = Table("pack", "state", "size", "format", "model", title=str(packs_root()))
    for e in entries:
        state = f"{e.state}, removed" if e in removed else e.state
        table.add_row(e.path.name, state, f"{e.nbytes / 1e9:.2f} GB", e.format or "?", e.model_dir or "?")
    console.print(table)
    if a.prune:
        console.print(f"removed {len(removed)} pack(s), {sum(e.nbytes for e in removed) / 1e9:.2f} GB")
    elif freeable := sum(e.nbytes for e in entries if e.removable()):
        console.print(f"{freeable / 1e9:.2f} GB in stale or incomplete packs: `hybridd packs --prune` removes them")
    orphaned = [e for e in entries if e.state == "orphaned" and e not in removed]
    if orphaned:
        console.print(f"{sum(e.nbytes for e in orphaned) / 1e9:.2f} GB in packs whose checkpoint is not where it "
                      "was packed from: `hybridd packs --prune --orphaned` removes them once it is gone for good")
    return 0
