"""The api process's side of the engines: submit requests, stream their outputs, watch the engines' health.

`EngineClient.generate` yields the engine's TokenDelta messages for one request and raises `EngineError`
when the engine refuses it, fails it, dies or falls silent; no caller ever waits on a dead engine.

There is one engine, or a disaggregated pair: new requests go to the prefill engine, and a request the decode
engine has taken over (TakenOver) lives there. Both stream into one socket, so each request's deltas are put
back in token order (a delta says where its tokens start), and an engine's death fails only the requests that
live in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import psutil
import zmq
import zmq.asyncio

from hybrid.managers import messages
from hybrid.sampling_params import SamplingParams

log = logging.getLogger("hybridd.api")

WATCH_PERIOD_S = 0.2
HELLO_RESEND_S = 1.0


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
    greeted: tuple[int, float] | None = None  # the engine pid this api last sent a Hello, and when

    def describe(self) -> str:
        return f"the engine is {self.status}" + (f": {self.reason}" if self.reason else "")


STATUS_ORDER = ("down", "starting", "loading", "ready")  # the pair is as far as its least advanced engine


@dataclass
class Stream:
    """One request in flight: where its deltas and errors go, the engine it lives in, and its token order (the
    index of the next completion token to deliver, and deltas that arrived ahead of their turn)."""

    role: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    next_token: int = 0
    held: dict[int, messages.TokenDelta] = field(default_factory=dict)


class EngineClient:
    def __init__(self, inboxes: dict[str, str], engine_out: str, hang_timeout_s: float = 120.0):
        """inboxes: each engine role's address, the one taking new requests first."""
        self.inboxes, self.engine_out, self.hang_timeout_s = inboxes, engine_out, hang_timeout_s
        self.roles = list(inboxes)
        self.engines = {role: EngineState() for role in self.roles}
        self._streams: dict[str, Stream] = {}
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PULL)
        self._in.bind(self.engine_out)
        self._out = {}
        for role, address in self.inboxes.items():
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._out[role] = sock
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._fail_all(EngineError("hybridd is stopping", 503))
        self._in.close(linger=0)
        for sock in self._out.values():
            sock.close(linger=0)
        self._ctx.term()

    @property
    def state(self) -> EngineState:
        """The one engine's state, or the pair's: ready when both are, else the least advanced one's."""
        if len(self.roles) == 1:
            return self.engines[self.roles[0]]
        worst = min(self.engines.values(), key=lambda s: STATUS_ORDER.index(s.status))
        first = self.engines[self.roles[0]]
        return EngineState(status=worst.status, reason=worst.reason, pid=first.pid, info=first.info,
                           stats=first.stats, progress=worst.progress, last_seen=worst.last_seen,
                           restarts=sum(s.restarts for s in self.engines.values()))

    @property
    def ready(self) -> bool:
        return all(s.status == "ready" for s in self.engines.values())

    async def _send(self, msg: messages.ToEngine, role: str | None = None) -> None:
        await self._out[role or self.roles[0]].send(messages.encode(msg))

    async def _abort(self, request_id: str) -> None:
        """Tells every engine to drop the request (the one holding it does); never waits on a dead one."""
        for sock in self._out.values():
            try:
                await sock.send(messages.encode(messages.AbortRequest(request_id)), zmq.NOBLOCK)
            except zmq.Again:
                pass

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[messages.TokenDelta]:
        """Yields TokenDelta messages until the one with finished=True; aborts the request if the caller stops."""
        if not self.ready:
            raise EngineError(self.state.describe())
        if request_id in self._streams:
            raise EngineError(f"request id {request_id!r} is already in flight", 400)
        stream = self._streams[request_id] = Stream(self.roles[0])
        finished = False
        try:
            await self._send(messages.AddRequest(request_id, prompt_ids, params))
            while not finished:
                msg = await stream.queue.get()
                if isinstance(msg, EngineError):
                    # Aborted below too: an engine that failed the request has dropped it already, but one that
                    # was only silent past the hang timeout may wake up and would run it to its max_tokens.
                    raise msg
                finished = msg.finished
                yield msg
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                await self._abort(request_id)

    def _deliver(self, msg: messages.TokenDelta) -> None:
        """Queues a request's delta in token order, holding one that arrived before its predecessor."""
        stream = self._streams.get(msg.request_id)
        start = msg.completion_tokens - len(msg.token_ids)
        if stream is None or start < stream.next_token:
            return  # dropped by its caller, or already delivered
        stream.held[start] = msg
        while (delta := stream.held.pop(stream.next_token, None)) is not None:
            stream.queue.put_nowait(delta)
            stream.next_token += len(delta.token_ids)

    async def _receive(self) -> None:
        while True:
            raw = await self._in.recv()
            try:
                msg = messages.from_engine_decoder.decode(raw)
            except messages.DecodeError as e:
                log.error("ignoring a malformed message from the engine: %s", e)
                continue
            if isinstance(msg, messages.TokenDelta):
                self._deliver(msg)
            elif isinstance(msg, messages.RequestFailed):
                if (stream := self._streams.get(msg.request_id)) is not None:
                    stream.queue.put_nowait(EngineError(msg.message, msg.status))
            elif isinstance(msg, messages.TakenOver):
                stream, decode = self._streams.get(msg.request_id), self.engines.get("decode", EngineState("down"))
                if stream is not None and decode.status == "ready":
                    stream.role = "decode"
                else:  # failed here meanwhile, or taken by a decode engine already known to be gone
                    if stream is not None:
                        stream.queue.put_nowait(EngineError(decode.describe(), 503))
                    await self._abort(msg.request_id)
            elif msg.role not in self.engines:
                log.error("ignoring a message from a %s engine, which this daemon does not run", msg.role)
                continue
            else:
                await self._engine_message(msg, self.engines[msg.role])
            role = getattr(msg, "role", None)  # per-request messages do not say which engine sent them; stats do
            if role in self.engines:
                self.engines[role].last_seen = time.monotonic()

    async def _engine_message(self, msg, state: EngineState) -> None:
        if isinstance(msg, messages.EngineStats):
            state.stats = msg
            # An engine that was ready before this api started: asked for its Ready, again only if none has come
            # within HELLO_RESEND_S (its stats keep coming until it does). A repeated Hello ends nothing of this
            # api's: it sends no request before that Ready, and the engine reads its messages in order.
            now = time.monotonic()
            if msg.pid != state.pid and (state.greeted is None or state.greeted[0] != msg.pid
                                         or now - state.greeted[1] > HELLO_RESEND_S):
                state.greeted = (msg.pid, now)
                await self._send(messages.Hello(), msg.role)
            elif state.status == "down" and self._alive(msg.pid):
                state.status, state.reason = "ready", ""
        elif isinstance(msg, messages.Ready):
            if state.pid is not None and state.pid != msg.pid:
                state.restarts += 1
            state.pid, state.info, state.progress = msg.pid, msg.info, None
            state.status, state.reason = "ready", ""
            log.info("%s ready (pid %d)", self._name(msg.role), msg.pid)
        elif isinstance(msg, messages.Progress):
            state.progress = msg
            if state.status != "ready":
                state.status = "loading"
        elif isinstance(msg, messages.Fatal):
            self._down(msg.role, f"the {self._name(msg.role)} failed: {msg.message}")

    @staticmethod
    def _name(role: str) -> str:
        return "engine" if role == "engine" else f"{role} engine"

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            for role, s in self.engines.items():
                if s.status != "ready":
                    continue
                name = self._name(role)
                if not self._alive(s.pid):
                    self._down(role, f"the {name} process (pid {s.pid}) exited; the supervisor is restarting it")
                elif time.monotonic() - s.last_seen > self.hang_timeout_s:
                    self._down(role, f"the {name} process (pid {s.pid}) has not answered for "
                                     f"{self.hang_timeout_s:.0f}s")

    @staticmethod
    def _alive(pid: int | None) -> bool:
        try:
            return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def _down(self, role: str, reason: str) -> None:
        """An engine is gone: the requests living in it fail; the other engine's go on."""
        log.error("%s", reason)
        self.engines[role].status, self.engines[role].reason = "down", reason
        self._fail_all(EngineError(reason, 503), role)

    def _fail_all(self, error: EngineError, role: str | None = None) -> None:
        for stream in self._streams.values():
            if role is None or stream.role == role:
                stream.queue.put_nowait(error)
