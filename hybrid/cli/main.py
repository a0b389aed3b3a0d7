"""The `hybridd` command line: the parser of every command, and the one place user errors become exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys

import httpx

from hybrid.checkpoint.errors import CheckpointError, PackError
from hybrid.cli import daemon_commands, doctor, generate, pack
from hybrid.cli.sse_client import StreamError
from hybrid.config import ConfigError
from hybrid.managers.supervisor import DaemonError
from hybrid.process_exit import exit_after
from hybrid.tokenizer import TokenizerError

USER_ERRORS = (ConfigError, CheckpointError, PackError, TokenizerError, ValueError, FileNotFoundError, DaemonError,
               StreamError)


def user_errors() -> tuple[type[BaseException], ...]:
    """USER_ERRORS, and the expert process's error where the command loaded its client. That error lives in the
    kernels' C++ module, which needs torch; `stop` and `status` import neither, and cannot have raised it."""
    client = sys.modules.get("hybrid.experts.process.client")
    return USER_ERRORS + ((client.ExpertServerError,) if client is not None else ())


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
    except user_errors() as e:
        print(f"hybridd: error: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPStatusError as e:
        print(f"hybridd: error: the daemon at {e.request.url} answered {e.response.status_code}: "
              f"{_error_message(e.response)}" + (" (pass its key with --api-key or HYBRIDD_API_KEY)"
                                                 if e.response.status_code == 401 else ""), file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        where = f" {e.request.url}" if isinstance(e, httpx.RequestError) else ""
        print(f"hybridd: error: cannot reach the daemon{where}: {e} (is it running? `hybridd status`)",
              file=sys.stderr)
        return 2


def _error_message(response: httpx.Response) -> str:
    """The message of an OpenAI-shaped error body, else the body's start."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200] or response.reason_phrase
    except httpx.ResponseNotRead:  # a streamed response refused before its body was read
        return response.reason_phrase


def run() -> None:
    """The `hybridd` command: main's exit code, without the interpreter's module teardown (hybrid/process_exit.py),
    which takes half a second once torch is loaded."""
    exit_after(main)


if __name__ == "__main__":
    run()
