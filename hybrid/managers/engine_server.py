"""The engine process: runs `LLMEngine` behind ZeroMQ for the api process.

Messages are the typed structs of hybrid/managers/messages.py. In (PULL): AddRequest, AbortRequest, Hello (a
restarted api asks for Ready; the requests of the api before it are aborted, as nobody reads their tokens). Out
(PUSH): Progress while packing/loading, Ready with the engine's facts, TokenDelta per new token(s), RequestFailed
for a request the engine cannot finish, and EngineStats every STATS_PERIOD_S and between steps (the api process
treats a silent engine as hung). If the expert process dies, every in-flight request gets an error, the expert
process is restarted and the engine keeps serving.

`--role prefill|decode` runs one half of a disaggregated pair (prefill_server.py, decode_server.py).
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time
from collections import deque
from pathlib import Path

import zmq

from hybrid.config.home import open_private, write_private
from hybrid.distributed.communicator import CommunicationError
from hybrid.engine.llm_engine import LLMEngine
from hybrid.engine.outputs import RequestOutput
from hybrid.experts.process.client import ExpertServerError
from hybrid.experts.process.liveness import is_stopped
from hybrid.experts.process.process_experts import ProcessExperts
from hybrid.managers.daemon_config import DaemonConfig
from hybrid.managers.messages import (
    AbortRequest,
    AddRequest,
    DecodeError,
    EngineInfo,
    EngineStats,
    Fatal,
    FromEngine,
    Hello,
    Progress,
    Ready,
    RequestFailed,
    ToEngine,
    TokenDelta,
    encode,
    request_id_of,
    to_engine_decoder,
)
from hybrid.parent_watch import watch_parent
from hybrid.process_exit import exit_after

log = logging.getLogger("hybridd.engine")

STATS_PERIOD_S = 0.25
RATE_WINDOW_S = 5.0
DRAIN_S = 5.0  # on SIGTERM, how long running requests may finish before the rest are failed


class EngineServer:
    role = "engine"

    def __init__(self, config: DaemonConfig):
        self.config = config
        self._ctx = zmq.Context()
        self.inbox = self._ctx.socket(zmq.PULL)
        self.inbox.bind(config.paths.inbox(self.role))
        self.outbox = self._ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(config.paths.engine_out)
        self.engine: LLMEngine | None = None
        self.in_flight: set[str] = set()  # request ids from the api that have not finished
        self.stopping = False
        self.handoffs_waited = 0
        self.handoffs_moved, self.handoff_seconds = 0, 0.0
        self._generated: deque[tuple[float, int]] = deque()
        self._last_stats = 0.0

    def send(self, msg: FromEngine) -> None:
        self.outbox.send(encode(msg))

    def load(self) -> None:
        engine_config = self.config.engine_config(self.role)
        if engine_config.experts == "process" and engine_config.expert_server is None:
            self._pack(engine_config)
        elif self.config.disagg and engine_config.backend == "cpu" and engine_config.expert_pack is None:
            # Both engines of a pair map one pack rather than each packing the experts into its own memory.
            engine_config.expert_pack = self._pack(engine_config)
        self.send(Progress("loading model", role=self.role))
        self.engine = LLMEngine(engine_config)
        self.send(Ready(os.getpid(), self.info(), self.role))
        write_private(self.config.paths.ready_file(self.role), str(os.getpid()))

    def _pack(self, engine_config) -> Path:
        """Writes the expert pack unless a current one exists (one engine at a time: a pair shares it)."""
        from hybrid.config import ModelConfig
        from hybrid.experts.pack import engine_pack, is_current

        model = ModelConfig.from_dir(engine_config.model)
        fmt, pack_dir = engine_pack(model, engine_config.expert_format, engine_config.expert_pack)
        pack_dir.parent.mkdir(parents=True, exist_ok=True)
        with open_private_lock(pack_dir.with_name(pack_dir.name + ".lock")):
            if not is_current(pack_dir, model, fmt):
                self._write_pack(engine_config, model, fmt, pack_dir)
        return pack_dir

    def _write_pack(self, engine_config, model, fmt: str, pack_dir: Path) -> None:
        from hybrid.experts.pack import expert_bytes_to_read, write_pack

        total, done, last = expert_bytes_to_read(model), 0, 0.0

        def progress(n: int) -> None:
            nonlocal done, last
            done += n
            if time.monotonic() - last > 0.2:
                last = time.monotonic()
                self.send(Progress("packing experts", done, total, self.role))

        log.info("packing %s experts as %s into %s", model.model_dir, fmt, pack_dir)
        write_pack(engine_config.model, pack_dir, fmt, progress=progress)
        release_freed_memory()

    def info(self) -> EngineInfo:
        e = self.engine
        return EngineInfo(
            model=self.config.model_name, model_dir=str(e.model_config.model_dir),
            architecture=e.model_config.model_type, max_model_len=e.max_model_len,
            vocab_size=e.model_config.vocab_size, num_kv_blocks=e.runner.kv_pool.num_blocks,
            block_size=e.config.block_size, max_num_seqs=e.config.max_num_seqs,
            mode="hybrid" if e.config.hybrid else "cpu-only",
            devices=[e.config.device] + (["experts: cpu"] if e.config.hybrid else []) + self.small_ep_devices(),
            attention=e.config.attention, overlap=e.config.overlap if e.config.hybrid else "off",
            backend=e.config.backend,
            kernel_path=self.kernel_path(), experts=e.config.experts, expert_pid=self.expert_pid(),
            parallel=self.parallel(), gpus=e.config.gpus, expert_format=e.config.expert_format,
            dense_format=e.config.dense_format,
            max_num_batched_tokens=e.config.max_num_batched_tokens, slp_max_tokens=e.config.slp_max_tokens,
        )

    def small_ep_devices(self) -> list[str]:
        if getattr(self.engine.runner.experts, "peers", None) is None:
            return []
        from hybrid.experts.small_ep import rank_devices

        config = self.engine.config
        return ["streamed experts (SmallEP): " + ", ".join(map(str, rank_devices(config.device, config.gpus)))]

    def parallel(self) -> dict | None:
        run = self.engine.runner.parallel
        if run is None:
            return None
        comm = run.state.tp_comm
        return {"tp": self.engine.config.tp, "pp": self.engine.config.pp, "all_reduce": comm.name if comm else None}

    def kernel_path(self) -> str:
        from cpu_kernels.moe import kernel_isa_name

        c = self.engine.config
        if c.hybrid:
            decode = "decode graphs" if self.engine.runner.graphs is not None else "eager decode"
            return f"experts {kernel_isa_name()}, attention {c.attention} on {c.device}, {decode}"
        if c.backend != "cpu":
            return "torch reference"
        programs = self.engine.runner.graphs
        decode = "eager decode" if programs is None or programs.refused else "decode programs"
        return f"{kernel_isa_name()}, attention {c.attention}, {decode}"

    def stats(self) -> EngineStats:
        e = self.engine
        now = time.monotonic()
        while self._generated and now - self._generated[0][0] > RATE_WINDOW_S:
            self._generated.popleft()
        bm = e.scheduler.blocks
        return EngineStats(pid=os.getpid(), running=len(e.scheduler.running), waiting=len(e.scheduler.waiting),
                           kv_blocks_used=bm.num_blocks - bm.num_free, kv_blocks_total=bm.num_blocks,
                           tokens_per_s=sum(n for _, n in self._generated) / RATE_WINDOW_S,
                           expert_pid=self.expert_pid(), kv_blocks_cached=bm.num_cached,
                           prefix_cache=bm.cache is not None, prefix_queried_tokens=e.scheduler.queried_tokens,
                           prefix_hit_tokens=e.scheduler.hit_tokens, role=self.role, handoffs=self.handoffs(),
                           handoffs_waited=self.handoffs_waited, handoffs_moved=self.handoffs_moved,
                           handoff_seconds=self.handoff_seconds,
                           slp=self.slp())

    def slp(self) -> dict | None:
        """Streamed prefill's use so far, when this engine streams."""
        experts = self.engine.runner.experts
        stats = getattr(experts, "stats", None)
        if stats is None:
            return None
        window = experts.window()
        peers = experts.peers
        return {"threshold": window[0] if window else None, "passes": stats.passes, "tokens": stats.tokens,
                "streamed_bytes": stats.streamed_bytes, "seconds": stats.seconds, "gb_per_s": stats.gb_per_s,
                "devices": experts.devices, "peer_bytes": stats.peer_bytes,
                "peer_pids": [p.pid for p in peers.processes] if peers is not None else []}

    def handoffs(self) -> int:
        return 0

    def expert_pid(self) -> int | None:
        experts = self.process_experts()
        return experts.client.server_pid if experts is not None else None

    def process_experts(self) -> ProcessExperts | None:
        """The expert process's client, also when hot experts on the device wrap it."""
        experts = self.engine.runner.experts
        while not isinstance(experts, ProcessExperts) and hasattr(experts, "remote"):
            experts = experts.remote  # hot experts and streamed prefill wrap it
        return experts if isinstance(experts, ProcessExperts) else None

    def receive(self, raw: bytes) -> None:
        try:
            msg = to_engine_decoder.decode(raw)
        except DecodeError as e:
            log.warning("refusing a malformed message: %s", e)
            rid = request_id_of(raw)
            if rid is not None:
                self.fail(rid, 400, f"malformed request: {e}")
            return
        self.handle(msg)

    def handle(self, msg: ToEngine) -> None:
        if isinstance(msg, AddRequest):
            if self.stopping:
                self.send(RequestFailed(msg.request_id, 503, "hybridd is stopping; the request was not started"))
                return
            if msg.request_id in self.in_flight:  # failing it by its id would end the request running under it
                log.error("ignored a second request with the id %r of one that is running", msg.request_id)
                return
            try:
                self.engine.add_request(msg.prompt_ids, msg.params, msg.request_id)
            except ValueError as e:
                self.fail(msg.request_id, 400, str(e))
                return
            self.in_flight.add(msg.request_id)
        elif isinstance(msg, Hello):
            # A restarted api: the requests in flight were its predecessor's, whose clients are gone with it.
            if self.in_flight:
                before = len(self.in_flight)
                self.fail_all(503, "the api that took this request restarted")
                log.warning("the api restarted: ended the %d requests its predecessor had sent",
                            before - len(self.in_flight))
            self.send(Ready(os.getpid(), self.info(), self.role))
        elif isinstance(msg, AbortRequest):
            if msg.request_id in self.in_flight:
                self.in_flight.discard(msg.request_id)
                self.engine.abort(msg.request_id)
        else:
            log.warning("ignoring a %s message, which a %s engine does not take", type(msg).__name__, self.role)

    def fail(self, request_id: str, status: int, message: str) -> None:
        """Tells the api a request failed; one still running here is aborted, as the api has dropped it."""
        if request_id in self.in_flight:
            self.in_flight.discard(request_id)
            self.engine.abort(request_id)
        self.send(RequestFailed(request_id, status, message))

    def fail_all(self, status: int, message: str) -> None:
        for rid in list(self.in_flight):
            self.fail(rid, status, message)

    def emit(self, out: RequestOutput) -> None:
        if out.request_id not in self.in_flight:
            return
        if out.error is not None:
            self.in_flight.discard(out.request_id)
            self.send(RequestFailed(out.request_id, out.error_status, out.error))
            return
        self._generated.append((time.monotonic(), len(out.new_token_ids)))
        first = len(out.token_ids) == len(out.new_token_ids)
        self.send(TokenDelta(out.request_id, out.new_token_ids, out.new_text, out.finished, out.finish_reason,
                             len(out.prompt_token_ids), len(out.token_ids), out.num_cached_tokens, out.new_logprobs,
                             out.prompt_logprobs if first else None))
        if out.finished:
            self.in_flight.discard(out.request_id)

    def step(self) -> None:
        try:
            outputs = self.engine.step()
        except ExpertServerError as e:
            self.restart_experts(f"the expert process failed ({e})")
            return
        except CommunicationError as e:  # a rank of the parallel run is gone: the supervisor restarts the engine
            self.fail_all(503, f"the parallel run lost a rank ({e}); hybridd is restarting the engine, retry the "
                               "request")
            raise
        for out in outputs:
            self.emit(out)
        self.after_step()

    def after_step(self) -> None:
        """What a role does once a step's outputs are out (a prefill engine offers its prefilled sequences)."""

    def before_step(self) -> None:
        """What a role does before deciding whether to step (a decode engine takes over waiting hand-offs)."""

    def check_experts(self) -> None:
        """Restarts an expert process that is stopped (its liveness check), also when no call is waiting on it."""
        experts = self.process_experts()
        if experts is not None and experts.respawn is not None and is_stopped(experts.client.server_pid):
            self.restart_experts(f"the expert process (pid {experts.client.server_pid}) is stopped")

    def restart_experts(self, reason: str) -> None:
        """Fails every in-flight request with `reason` and replaces the expert process."""
        log.error("%s; restarting it", reason)
        self.fail_all(503, f"{reason}; hybridd is restarting it, retry the request")
        experts = self.process_experts()
        if experts is not None:
            experts.restart()
            log.info("expert process restarted (pid %d)", experts.client.server_pid)
            self.send(Ready(os.getpid(), self.info(), self.role))  # so /status shows the new expert pid

    def serve(self) -> None:
        """Runs until SIGTERM, then drains: new requests are refused, running ones get DRAIN_S to finish, and
        whatever is left is failed so that every stream ends with an error event rather than a cut."""
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        drain_until = None
        while drain_until is None or (self.in_flight and time.monotonic() < drain_until):
            if self.stopping and drain_until is None:
                drain_until = time.monotonic() + DRAIN_S
                log.info("stopping: draining %d requests for up to %.0fs", len(self.in_flight), DRAIN_S)
            busy = self.engine.has_unfinished()
            if poller.poll(0 if busy else int(STATS_PERIOD_S * 1000)):
                while True:
                    try:
                        raw = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.receive(raw)
            self.before_step()
            if self.engine.has_unfinished():
                self.step()
            if time.monotonic() - self._last_stats >= STATS_PERIOD_S or not busy:
                self._last_stats = time.monotonic()
                self.check_experts()
                self.send(self.stats())
        self.fail_all(503, "hybridd is stopping; the request was aborted")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.inbox.close(linger=0)
        self.outbox.close()
        self._ctx.term()


def release_freed_memory() -> None:
    """Returns the heap glibc keeps after a large job (packing leaves about the pack's size behind) to the OS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def open_private_lock(path: Path):
    """An exclusive flock on path (created private), released when the returned file is closed."""
    import fcntl

    f = os.fdopen(open_private(path, os.O_RDWR | os.O_CREAT), "r+")
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybridd engine process")
    ap.add_argument("--config", required=True, help="daemon.json written by the supervisor")
    ap.add_argument("--role", default="engine", choices=["engine", "prefill", "decode"])
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.role == "engine":
        server_class = EngineServer
    elif a.role == "prefill":
        from hybrid.managers.prefill_server import PrefillServer as server_class
    else:
        from hybrid.managers.decode_server import DecodeServer as server_class
    server = server_class(DaemonConfig.load(a.config))

    def stop(*_) -> None:
        if server.engine is None:  # still packing or loading: nothing to finish, so stop at once
            raise SystemExit(0)
        server.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    watch_parent(os.getppid())  # a supervisor that was killed leaves no engine behind
    try:
        server.load()
        server.serve()
    except Exception as e:
        log.exception("engine failed")
        server.send(Fatal(f"{type(e).__name__}: {e}", server.role))
        return 1
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    exit_after(main)
