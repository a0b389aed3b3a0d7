"""`hybridd pack`: a checkpoint's routed experts packed once into one mappable file, with a progress bar."""

from __future__ import annotations

import argparse
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
