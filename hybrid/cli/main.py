"""The `hybridd` command line: the parser of every command, and the one place user errors become exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys

import httpx

from hybrid.checkpoint.reader import CheckpointError
from hybrid.cli import daemon_commands, doctor, generate, pack
from hybrid.cli.sse_client import StreamError
from hybrid.config import ConfigError
from hybrid.experts.pack import PackError
from hybrid.experts.process.client import ExpertServerError
from hybrid.managers.supervisor import DaemonError
from hybrid.tokenizer import TokenizerError

USER_ERRORS = (ConfigError, CheckpointError, PackError, ExpertServerError, TokenizerError, ValueError,
               FileNotFoundError, DaemonError, StreamError)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hybridd", description="Local inference for large MoE models.")
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="command", required=True)
    for commands in (generate, pack, daemon_commands, doctor):
        commands.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return a.func(a)
    except USER_ERRORS as e:
        print(f"hybridd: error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        where = f" {e.request.url}" if isinstance(e, httpx.RequestError) else ""
        print(f"hybridd: error: cannot reach the daemon{where}: {e} (is it running? `hybridd status`)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
