"""What one daemon serves and where its files live: `DaemonConfig` and the `$HYBRIDD_HOME` layout."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybrid.config import ConfigError, EngineConfig
from hybrid.config.home import hybridd_home


@dataclass
class DaemonPaths:
    """pid file, logs and the ZeroMQ sockets between the api and engine processes."""

    home: Path

    @property
    def pid_file(self) -> Path:
        return self.home / "hybridd.pid"

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def config_file(self) -> Path:
        return self.run_dir / "daemon.json"

    @property
    def engine_in(self) -> str:
        return f"ipc://{self.run_dir}/engine-in"

    @property
    def engine_out(self) -> str:
        return f"ipc://{self.run_dir}/engine-out"

    def make(self) -> None:
        for d in (self.home, self.log_dir, self.run_dir):
            d.mkdir(parents=True, exist_ok=True)


@dataclass
class DaemonConfig:
    """engine holds EngineConfig fields; max_queue bounds requests waiting beyond the running batch."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_queue: int = 64
    engine_timeout_s: float = 120.0
    home: str = field(default_factory=lambda: str(hybridd_home()))
    engine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.max_queue < 0:
            raise ConfigError("max_queue must be >= 0")
        if self.engine_timeout_s <= 0:
            raise ConfigError("engine_timeout_s must be positive")
        if self.api_key == "":
            raise ConfigError("--api-key must not be empty")
        self.engine_config()

    def engine_config(self) -> EngineConfig:
        return EngineConfig(model=self.model, **self.engine)

    @property
    def paths(self) -> DaemonPaths:
        return DaemonPaths(Path(self.home))

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "DaemonConfig":
        return cls(**json.loads(Path(path).read_text()))
