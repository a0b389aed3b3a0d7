"""The expert process: maps a packed expert file, owns the kernel thread pool, serves per-layer MoE calls.

Control (register a client, health, stats, shutdown) is JSON over a ZeroMQ REP socket. The data path
of each call is a shared-memory slot (hidden states, top-k ids and weights in, output out) signalled
through its sequence words; each slot has its own server thread running the C++ serve loop (no GIL),
so a client can keep two calls in flight. The kernels serialize on their own pool.

    python -m hybrid.experts.process.server --model DIR --pack DIR --control ipc:///tmp/x/control
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq

from hybrid.experts.kernel_experts import KernelExperts
from hybrid.experts.pack import load_pack_of
from hybrid.experts.process.slots import SPIN_US, ExpertSlots, SlotLayout
from hybrid.parent_watch import watch_parent
from hybrid.process_exit import exit_after
from hybrid.shm_orphans import create_owned, owned_name, remove_orphans

RUN_DIR_PREFIX = "hybridd-experts-"  # the temporary directory holding an expert process's ipc socket
SLOTS_PREFIX = f"hybridd-slots-{os.getuid()}-"  # a client's shared-memory slots: this prefix, the pid, the client


@dataclass
class ClientState:
    slots: ExpertSlots
    servers: list = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)


class ExpertServer:
    def __init__(self, experts: KernelExperts, hidden: int):
        from cpu_kernels.moe import kernel_isa, runner

        self.experts, self.hidden = experts, hidden
        self.runner, self.isa = runner(experts.num_threads), kernel_isa()
        self.layers = {layer: packed.layer for layer, packed in experts.layers.items()}
        self.clients: dict[int, ClientState] = {}
        self.lock = threading.Lock()
        self._ids = itertools.count()
        remove_orphans(SLOTS_PREFIX)

    def register(self, max_tokens: int, max_topk: int, num_slots: int) -> dict:
        from cpu_kernels import _C

        cid = next(self._ids)
        layout = SlotLayout(self.hidden, max_tokens, max_topk)
        slots = ExpertSlots.create(owned_name(SLOTS_PREFIX, cid), layout, num_slots)
        state = ClientState(slots)
        for s in range(num_slots):
            server = _C.SlotServer(slots.slot_ptr(s), slots.offsets(), self.runner, self.layers, self.isa, SPIN_US)
            t = threading.Thread(target=server.serve, daemon=True)
            t.start()
            state.servers.append(server)
            state.threads.append(t)
        with self.lock:
            self.clients[cid] = state
        return {"client": cid, "shm": slots.shm.name, "hidden": self.hidden, "num_slots": num_slots}

    def unregister(self, cid: int) -> None:
        with self.lock:
            state = self.clients.pop(cid, None)
        if state is None:
            return
        for server in state.servers:
            server.stop()
        for t in state.threads:
            t.join(timeout=5)
        state.slots.close()
        state.slots.shm.unlink()

    def stats(self) -> dict:
        with self.lock:
            return {str(cid): {"calls": sum(v.calls for v in c.servers),
                               "busy_s": round(sum(v.busy_s for v in c.servers), 6)} for cid, c in self.clients.items()}

    def close(self) -> None:
        for cid in list(self.clients):
            self.unregister(cid)


def serve(server: ExpertServer, control: str, info: dict) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REP)
    sock.bind(control)
    try:
        while True:
            try:
                msg = json.loads(sock.recv())
                op = msg.get("op")
                if op == "register":
                    reply = server.register(int(msg["max_tokens"]), int(msg["max_topk"]), int(msg.get("slots", 2)))
                elif op == "unregister":
                    server.unregister(int(msg["client"]))
                    reply = {"ok": True}
                elif op == "health":
                    reply = {"ok": True, "pid": os.getpid(), "clients": len(server.clients), **info}
                elif op == "stats":
                    reply = {"ok": True, "clients": server.stats()}
                elif op == "shutdown":
                    sock.send(json.dumps({"ok": True}).encode())
                    return
                else:
                    reply = {"error": f"unknown op {op!r}"}
            except Exception as e:  # a malformed request gets an error reply, never a dead server
                reply = {"error": f"{type(e).__name__}: {e}"}
            sock.send(json.dumps(reply).encode())
    finally:
        sock.close(linger=0)
        server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybridd expert process")
    ap.add_argument("--model", required=True, help="the checkpoint directory the pack was made from")
    ap.add_argument("--pack", required=True, help="hybridd pack directory")
    ap.add_argument("--control", help="ZeroMQ endpoint (default: ipc in a fresh run directory)")
    ap.add_argument("--threads", type=int, help="kernel threads")
    ap.add_argument("--parent-pid", type=int, help="exit when this process is gone (the engine that started us)")
    a = ap.parse_args(argv)
    from cpu_kernels.moe import set_pool_spin
    from cpu_kernels.thread_pool import SHARED_CORE_SPIN_US

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if a.parent_pid:  # from the start: an engine that dies while this loads leaves nothing loading
        watch_parent(a.parent_pid)
    torch.set_num_threads(1)
    set_pool_spin(SHARED_CORE_SPIN_US)  # the engines it serves compute on these cores between its calls
    model_dir = Path(a.model)
    layers = load_pack_of(a.pack, model_dir)
    if not layers:
        raise SystemExit(f"{a.pack}: the pack holds no MoE layer")
    experts = KernelExperts(layers, a.threads)
    # Named after this process, so that the directory of one that was killed is swept by the next
    run_dir = create_owned(f"{RUN_DIR_PREFIX}{os.getuid()}-", Path(tempfile.gettempdir()), is_dir=True)
    control = a.control or f"ipc://{run_dir}/control"
    server = ExpertServer(experts, next(iter(layers.values())).hidden)
    print(json.dumps({"ready": True, "control": control, "pid": os.getpid()}), flush=True)
    try:
        serve(server, control, {"model": str(model_dir), "layers": sorted(experts.layers)})
    finally:
        server.close()
        for p in run_dir.iterdir():
            p.unlink(missing_ok=True)
        run_dir.rmdir()
    return 0


if __name__ == "__main__":
    exit_after(main)
