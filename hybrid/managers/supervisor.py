"""The supervisor: starts the api and engine processes, restarts whichever dies, and stops them cleanly.

Disaggregated (--disagg) it runs a prefill and a decode engine, each pinned to its own share of the cores (with
its kernel pool, and its expert process if it has one), so that decode never waits behind a prefill's experts.

Also the helpers `hybridd start/stop` use to find, launch and stop a supervisor through its pid file.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from hybrid.config import ConfigError
from hybrid.config.home import PRIVATE_UMASK, open_private, write_private
from hybrid.managers.daemon_config import DaemonConfig, DaemonPaths

log = logging.getLogger("hybridd.supervisor")

POLL_S = 0.2
RESTART_WINDOW_S = 60.0
MAX_BACKOFF_S = 30.0
# A process that exits this many times in a row before it became ready (an engine that never loaded, an api that
# never listened) is not restarted again: the daemon stops, saying which process and where its log is (a bad
# model file, a full disk, a missing library would otherwise be retried forever). One that was serving when it
# died is always restarted.
MAX_FAILED_STARTS = 5
# A log past LOG_ROTATE_BYTES is copied to NAME.log.1 (replacing the one before) and emptied in place, checked
# every LOG_CHECK_S: the processes keep appending to it, so a daemon that runs for months holds two logs' worth.
LOG_ROTATE_BYTES = 64 << 20
LOG_CHECK_S = 10.0
API_STOP_S = 20.0
ENGINE_STOP_S = 20.0  # the engine drains for engine_server.DRAIN_S, then fails what is left, then stops its experts
ALREADY_RUNNING_EXIT = 3
ROLE_MODULES = {"api": "server.api_server", "engine": "hybrid.managers.engine_server",
                "prefill": "hybrid.managers.engine_server", "decode": "hybrid.managers.engine_server"}


def core_split(cores: list[int], prefill_cores: int | None) -> dict[str, list[int]]:
    """The cores of the decode and prefill engines: prefill gets prefill_cores (default half, rounded down) of the
    last ones, decode the rest; on one core both share it. Raises ConfigError when prefill_cores leaves decode none."""
    if len(cores) < 2:
        return {"decode": cores, "prefill": cores}
    if prefill_cores is not None and prefill_cores >= len(cores):
        raise ConfigError(f"--prefill-cores {prefill_cores} leaves the decode engine no core: hybridd may use "
                          f"{len(cores)} here")
    k = prefill_cores or len(cores) // 2
    return {"decode": cores[:len(cores) - k], "prefill": cores[len(cores) - k:]}


class DaemonError(RuntimeError):
    """The daemon cannot be started or stopped as asked."""


@dataclass
class Child:
    role: str
    proc: subprocess.Popen | None = None
    start_after: float = 0.0
    ready: bool = False  # this run of it became ready
    failed_starts: int = 0  # exits in a row before becoming ready
    exits: list[tuple[float, int]] = field(default_factory=list)  # (time, exit code) within RESTART_WINDOW_S


class Supervisor:
    def __init__(self, config: DaemonConfig):
        self.config = config
        self.paths = config.paths
        self.children = {role: Child(role) for role in ["api"] + config.engine_roles}
        self.cores = core_split(sorted(os.sched_getaffinity(0)), config.prefill_cores) if config.disagg else {}
        self.stopping = False
        self.gave_up: str | None = None  # why the daemon stopped by itself

    def spawn(self, child: Child) -> None:
        log_file = os.fdopen(open_private(self.paths.log_dir / f"{child.role}.log"), "ab")
        cmd = [sys.executable, "-m", ROLE_MODULES[child.role], "--config", str(self.paths.config_file)]
        if child.role != "api":
            cmd += ["--role", child.role]
        cores = self.cores.get(child.role)
        child.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                      preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        log_file.close()
        child.ready = False
        self.paths.ready_file(child.role).unlink(missing_ok=True)
        log.info("started %s (pid %d%s)", child.role, child.proc.pid,
                 f", cores {','.join(map(str, cores))}" if cores else "")

    def check(self, child: Child) -> None:
        """Restarts a child that exited, backing off when it keeps dying, and stops the daemon once it has died
        MAX_FAILED_STARTS times in a row before becoming ready."""
        if self.stopping:
            return
        now = time.monotonic()
        if child.proc is not None and child.proc.poll() is None and not child.ready:
            child.ready = self.is_ready(child)
        if child.proc is not None and child.proc.poll() is not None:
            log_path = self.paths.log_dir / f"{child.role}.log"
            child.failed_starts = 0 if child.ready or self.is_ready(child) else child.failed_starts + 1
            child.exits = [e for e in child.exits if now - e[0] < RESTART_WINDOW_S] + [(now, child.proc.returncode)]
            self.record_exits(now)
            if child.failed_starts >= MAX_FAILED_STARTS:
                self.gave_up = (f"{child.role} exited {child.failed_starts} times in a row before it was ready (last "
                                f"exit code {child.proc.returncode}); hybridd stopped instead of restarting it "
                                f"again: see {log_path}")
                log.error("%s", self.gave_up)
                child.proc, self.stopping = None, True
                return
            log.error("%s (pid %d) exited with code %s; restarting it (log: %s)", child.role, child.proc.pid,
                      child.proc.returncode, log_path)
            child.proc = None
            child.start_after = now + min(2.0 ** (len(child.exits) - 1) - 1, MAX_BACKOFF_S)
        if child.proc is None and now >= child.start_after:
            self.spawn(child)

    def is_ready(self, child: Child) -> bool:
        """An engine is ready once it has written its pid to its ready file (after loading); the api once its
        port takes connections."""
        if child.role != "api":
            try:
                return self.paths.ready_file(child.role).read_text() == str(child.proc.pid)
            except OSError:
                return False
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.config.host, self.config.host)
        try:
            socket.create_connection((host, self.config.port), timeout=0.05).close()
        except OSError:
            return False
        return True

    def record_exits(self, now: float) -> None:
        """Each role's exit codes within the restart window, for a starting `hybridd start` to read."""
        exits = {c.role: [code for t, code in c.exits if now - t < RESTART_WINDOW_S] for c in self.children.values()}
        write_private(self.paths.exits_file, json.dumps({"supervisor": os.getpid(),
                                                         "create_time": psutil.Process().create_time(),
                                                         "exits": exits}))

    def run(self) -> int:
        """Serves until SIGTERM/SIGINT; raises DaemonError if another supervisor holds this home's lock."""
        self.paths.make()
        lock = take_lock(self.paths)
        try:
            return self._run()
        finally:
            os.close(lock)

    def _run(self) -> int:
        self.config.save(self.paths.config_file)
        self.paths.exits_file.unlink(missing_ok=True)
        write_pid_file(self.paths, {"pid": os.getpid(), "url": self.config.url, "model": self.config.model_name,
                                    "api_key": self.config.api_key_sha256 is not None,
                                    "create_time": psutil.Process().create_time()})
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("supervising %s at %s", self.config.model_name, self.config.url)
        logs_checked = time.monotonic()
        try:
            while not self.stopping:
                for child in self.children.values():
                    self.check(child)
                if time.monotonic() - logs_checked > LOG_CHECK_S:
                    logs_checked = time.monotonic()
                    for name in rotate_logs(self.paths.log_dir):
                        log.info("%s passed %d MiB: its older lines are in %s.1", name, LOG_ROTATE_BYTES >> 20, name)
                time.sleep(POLL_S)
            self.shutdown()
        finally:
            for child in self.children.values():
                if child.proc is not None and child.proc.poll() is None:
                    child.proc.kill()
            self.paths.pid_file.unlink(missing_ok=True)
            if not self.gave_up:  # kept, it says why to a `hybridd start` that reads it after this exits
                self.paths.exits_file.unlink(missing_ok=True)
        log.info("stopped")
        return 1 if self.gave_up else 0

    def _stop(self, *_) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        """The engine first: it refuses new requests, lets running ones finish for a moment, fails what is left
        (each stream gets an error event and [DONE] from the api) and stops the expert process; then the api,
        whose streams have all ended."""
        for roles, limit in ((self.config.engine_roles, ENGINE_STOP_S), (["api"], API_STOP_S)):
            procs = {role: self.children[role].proc for role in roles}
            procs = {role: p for role, p in procs.items() if p is not None and p.poll() is None}
            for proc in procs.values():
                proc.terminate()
            deadline = time.monotonic() + limit
            for role, proc in procs.items():
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs; killing it", role, limit)
                    proc.kill()
                    proc.wait()


