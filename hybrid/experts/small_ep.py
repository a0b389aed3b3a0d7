"""SmallEP: several GPUs split every MoE layer's routed experts in streamed prefill passes. This file holds the
share each rank owns, the protocol the ranks speak and rank 0's side of it; hybrid/experts/expert_rank.py is the
other ranks' side.

Rank 0 is the engine: embeddings, attention, the KV cache, dense layers, shared experts, router and lm_head stay on
its GPU as with one GPU, and it streams and computes its share of every layer's experts. Each further GPU gets an
expert rank, a process that holds nothing but the two streaming buffers of its share, fed from the same mapped pack.
A share is a contiguous run of expert ids (one slice of the mapping: one copy per field).

Per streamed pass, a header over gloo (PASS, LAYER, END, STOP; PROBE for the start-up measurement) tells the expert
ranks what comes next, so a pass that rank 0 abandons halfway (an exception in attention) leaves them waiting for
the next header, never for data. Per MoE layer the data group broadcasts one buffer holding the routing weights,
top-k ids and hidden states; every rank streams and computes its share; the partial outputs are summed onto rank 0
(a reduce: no other rank uses the sum). Data goes over NCCL between GPUs, over gloo where the CPU plays them. At END
each expert rank reports the bytes it streamed in the pass.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hybrid.config import EngineConfig
from hybrid.distributed.communicator import CommunicationError
from hybrid.distributed.local_store import NCCL_LOOPBACK, LocalStore, on_loopback

log = logging.getLogger(__name__)

PASS, LAYER, END, STOP, PROBE = 1, 2, 3, 4, 5
HEADER = 4  # int64 fields: op, then op-specific (PASS: tokens, longest prefill; LAYER / PROBE: layer, tokens)
JOIN_TIMEOUT = timedelta(seconds=120)  # ranks reach the store and, once built, connect within this
BUILD_TIMEOUT_S = 1800  # an expert rank maps (on CUDA: registers) its share of the pack within this
PEER_TIMEOUT = timedelta(seconds=300)  # rank 0 waits this long for an expert rank's part of a layer
# Rank 0's headers and counts: an expert rank posts its receive for them within milliseconds of its last step, so
# one still open after this is a rank that is gone or hung. Kept short because a gloo operation left open when rank
# 0 gives a rank up is waited for (holding the GIL) when its group is destroyed: in 2 of 4 full test runs the
# header open when a killed rank was noticed froze the engine for the rest of a 300 s timeout.
CONTROL_TIMEOUT = timedelta(seconds=30)
IDLE_TIMEOUT = timedelta(days=365)  # an expert rank waits for the next pass however long the daemon stays idle


def expert_share(num_experts: int, ranks: int, rank: int) -> list[int]:
    """The expert ids `rank` of `ranks` streams and computes: an even contiguous split, the first taking the
    remainder."""
    per, extra = divmod(num_experts, ranks)
    start = rank * per + min(rank, extra)
    return list(range(start, start + per + (rank < extra)))


def rank_devices(first: str, gpus: list[int]) -> list[torch.device]:
    """The device of each SmallEP rank: `first` (rank 0's, the engine's), then one per further --gpus entry; the
    CPU for every rank where it plays the GPUs."""
    if first == "cpu":
        return [torch.device("cpu")] * len(gpus)
    return [torch.device(first)] + [torch.device(f"cuda:{g}") for g in gpus[1:]]


def _kill(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        p.kill()
        p.wait()


def ready_key(rank: int) -> str:
    """The store key an expert rank sets once its share is mapped and its buffers exist."""
    return f"ready/{rank}"


def payload_bytes(tokens: int, hidden: int, top_k: int, dtype: torch.dtype) -> int:
    return tokens * top_k * 8 + tokens * hidden * dtype.itemsize


def pack_layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """One byte buffer: float32 weights, int32 ids, then the hidden states (4-byte fields first keep every view
    aligned)."""
    parts = (weights.to(torch.float32), ids.to(torch.int32), x)
    return torch.cat([p.contiguous().view(-1).view(torch.uint8) for p in parts])


def unpack_layer(buf: torch.Tensor, tokens: int, hidden: int, top_k: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, ids, weights) as views of a buffer made by pack_layer."""
    n = tokens * top_k * 4
    weights = buf[:n].view(torch.float32).view(tokens, top_k)
    ids = buf[n:2 * n].view(torch.int32).view(tokens, top_k)
    return buf[2 * n:].view(dtype).view(tokens, hidden), ids, weights


