"""The api process's side of the engine: submit requests, stream their outputs, watch the engine's health.

`EngineClient.generate` yields the engine's TokenDelta messages for one request and raises `EngineError`
when the engine refuses it, fails it, dies or falls silent; no caller ever waits on a dead engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import psutil
import zmq
import zmq.asyncio

from hybrid.managers import messages
from hybrid.sampling_params import SamplingParams

log = logging.getLogger("hybridd.api")

WATCH_PERIOD_S = 0.2


class EngineError(Exception):
    """A request the engine refused (status 4xx) or could not finish (5xx)."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


@dataclass
class EngineState:
    """What /health and /status report: `status` is starting, loading, ready or down."""

    status: str = "starting"
    reason: str = ""
    pid: int | None = None
    info: messages.EngineInfo | None = None
    stats: messages.EngineStats | None = None
    progress: messages.Progress | None = None
    last_seen: float = 0.0
    restarts: int = 0

    def describe(self) -> str:
        return f"the engine is {self.status}" + (f": {self.reason}" if self.reason else "")


class EngineClient:
    def __init__(self, engine_in: str, engine_out: str, hang_timeout_s: float = 120.0):
        self.engine_in, self.engine_out, self.hang_timeout_s = engine_in, engine_out, hang_timeout_s
        self.state = EngineState()
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._in.bind(self.engine_out)
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.connect(self.engine_in)
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._fail_all(EngineError("hybridd is stopping", 503))
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()

    @property
    def ready(self) -> bool:
        return self.state.status == "ready"

    async def _send(self, msg: messages.ToEngine) -> None:
        await self._out.send(messages.encode(msg))

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[messages.TokenDelta]:
        """Yields TokenDelta messages until the one with finished=True; aborts the request if the caller stops."""
        if not self.ready:
            raise EngineError(self.state.describe())
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already in flight", 400)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._send(messages.AddRequest(request_id, prompt_ids, params))
            while not finished:
                msg = await queue.get()
                if isinstance(msg, EngineError):
                    finished = True
                    raise msg
                finished = msg.finished
                yield msg
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.ready:
                await self._send(messages.AbortRequest(request_id))

    async def _receive(self) -> None:
        while True:
            raw = await self._in.recv()
            try:
                msg = messages.from_engine_decoder.decode(raw)
            except messages.DecodeError as e:
                log.error("ignoring a malformed message from the engine: %s", e)
                continue
            self.state.last_seen = time.monotonic()
            if isinstance(msg, (messages.TokenDelta, messages.RequestFailed)):
                queue = self._queues.get(msg.request_id)
                if queue is not None:
                    failed = isinstance(msg, messages.RequestFailed)
                    queue.put_nowait(EngineError(msg.message, msg.status) if failed else msg)
            elif isinstance(msg, messages.EngineStats):
                self.state.stats = msg
                if msg.pid != self.state.pid:
                    await self._send(messages.Hello())  # an engine that was ready before this api started
                elif self.state.status == "down" and self._alive(msg.pid):
                    self.state.status, self.state.reason = "ready", ""
            elif isinstance(msg, messages.Ready):
                if self.state.pid is not None and self.state.pid != msg.pid:
                    self.state.restarts += 1
                self.state.pid, self.state.info, self.state.progress = msg.pid, msg.info, None
                self.state.status, self.state.reason = "ready", ""
                log.info("engine ready (pid %d)", msg.pid)
            elif isinstance(msg, messages.Progress):
                self.state.progress = msg
                if self.state.status != "ready":
                    self.state.status = "loading"
            elif isinstance(msg, messages.Fatal):
                self._down(f"the engine failed: {msg.message}")

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            s = self.state
            if s.status != "ready":
                continue
            if not self._alive(s.pid):
                self._down(f"the engine process (pid {s.pid}) exited; the supervisor is restarting it")
            elif time.monotonic() - s.last_seen > self.hang_timeout_s:
                self._down(f"the engine process (pid {s.pid}) has not answered for {self.hang_timeout_s:.0f}s")

    @staticmethod
    def _alive(pid: int | None) -> bool:
        try:
            return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _down(self, reason: str) -> None:
        log.error("%s", reason)
        self.state.status, self.state.reason = "down", reason
        self._fail_all(EngineError(reason, 503))

    def _fail_all(self, error: EngineError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
