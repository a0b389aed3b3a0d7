"""The api process: loads the tokenizer and serves the FastAPI app with uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.engine_client import EngineClient
from hybrid.parent_watch import watch_parent
from hybrid.process_exit import exit_after
from hybrid.tokenizer import MissingTokenizer, Tokenizer
from server.app import build_app

GRACEFUL_SHUTDOWN_S = 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybridd api process")
    ap.add_argument("--config", required=True, help="daemon.json written by the supervisor")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = DaemonConfig.load(a.config)
    watch_parent(os.getppid())  # a supervisor that was killed leaves no api holding its port
    try:
        tokenizer = Tokenizer(config.model, config.chat_template)
    except MissingTokenizer as e:
        logging.getLogger("hybridd.api").warning("%s; only token-id completions are served", e)
        tokenizer = None
    client = EngineClient({role: config.paths.inbox(role) for role in config.engine_roles}, config.paths.engine_out,
                          config.engine_timeout_s)
    app = build_app(config, client, tokenizer)
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    return 0


if __name__ == "__main__":
    exit_after(main)
