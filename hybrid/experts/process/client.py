"""The engine's side of the expert process: spawning it, registering, and per-layer calls through slots.

`ExpertClient.submit(layer, hidden, topk_ids, topk_weights)` copies one call into a free shared-memory
slot and rings its doorbell; `handle.wait()` returns the output. Both are C++ kernels on the slot's `SlotCall`,
so a recorded decode step (cpu_kernels/program.py) replays them too. Every wait is bounded, in C++: a dead,
stopped or stalled expert process gives an `ExpertServerError` instead of a hang.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import torch
import zmq

from cpu_kernels import _C
from cpu_kernels.elementwise import widen
from cpu_kernels.moe import recordable
from cpu_kernels.thread_pool import unpin_child
from hybrid.experts.process.liveness import is_stopped
from hybrid.experts.process.server import RUN_DIR_PREFIX
from hybrid.experts.process.slots import CLIENT_SPIN_US, DTYPE_CODES, ExpertSlots, SlotLayout

POLL_S = 0.05  # how often a waiting call checks that the expert process can still answer
STOP_S = 2.0  # how long a terminated expert process may take to exit before it is killed
UNREGISTER_S = 1.0

# The expert process died, stalled past its timeout, or refused a call. The C++ slot calls raise it, from an eager
# call or from a replayed program alike; the engine restarts a process it owns on it.
ExpertServerError = _C.ExpertCallError


def _as_cpu(t: torch.Tensor, dtypes: tuple[torch.dtype, ...], dtype: torch.dtype) -> torch.Tensor:
    """t itself when it is a contiguous CPU tensor of one of `dtypes`, else a converted copy."""
    if t.device.type == "cpu" and t.dtype in dtypes and t.is_contiguous():
        return t
    return t.to("cpu", dtype).contiguous()


class ExpertServerProcess:
    """An expert process this engine started and owns."""

    def __init__(self, proc: subprocess.Popen, control: str):
        self.proc, self.control = proc, control

    @classmethod
    def spawn(cls, model_dir: str | Path, pack_dir: str | Path, threads: int | None = None,
              timeout_s: float = 300.0) -> "ExpertServerProcess":
        cmd = [sys.executable, "-m", "hybrid.experts.process.server", "--model", str(model_dir),
               "--pack", str(pack_dir), "--parent-pid", str(os.getpid())]
        if threads:
            cmd += ["--threads", str(threads)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, preexec_fn=unpin_child)
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            if not ready:
                proc.kill()
                raise ExpertServerError(f"the expert process did not start within {timeout_s:.0f}s")
            try:  # its stdout closed: it is exiting
                code = proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            raise ExpertServerError(f"the expert process exited with code {code} before it was ready "
                                    "(its own error is on stderr, in the engine log under the daemon)")
        server = cls(proc, json.loads(line)["control"])
        atexit.register(server.stop)
        return server

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = STOP_S) -> None:
        """Terminates the process, killing it if it does not exit within timeout_s (at once if it is stopped,
        as a stopped process never handles SIGTERM), so a restart never waits longer than that."""
        if self.alive():
            if is_stopped(self.proc.pid):
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        """The run directory of a process that was killed: one that exits cleanly removes its own."""
        run_dir = Path(self.control.removeprefix("ipc://")).parent
        if self.control.startswith("ipc://") and run_dir.name.startswith(RUN_DIR_PREFIX):
            shutil.rmtree(run_dir, ignore_errors=True)


class ExpertHandle:
    """One call in flight; `wait` returns its [T, H] output (a copy, in the input dtype)."""

    def __init__(self, client: "ExpertClient", slot: int, shape: tuple[int, int], dtype: torch.dtype):
        self.client, self.slot, self.shape, self.dtype = client, slot, shape, dtype

    def wait(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The output, written into `out` ([T, H] contiguous, the call's dtype) when given."""
        return self.client._wait(self, out)


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
        offsets = self.slots.offsets()
        self._calls = [_C.SlotCall(self.slots.slot_ptr(s), offsets, self.server_pid, int(timeout_s * 1e6),
                                   CLIENT_SPIN_US, int(POLL_S * 1e6)) for s in range(num_slots)]
        # Each slot's handle while its call is in flight; a handle dropped unwaited (its step failed) frees the slot,
        # whose next submit lets the old call finish first (SlotCall).
        self._in_flight: dict[int, weakref.ref[ExpertHandle]] = {}

    def request(self, msg: dict, timeout_s: float | None = None) -> dict:
        """One control round trip, bounded by timeout_s (default: the client's timeout)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.control)
        self._sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        try:
            self._sock.send(json.dumps(msg).encode())
            reply = json.loads(self._sock.recv())
        except zmq.Again:
            self._sock.close()
            self._sock = None  # a REQ socket that missed its reply cannot be reused
            raise ExpertServerError(f"the expert process at {self.control} did not answer {msg['op']!r} "
                                    f"within {timeout_s:.1f}s") from None
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
        if hidden.shape != (tokens, self.slots.layout.hidden):
            raise ValueError(f"hidden states {tuple(hidden.shape)} do not match {tokens} tokens x "
                             f"{self.slots.layout.hidden}")
        # Each eager torch conversion costs microseconds, as much as the whole C++ round trip: only convert
        # what is not already a contiguous CPU tensor the slot takes as it is (int64 ids are narrowed in C++).
        dtype = hidden.dtype if hidden.dtype in DTYPE_CODES else torch.float32
        x = _as_cpu(hidden, (dtype,), dtype)
        ids = _as_cpu(topk_ids, (torch.int64, torch.int32), torch.int64)
        if topk_weights.device.type == "cpu" and topk_weights.dtype == torch.bfloat16:
            weights = widen(topk_weights)  # a kernel, where a torch cast would keep the step from being recorded
        else:
            weights = _as_cpu(topk_weights, (torch.float32,), torch.float32)
        slot = self._free_slot()
        recordable(self._calls[slot]).expert_submit(layer, tokens, topk, dtype == torch.float32, x.data_ptr(),
                                                    ids.data_ptr(), ids.dtype == torch.int64, weights.data_ptr())
        handle = ExpertHandle(self, slot, (tokens, self.slots.layout.hidden), dtype)
        self._in_flight[slot] = weakref.ref(handle)
        return handle

    def _free_slot(self) -> int:
        """The lowest free slot: with one call in flight it is always slot 0, whose server thread is still
        spinning from the last call instead of asleep."""
        for slot in range(self.slots.num_slots):
            held = self._in_flight.get(slot)
            if held is None or held() is None:
                return slot
        raise ExpertServerError(f"all {self.slots.num_slots} expert slots have a call in flight; wait for one")

    def _wait(self, handle: ExpertHandle, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(handle.shape, dtype=handle.dtype)
        elif out.shape != handle.shape or out.dtype != handle.dtype or not out.is_contiguous():
            raise ValueError(f"an expert result needs a contiguous {handle.shape} {handle.dtype} tensor")
        try:
            recordable(self._calls[handle.slot]).expert_wait(out.data_ptr(), out.numel() * out.element_size())
        finally:
            if (held := self._in_flight.get(handle.slot)) is not None and held() is handle:
                del self._in_flight[handle.slot]
        return out

    def close(self) -> None:
        if self.alive() and not is_stopped(self.server_pid):
            try:  # closing: a busy process is not waited for
                self.request({"op": "unregister", "client": self.client_id}, min(self.timeout_s, UNREGISTER_S))
            except ExpertServerError:
                pass
        for call in self._calls:  # a decode program recorded over them may outlive this client
            call.close()
        self._calls = []
        self.slots.close()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