def rotate_logs(log_dir: Path, limit: int = LOG_ROTATE_BYTES) -> list[str]:
    """Copies each log over `limit` bytes to NAME.1 and empties it (its writers append, so they go on at its new
    end; lines written during the copy may be lost); returns the names rotated."""
    rotated = []
    for path in sorted(log_dir.glob("*.log")):
        try:
            if path.stat().st_size <= limit:
                continue
            with open(path, "rb") as src, os.fdopen(open_private(path.with_name(path.name + ".1"),
                                                                 os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.truncate(path, 0)
        except OSError as e:
            log.warning("could not rotate %s: %s", path, e)
            continue
        rotated.append(path.name)
    return rotated


def take_lock(paths: DaemonPaths) -> int:
    """An exclusive lock on this home for the supervisor's lifetime, so two `hybridd start` at the same moment
    give one supervisor; the kernel releases it when the process dies, however it dies."""
    fd = open_private(paths.lock_file, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DaemonError(f"hybridd is already running with HYBRIDD_HOME={paths.home}; `hybridd stop` stops it") \
            from None
    return fd


def write_pid_file(paths: DaemonPaths, record: dict) -> None:
    write_private(paths.pid_file, json.dumps(record))


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
    # Not daemon.json: a supervisor that loses the lock race must not overwrite the running one's settings.
    request = paths.run_dir / f"start-{os.getpid()}.json"
    config.save(request)
    log_file = os.fdopen(open_private(paths.log_dir / "daemon.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-m", "hybrid.managers.supervisor", "--config", str(request),
                             "--remove-config"], stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
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
    ap.add_argument("--remove-config", action="store_true", help="delete --config once read")
    a = ap.parse_args(argv)
    os.umask(PRIVATE_UMASK)  # sockets, logs and packs the daemon's processes create are private to this user
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = DaemonConfig.load(Path(a.config))
    if a.remove_config:
        Path(a.config).unlink(missing_ok=True)
    try:
        return Supervisor(config).run()
    except DaemonError as e:
        log.error("%s", e)
        return ALREADY_RUNNING_EXIT


if __name__ == "__main__":
    sys.exit(main())
