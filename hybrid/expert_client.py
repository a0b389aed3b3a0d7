"""The engine's side of the expert process: spawning it, registering, and per-layer calls through slots.

`ExpertClient.submit(layer, hidden, topk_ids, topk_weights)` copies one call into a free shared-memory
slot and rings its doorbell; `handle.wait()` returns the output. Every wait is bounded: a dead or
stalled expert process gives an `ExpertServerError` instead of a hang. `ProcessExperts` puts this
behind the same `Experts` interface the in-process kernels implement.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from cpu_kernels.thread_pool import unpin_child
from hybrid.expert_server import CALL_BYTE
from hybrid.expert_slots import (
    DONE_SEQ,
    DTYPE,
    DTYPE_CODES,
    LAYER,
    REQUEST_SEQ,
    STATUS,
    TOKENS,
    TOPK,
    ExpertSlots,
    SlotLayout,
)
from hybrid.models.experts import Experts

POLL_S = 0.05


class ExpertServerError(RuntimeError):
    """The expert process died, stalled past its timeout, or refused a call."""


class ExpertServerProcess:
    """An expert process this engine started and owns."""

    def __init__(self, proc: subprocess.Popen, control: str):
        self.proc, self.control = proc, control

    @classmethod
    def spawn(cls, model_dir: str | Path, pack_dir: str | Path, threads: int | None = None,
              timeout_s: float = 300.0) -> "ExpertServerProcess":
        cmd = [sys.executable, "-m", "hybrid.expert_server", "--model", str(model_dir), "--pack", str(pack_dir),
               "--parent-pid", str(os.getpid())]
        if threads:
            cmd += ["--threads", str(threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, preexec_fn=unpin_child)
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            proc.kill()
            raise ExpertServerError(f"the expert process did not start within {timeout_s:.0f}s "
                                    f"(exit code {proc.poll()})")
        server = cls(proc, json.loads(line)["control"])
        atexit.register(server.stop)
        return server

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class ExpertHandle:
    """One call in flight; `wait` returns its [T, H] output (a copy, in the input dtype)."""

    def __init__(self, client: "ExpertClient", slot: int, seq: int, shape: tuple[int, int], dtype: torch.dtype):
        self.client, self.slot, self.seq, self.shape, self.dtype = client, slot, seq, shape, dtype

    def wait(self) -> torch.Tensor:
        return self.client._wait(self)


class ExpertClient:
    def __init__(self, control: str, max_tokens: int, max_topk: int, num_slots: int = 2, timeout_s: float = 30.0,
                 process: ExpertServerProcess | None = None):
        self.control, self.timeout_s, self.process = control, timeout_s, process
        self._ctx = zmq.Context.instance()
        self._sock = None
        health = self.request({"op": "health"})
        self.server_pid = health["pid"]
        reply = self.request({"op": "register", "max_tokens": max_tokens, "max_topk": max_topk,
                              "slots": num_slots})
        self.client_id = reply["client"]
        self.slots = ExpertSlots.attach(reply["shm"], SlotLayout(reply["hidden"], max_tokens, max_topk), num_slots)
        self._req = [os.open(p, os.O_RDWR) for p in reply["requests"]]
        self._resp = [os.open(p, os.O_RDWR) for p in reply["responses"]]
        self._in_flight: dict[int, ExpertHandle] = {}
        self._next = 0

    def request(self, msg: dict) -> dict:
        """One control round trip, bounded by the client's timeout."""
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVTIMEO, int(self.timeout_s * 1000))
            self._sock.connect(self.control)
        try:
            self._sock.send(json.dumps(msg).encode())
            reply = json.loads(self._sock.recv())
        except zmq.Again:
            self._sock.close()
            self._sock = None  # a REQ socket that missed its reply cannot be reused
            raise ExpertServerError(f"the expert process at {self.control} did not answer {msg['op']!r} "
                                    f"within {self.timeout_s:.1f}s") from None
        if "error" in reply:
            raise ExpertServerError(f"expert process: {reply['error']}")
        return reply

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.alive()
        try:
            os.kill(self.server_pid, 0)
        except ProcessLookupError:
            return False
        return True

    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> ExpertHandle:
        tokens, topk = topk_ids.shape
        layout = self.slots.layout
        if tokens > layout.max_tokens or topk > layout.max_topk or hidden.shape != (tokens, layout.hidden):
            raise ValueError(f"call of {tuple(hidden.shape)} x top-{topk} does not fit slots of "
                             f"{layout.max_tokens} x {layout.hidden} x top-{layout.max_topk}")
        dtype = hidden.dtype if hidden.dtype in DTYPE_CODES else torch.float32
        slot = self._free_slot()
        self.slots.x(slot, tokens, dtype).copy_(hidden)
        self.slots.ids(slot, tokens, topk).copy_(topk_ids)
        self.slots.weights(slot, tokens, topk).copy_(topk_weights)
        ctrl = self.slots.ctrl(slot)
        ctrl[LAYER], ctrl[TOKENS], ctrl[TOPK], ctrl[DTYPE] = layer, tokens, topk, DTYPE_CODES[dtype]
        seq = int(ctrl[REQUEST_SEQ]) + 1
        ctrl[REQUEST_SEQ] = seq
        os.write(self._req[slot], CALL_BYTE)
        handle = ExpertHandle(self, slot, seq, (tokens, layout.hidden), dtype)
        self._in_flight[slot] = handle
        return handle

    def _free_slot(self) -> int:
        for i in range(self.slots.num_slots):
            slot = (self._next + i) % self.slots.num_slots
            if slot not in self._in_flight:
                self._next = slot + 1
                return slot
        raise ExpertServerError(f"all {self.slots.num_slots} expert slots have a call in flight; wait for one")

    def _wait(self, handle: ExpertHandle) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        fd = self._resp[handle.slot]
        while True:
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if ready:
                break
            if not self.alive():
                self._in_flight.pop(handle.slot, None)
                raise ExpertServerError(f"the expert process (pid {self.server_pid}) died during a layer call")
            if time.monotonic() > deadline:
                self._in_flight.pop(handle.slot, None)
                raise ExpertServerError(f"the expert process (pid {self.server_pid}) did not finish a layer call "
                                        f"within {self.timeout_s:.1f}s")
        os.read(fd, 1)
        self._in_flight.pop(handle.slot, None)
        ctrl = self.slots.ctrl(handle.slot)
        if int(ctrl[DONE_SEQ]) != handle.seq:
            raise ExpertServerError(f"expert slot {handle.slot} answered call {int(ctrl[DONE_SEQ])}, "
                                    f"expected {handle.seq}")
        if int(ctrl[STATUS]) != 0:
            raise ExpertServerError(f"expert process: {self.slots.error_text(handle.slot)}")
        return self.slots.out(handle.slot, handle.shape[0], handle.dtype).clone()

    def close(self) -> None:
        if self.alive():
            try:
                self.request({"op": "unregister", "client": self.client_id})
            except ExpertServerError:
                pass
        for fd in self._req + self._resp:
            os.close(fd)
        self._req, self._resp = [], []
        self.slots.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class ProcessExperts(Experts):
    """Routed experts computed by the expert process; `respawn` starts a fresh one (and its client) when
    this engine owns the process."""

    def __init__(self, client: ExpertClient, respawn: Callable[[], ExpertClient] | None = None):
        self.client, self.respawn = client, respawn

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return self.submit(layer, hidden_states, topk_ids, topk_weights)()

    def submit(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        handle = self.client.submit(layer, hidden_states, topk_ids, topk_weights)
        return lambda: handle.wait().to(hidden_states.device, hidden_states.dtype)

    def restart(self) -> None:
        """Replaces a dead or stalled expert process this engine started."""
        if self.respawn is None:
            raise ExpertServerError(f"the expert process at {self.client.control} was not started by this engine; "
                                    "restart it there")
        self.close()
        self.client = self.respawn()

    def close(self) -> None:
        self.client.close()
        if self.client.process is not None:
            self.client.process.stop()


def process_experts(model_dir: str | Path, max_tokens: int, max_topk: int, *, control: str | None = None,
                    pack_dir: str | Path | None = None, fmt: str | None = None, threads: int | None = None,
                    timeout_s: float = 30.0) -> ProcessExperts:
    """Experts served by the expert process at `control`, or by one started now (packing the experts
    first if no up-to-date pack exists) that lives as long as this engine."""
    from hybrid.config import ModelConfig
    from hybrid.expert_pack import default_pack_dir, write_pack
    from hybrid.models.experts import default_expert_format

    if control is not None:
        return ProcessExperts(ExpertClient(control, max_tokens, max_topk, timeout_s=timeout_s))
    fmt = fmt or default_expert_format(ModelConfig.from_dir(model_dir))
    pack_dir = pack_dir or default_pack_dir(model_dir, fmt)

    def spawn() -> ExpertClient:
        write_pack(model_dir, pack_dir, fmt)
        process = ExpertServerProcess.spawn(model_dir, pack_dir, threads)
        return ExpertClient(process.control, max_tokens, max_topk, timeout_s=timeout_s, process=process)

    return ProcessExperts(spawn(), spawn)
