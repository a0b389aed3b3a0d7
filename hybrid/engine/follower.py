"""A rank other than the driver: builds its part of the model and runs the driver's steps until told to stop.
`python -m hybrid.engine.follower '<engine config as JSON>'` (started by the driving engine), or from
`hybridd start|generate` on a rank torchrun started."""

from __future__ import annotations

import sys

from hybrid.config import EngineConfig, ModelConfig
from hybrid.process_exit import exit_after


def follow(config: EngineConfig) -> None:
    from hybrid.engine.model_runner import ModelRunner

    runner = ModelRunner(ModelConfig.from_dir(config.model), config)
    try:
        runner.follow()
    finally:
        runner.close()


def main() -> None:
    import json

    follow(EngineConfig(**json.loads(sys.argv[1])))


if __name__ == "__main__":
    exit_after(main)