class PeerGroups:
    """The two groups of a SmallEP run: control (gloo, CPU headers and counts) and data (NCCL between GPUs, gloo
    on the CPU). Built straight from backend classes, so an engine holds its own groups and touches no global
    torch.distributed state. Data operations return their Work: waiting on an NCCL one only orders the current
    stream after it, so whoever must know that it finished polls it (`finish`)."""

    def __init__(self, store: dist.Store, rank: int, world: int, device: torch.device, timeout: timedelta,
                 control_timeout: timedelta | None = None):
        self.rank, self.world, self.device = rank, world, device
        with on_loopback():
            self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world,
                                                 control_timeout or timeout)
        if device.type == "cuda":
            # a failed collective aborts the communicator and leaves this process alive (the default tears it
            # down): rank 0 then carries on without the expert ranks
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            os.environ.update(NCCL_LOOPBACK)  # its bootstrap sockets: the ranks share this machine
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout * 2  # rank 0's own deadline (finish) comes first
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data/", store), rank, world, options)
        else:
            with on_loopback():
                self.data = dist.ProcessGroupGloo(dist.PrefixStore("data/", store), rank, world, timeout)

    def header(self, t: torch.Tensor) -> dist.Work:
        """Rank 0's int64 [HEADER] header, on every rank once the work is done."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.control.broadcast([t], opts)

    def broadcast(self, t: torch.Tensor) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.data.broadcast([t], opts)

    def reduce(self, t: torch.Tensor) -> dist.Work:
        """Sums `t` over the ranks into rank 0's `t` (the others' are left undefined)."""
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.SUM
        return self.data.reduce([t], opts)

    def count(self, t: torch.Tensor) -> dist.Work:
        """Sums every rank's int64 [1] `t` into rank 0's."""
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.SUM
        return self.control.reduce([t], opts)

    def abort(self) -> None:
        """Abandons the data group's pending operations (NCCL), so nothing on a stream waits for them for ever."""
        abort = getattr(self.data, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            abort()


class ExpertPeers:
    """Rank 0's side: the expert ranks it started and the groups it reaches them through. Every call raises
    CommunicationError when a rank is gone or stalled, for the caller to carry on without them."""

    def __init__(self, groups: PeerGroups, processes: list[subprocess.Popen], hidden: int, top_k: int,
                 deadline_s: float = PEER_TIMEOUT.total_seconds()):
        self.groups, self.processes, self.hidden, self.top_k = groups, processes, hidden, top_k
        self.ranks, self.deadline_s = groups.world, deadline_s
        self._sent: tuple[torch.Tensor, dist.Work] | None = None  # the layer's buffer stays alive until summed

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as e:
            raise CommunicationError(f"SmallEP {what}: an expert rank is gone or stalled ({e})") from e

    def _finish(self, what: str, work: dist.Work) -> None:
        """Until `work` is done, failing as soon as an expert rank exits or the deadline passes."""
        deadline = time.monotonic() + self.deadline_s
        while not work.is_completed():
            dead = [p.returncode for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                self.groups.abort()
                why = f"an expert rank exited with code {dead[0]}" if dead else f"no answer in {self.deadline_s} s"
                raise CommunicationError(f"SmallEP {what}: {why}")
            time.sleep(0.0002)
        self._call(what, work.wait)

    def _header(self, op: int, a: int = 0, b: int = 0) -> None:
        # Polled like the layers' data: a blocking wait on gloo could sit out its whole timeout (300 s, seen one
        # run in three) when the expert rank had been killed.
        t = torch.tensor([op, a, b, 0], dtype=torch.int64)
        self._finish("header", self._call("header", self.groups.header, t))

    def begin(self, num_tokens: int, longest_prefill: int) -> None:
        """A streamed pass of `num_tokens` starts: the expert ranks begin streaming their share of its first
        layer now."""
        self._header(PASS, num_tokens, longest_prefill)

    def send_layer(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   op: int = LAYER) -> None:
        """Sends a layer's tokens; rank 0 computes its own share meanwhile (it only reads the buffer)."""
        buf = pack_layer(x, ids, weights)
        self._header(op, layer, x.shape[0])
        self._sent = (buf, self._call("broadcast", self.groups.broadcast, buf))

    def sum_into(self, out: torch.Tensor) -> None:
        """Adds the expert ranks' partial outputs of the layer last sent to `out` (rank 0's own part); every
        sent layer must be summed, even when rank 0 failed to compute its part (pass zeros)."""
        work = self._call("reduce", self.groups.reduce, out)
        self._finish("reduce", work)
        if self._sent is not None:
            self._finish("broadcast", self._sent[1])
            self._sent = None

    def end(self) -> int:
        """Closes the pass; returns the bytes the expert ranks streamed in it."""
        self._header(END)
        t = torch.zeros(1, dtype=torch.int64)
        self._finish("count", self._call("count", self.groups.count, t))
        return int(t)

    def probe(self, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
        """One exchange of a layer's data for `tokens` tokens with no expert work: what SmallEP adds per layer."""
        x = torch.zeros(tokens, self.hidden, dtype=dtype, device=device)
        ids = torch.zeros(tokens, self.top_k, dtype=torch.int32, device=device)
        self.send_layer(0, x, ids, ids.float(), op=PROBE)
        self.sum_into(x)

    def close(self) -> None:
        """Stops the expert ranks (killing any that do not stop)."""
        try:
            self._header(STOP)
        except CommunicationError:
            pass
        for p in self.processes:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill([p])

    def abandon(self) -> None:
        """Ends the expert ranks without talking to them (one failed: the others may be stuck in a collective)."""
        self.groups.abort()
        _kill(self.processes)


def _wait_ready(store: dist.Store, processes: list[subprocess.Popen]) -> None:
    """Until every expert rank has built its share (which can take minutes for a large pack on CUDA), failing at
    once if one exits."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    keys = [ready_key(rank) for rank in range(1, len(processes) + 1)]
    while not store.check(keys):
        for rank, p in enumerate(processes, start=1):
            if p.poll() is not None:
                raise CommunicationError(f"expert rank {rank} exited with code {p.returncode} while starting "
                                         "(its log is the engine's)")
        if time.monotonic() > deadline:
            raise CommunicationError(f"the expert ranks did not build their shares within {BUILD_TIMEOUT_S} s")
        time.sleep(0.05)


def start_expert_ranks(engine: EngineConfig, pack_dir: Path, hidden: int, top_k: int,
                       dtype: torch.dtype) -> ExpertPeers:
    """Starts an expert rank per GPU after the first (`python -m hybrid.experts.expert_rank`) over `pack_dir`, the
    pack this rank checked, and joins them."""
    from cpu_kernels.thread_pool import unpin_child
    from hybrid.distributed.launcher import engine_config_json

    devices = rank_devices(engine.device, engine.gpus)
    world = len(devices)
    local = LocalStore(world, JOIN_TIMEOUT)
    config = json.loads(engine_config_json(engine))
    processes = []
    try:
        try:
            for rank in range(1, world):
                arg = json.dumps({"engine": config, "pack": str(pack_dir), "hidden": hidden, "top_k": top_k,
                                  "dtype": str(dtype).removeprefix("torch."), "rank": rank, "world": world,
                                  "device": str(devices[rank]), "parent": os.getpid()})
                # unpin_child: a thread the kernel pool pinned would hand its one core down
                processes.append(subprocess.Popen([sys.executable, "-m", "hybrid.experts.expert_rank", arg],
                                                  env=dict(os.environ, **local.child_env()), preexec_fn=unpin_child))
            _wait_ready(local.store, processes)
            groups = PeerGroups(local.store, 0, world, devices[0], PEER_TIMEOUT, CONTROL_TIMEOUT)
        except (RuntimeError, CommunicationError) as e:
            _kill(processes)
            raise CommunicationError(f"SmallEP: the expert ranks did not join: {e}") from e
        except BaseException:  # a spawn that failed (no fork, say): the ranks started before it go too
            _kill(processes)
            raise
        peers = ExpertPeers(groups, processes, hidden, top_k)
        try:
            peers.probe(1, dtype, devices[0])  # NCCL connects lazily, through the store: now, not in the first pass
        except CommunicationError:
            peers.abandon()
            raise
    finally:
        local.close()
    log.info("SmallEP: %d ranks (%s), each streaming its share of every layer's experts",
             world, ", ".join(map(str, devices)))
    return peers

