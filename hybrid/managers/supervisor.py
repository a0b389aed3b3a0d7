"""The supervisor: starts the api and engine processes, restarts whichever dies, and stops them cleanly.

Also the helpers `hybridd start/stop` use to find, launch and stop a supervisor through its pid file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hybrid.managers.daemon_config import DaemonConfig, DaemonPaths

log = logging.getLogger("hybridd.supervisor")

POLL_S = 0.2
RESTART_WINDOW_S = 60.0
MAX_BACKOFF_S = 30.0
API_STOP_S = 20.0
ENGINE_STOP_S = 15.0
ROLE_MODULES = {"api": "server.api_server", "engine": "hybrid.managers.engine_server"}


class DaemonError(RuntimeError):
    """The daemon cannot be started or stopped as asked."""


@dataclass
class Child:
    role: str
    proc: subprocess.Popen | None = None
    start_after: float = 0.0
    restarts: list[float] = field(default_factory=list)


class Supervisor:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.paths = config.paths
        self.children = {role: Child(role) for role in ROLE_MODULES}
        self.stopping = False

    def spawn(self, child: Child) -> None:
        log_file = open(self.paths.log_dir / f"{child.role}.log", "ab")
        cmd = [sys.executable, "-m", ROLE_MODULES[child.role], "--config", str(self.paths.config_file)]
        child.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
        log_file.close()
        log.info("started %s (pid %d)", child.role, child.proc.pid)

    def check(self, child: Child) -> None:
        """Restarts a child that exited, backing off when it keeps dying."""
        now = time.monotonic()
        if child.proc is not None and child.proc.poll() is not None:
            log.error("%s (pid %d) exited with code %s; restarting it (log: %s)", child.role, child.proc.pid,
                      child.proc.returncode, self.paths.log_dir / f"{child.role}.log")
            child.proc = None
            child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW_S] + [now]
            child.start_after = now + min(2.0 ** (len(child.restarts) - 1) - 1, MAX_BACKOFF_S)
        if child.proc is None and now >= child.start_after:
            self.spawn(child)

    def run(self) -> int:
        self.paths.make()
        self.config.save(self.paths.config_file)
        write_pid_file(self.paths, {"pid": os.getpid(), "url": self.config.url, "model": self.config.model_name,
                                    "api_key": bool(self.config.api_key),
                                    "create_time": psutil.Process().create_time()})
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("supervising %s at %s", self.config.model_name, self.config.url)
        try:
            while not self.stopping:
                for child in self.children.values():
                    self.check(child)
                time.sleep(POLL_S)
            self.shutdown()
        finally:
            for child in self.children.values():
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.kill()
            self.paths.pid_file.unlink(missing_ok=True)
        log.info("stopped")
        return 0

    def _stop(self, *_) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        """api first (it drains in-flight streams, then refuses new ones), then the engine (which aborts
        whatever is left and stops the expert process)."""
        for role, limit in (("api", API_STOP_S), ("engine", ENGINE_STOP_S)):
            proc = self.children[role].proc
            if proc is None or proc.poll() is not None:
                continue
            proc.terminate()
            try:
                proc.wait(limit)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs; killing it", role, limit)
                proc.kill()
                proc.wait()


def write_pid_file(paths: DaemonPaths, record: dict) -> None:
    tmp = paths.pid_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, paths.pid_file)


def running_daemon(paths: DaemonPaths) -> dict | None:
    """The pid-file record of a live supervisor; a stale pid file is removed."""
    try:
        record = json.loads(paths.pid_file.read_text())
        proc = psutil.Process(record["pid"])
        if proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - record["create_time"]) < 0.01:
            return record
    except (FileNotFoundError, json.JSONDecodeError, KeyError, psutil.Error):
        pass
    paths.pid_file.unlink(missing_ok=True)
    return None


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise DaemonError(f"cannot listen on {host}:{port}: {e.strerror}; choose another --port") from None


def launch(config: DaemonConfig) -> subprocess.Popen:
    """Starts a supervisor in the background, detached from this terminal."""
    paths = config.paths
    paths.make()
    config.save(paths.config_file)
    log_file = open(paths.log_dir / "daemon.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "hybrid.managers.supervisor", "--config", str(paths.config_file)],
                            stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                            start_new_session=True)
    log_file.close()
    return proc


def stop_daemon(paths: DaemonPaths, timeout_s: float = API_STOP_S + ENGINE_STOP_S + 5) -> dict:
    """Stops the running supervisor gracefully, killing its process group if it overstays."""
    record = running_daemon(paths)
    if record is None:
        raise DaemonError("hybridd is not running")
    pid = record["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and psutil.pid_exists(pid):
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.1)
    else:
        _kill_tree(pid)
    paths.pid_file.unlink(missing_ok=True)
    return record


def _kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybridd supervisor")
    ap.add_argument("--config", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return Supervisor(DaemonConfig.load(Path(a.config))).run()


if __name__ == "__main__":
    sys.exit(main())
