"""What one daemon serves and where its files live: `DaemonConfig` and the `$HYBRIDD_HOME` layout."""

from __future__ import annotations

import hashlib
import json
from dataclasses import InitVar, asdict, dataclass, field
from pathlib import Path

from hybrid.config import ConfigError, EngineConfig
from hybrid.config.home import hybridd_home, make_private_dir, write_private


def key_digest(key: str) -> str:
    """What the daemon stores and compares instead of the API key itself."""
    return hashlib.sha256(key.encode()).hexdigest()


MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with its terminating NUL


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
    def lock_file(self) -> Path:
        return self.run_dir / "supervisor.lock"

    @property
    def config_file(self) -> Path:
        return self.run_dir / "daemon.json"

    @property
    def exits_file(self) -> Path:
        """The supervisor's pid and, by role, the exit codes of its child processes within the restart window."""
        return self.run_dir / "exits.json"

    def ready_file(self, role: str) -> Path:
        """Where an engine of `role` writes its pid once it has loaded (for the supervisor's restart policy)."""
        return self.run_dir / f"{role}.ready"

    @property
    def engine_in(self) -> str:
        return f"ipc://{self.run_dir}/engine-in"

    @property
    def decode_in(self) -> str:
        return f"ipc://{self.run_dir}/decode-in"

    def inbox(self, role: str) -> str:
        """Where an engine of `role` takes messages: new requests go to the engine or prefill engine."""
        return self.decode_in if role == "decode" else self.engine_in

    @property
    def engine_out(self) -> str:
        return f"ipc://{self.run_dir}/engine-out"

    def make(self) -> None:
        for d in (self.home, self.log_dir, self.run_dir):
            make_private_dir(d)


@dataclass
class DaemonConfig:
    """engine holds EngineConfig fields; max_queue bounds requests waiting beyond the running batch. The API key
    is kept only as its SHA-256 (`api_key` is accepted at construction and never stored)."""

    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: InitVar[str | None] = None
    api_key_sha256: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None  # Jinja text replacing the model's (--chat-template)
    max_queue: int = 64
    max_body_mb: float = 4.0
    engine_timeout_s: float = 120.0
    home: str = field(default_factory=lambda: str(hybridd_home()))
    engine: dict = field(default_factory=dict)
    disagg: bool = False
    prefill_cores: int | None = None

    def __post_init__(self, api_key: str | None) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.max_queue < 0:
            raise ConfigError("max_queue must be >= 0")
        if self.engine_timeout_s <= 0:
            raise ConfigError("engine_timeout_s must be positive")
        if api_key == "":
            raise ConfigError("--api-key must not be empty")
        if api_key is not None:
            self.api_key_sha256 = key_digest(api_key)
        if not 0 < self.max_body_mb <= 1024:
            raise ConfigError(f"max_body_mb must be in (0, 1024], got {self.max_body_mb}")
        if self.prefill_cores is not None and (not self.disagg or self.prefill_cores < 1):
            raise ConfigError("prefill_cores (>= 1) is the prefill engine's share of the cores: use it with --disagg")
        socket = self.paths.engine_out.removeprefix("ipc://")
        if len(socket.encode()) > MAX_SOCKET_PATH:
            raise ConfigError(f"HYBRIDD_HOME={self.home} is too long: the daemon's sockets under it ({socket}) "
                              f"would pass the {MAX_SOCKET_PATH} bytes a unix socket path may have; choose a "
                              "shorter directory")
        for role in self.engine_roles:  # each engine's own checks, here rather than in a restarting engine
            self.engine_config(role)

    @property
    def engine_roles(self) -> list[str]:
        return ["prefill", "decode"] if self.disagg else ["engine"]

    def engine_config(self, role: str = "engine") -> EngineConfig:
        return EngineConfig(model=self.model, **self.engine, role="both" if role == "engine" else role)

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

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    def save(self, path: Path) -> None:
        write_private(path, json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "DaemonConfig":
        return cls(**json.loads(Path(path).read_text()))
