"""Starts and stops real daemons (`hybridd start` in the background) in a private HYBRIDD_HOME for tests."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

MODEL = "default_model"  # the served name of the embedded default model
LONG = {"max_tokens": 3000, "ignore_eos": True}  # a stream that outlives what a test does meanwhile (see mid_stream)


def mid_stream(attempt: Callable[[], bool], tries: int = 5) -> None:
    """Runs `attempt` (which interrupts a LONG stream and says whether the interruption found it still running)
    until one does. The default model decodes LONG in 0.5-3 s (its steps take 0.1-0.5 ms, by machine), and the api
    forwards tokens behind the engine: on a loaded machine a test can read a stream's first token when the engine
    has made its last (three attempts in a row did so in a full run on a 2-core Zen 4). Such an attempt proves
    nothing either way."""
    for _ in range(tries):
        if attempt():
            return
    raise AssertionError(f"{tries} streams all ended before the test could interrupt them")


def wait_replaced(daemon: "Daemon", pid_of: Callable[[dict], int | None], old: int, timeout_s: float = 120) -> None:
    """Waits until the process `pid_of(status)` names is another than `old` and the daemon is healthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if pid_of(daemon.status()) not in (None, old) and daemon.health().status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.2)
    raise AssertionError(f"pid {old} was not replaced:\n{daemon.logs()}")


def metric(daemon: Daemon, name: str, labels: str = "") -> float:
    text = httpx.get(f"{daemon.url}/metrics", headers=daemon.headers).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_idle(daemon: Daemon, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = daemon.status()["stats"]
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_used"] == 0:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"engine still busy: {daemon.status()}")


def outcomes(daemon: Daemon, names: tuple[str, ...] = ("abort", "length")) -> dict[str, float]:
    """How many requests have ended with each of these outcomes, read off /metrics."""
    return {o: metric(daemon, "hybridd_requests_total", f'outcome="{o}"') for o in names}


def ended_by_abort(daemon: Daemon, before: dict[str, float]) -> bool:
    """Once the engine is idle: exactly one request ended since `before` (abort and length counts); was it aborted,
    or had it already ended by its length, which is what a stream interrupted too late shows?"""
    wait_idle(daemon)
    after = outcomes(daemon)
    assert after["abort"] + after["length"] == before["abort"] + before["length"] + 1, (before, after)
    return after["abort"] == before["abort"] + 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    home: Path
    port: int
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict:
        return {**os.environ, "HYBRIDD_HOME": str(self.home)}

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def cli(self, *args: str, timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess:
        from cpu_kernels.thread_pool import unpin_child

        # unpin_child: as from a shell, with every core (a test that ran kernels has its thread pinned to one)
        return subprocess.run([sys.executable, "-m", "hybrid.cli.main", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, input=stdin, preexec_fn=unpin_child)

    def start(self, *extra: str) -> None:
        # hybridd start gives up first, so a daemon that does not start fails the test with its logs.
        wait = float(os.environ.get("HYBRIDD_TEST_START_S", "300"))
        args = ["start", "--port", str(self.port), "--kv-cache-gb", "0.25", "--timeout", str(wait), *extra]
        if self.api_key:
            args += ["--api-key", self.api_key]
        r = self.cli(*args, timeout=wait + 60)
        assert r.returncode == 0, f"hybridd start failed:\n{r.stdout}\n{r.stderr}\n{self.logs()}"

    def stop(self) -> subprocess.CompletedProcess:
        return self.cli("stop", timeout=120)

    def status(self) -> dict:
        return httpx.get(f"{self.url}/status", headers=self.headers, timeout=10).json()

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=10)

    def wait_healthy(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.health().status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"daemon not healthy after {timeout_s}s:\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.home / "logs").glob("*.log")))


def openai_client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key or "unused", max_retries=0, timeout=60)
