"""Runs one step across the ranks of a parallel run.

The driver (rank 0) sends the step (its micro-batches) to the other ranks of stage 0 over the tensor-parallel
group, and each rank of a stage forwards it to the same tensor-parallel rank of the next stage with the hidden
states. With several stages a step's sequences are cut into micro-batches: while stage 1 runs the first one, stage
0 runs the second, and so on, so the stages work at the same time instead of taking turns. The last stage sends
the final (normed) hidden states back to the driver, which computes logits and samples. CPU-only, each rank
replays its part of a decode micro-batch from its own recorded program (hybrid/graphs/cpu_decode_programs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from hybrid.distributed.communicator import CommunicationError
from hybrid.distributed.parallel_state import ParallelState
from hybrid.engine.step_message import Step, decode, encode
from hybrid.layers.attention.backend import AttentionBackend
from hybrid.layers.forward_batch import HostBatch
from hybrid.models.causal_lm import CausalLMBody

if TYPE_CHECKING:
    from hybrid.graphs.cpu_decode_programs import CpuDecodePrograms


def _send_bytes(payload: bytes, dst: int, group: dist.ProcessGroup) -> None:
    dist.send(torch.tensor([len(payload)], dtype=torch.int64), dst, group=group)
    dist.send(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst, group=group)


def _recv_bytes(src: int, group: dist.ProcessGroup) -> bytes:
    length = torch.empty(1, dtype=torch.int64)
    dist.recv(length, src, group=group)
    data = torch.empty(int(length), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return data.numpy().tobytes()


class StageExecutor:
    def __init__(self, state: ParallelState, body: CausalLMBody, caches: list, attention: AttentionBackend,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, programs: CpuDecodePrograms | None):
        self.state, self.info, self.group = state, state.info, state.world_group
        self.body, self.caches, self.attention = body, caches, attention
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.programs = programs
        self.broken = False  # the ranks are out of step: the run cannot go on

    def run(self, micro_batches: list[HostBatch]) -> torch.Tensor:
        """Driver: the step's final hidden states, every row of every micro-batch in order. Once the other ranks
        may have the step, a failure here leaves them part-way through it, waiting on collectives this rank will
        not make: it is raised as CommunicationError and the run is `broken`. (A ValueError while passing the step
        on refused it before any rank saw it.)"""
        step = Step(micro_batches)
        payload = encode(step)
        try:
            self._pass_on(payload)
        except ValueError:
            raise
        except Exception as e:
            self._break(e)
        try:
            return self._run(step)
        except Exception as e:
            self._break(e)

    def _break(self, e: Exception) -> NoReturn:
        self.broken = True
        if isinstance(e, CommunicationError):
            raise e
        raise CommunicationError(f"a step failed on the driving rank after the other ranks started it, which "
                                 f"leaves them out of step: {type(e).__name__}: {e}") from e

    def follow(self) -> None:
        """Other ranks: runs the driver's steps until it says stop."""
        while True:
            payload = self._receive()
            self._pass_on(payload)
            step = decode(payload)
            if step.stop:
                return
            self._run(step)

    def stop(self) -> None:
        """Driver: tells every other rank to leave follow()."""
        self._pass_on(encode(Step([], stop=True)))

    def _receive(self) -> bytes:
        if self.info.first_stage:
            return self.state.tp_comm.broadcast(None, root=0)
        return _recv_bytes(self.info.peer(self.info.stage - 1), self.group)

    def _pass_on(self, payload: bytes) -> None:
        if self.info.driver and self.info.tp > 1:
            self.state.tp_comm.broadcast(payload, root=0)
        if not self.info.last_stage:
            _send_bytes(payload, self.info.peer(self.info.stage + 1), self.group)

    def _hidden(self, rows: int) -> torch.Tensor:
        return torch.empty(rows, self.hidden_size, dtype=self.dtype)

    def _run(self, step: Step) -> torch.Tensor | None:
        info = self.info
        pending, outs = [], []
        if info.driver and info.pp > 1:
            last = (info.pp - 1) * info.tp
            for mb in step.micro_batches:
                out = self._hidden(len(mb.ids))
                pending.append(dist.irecv(out.view(torch.uint8), last, group=self.group))
                outs.append(out)
        for mb in step.micro_batches:
            x = None
            if not info.first_stage:
                x = self._hidden(len(mb.ids))
                dist.recv(x.view(torch.uint8), info.peer(info.stage - 1), group=self.group)
            x = self._layers(mb, x)
            if not info.last_stage:
                pending.append(dist.isend(x.view(torch.uint8), info.peer(info.stage + 1), group=self.group))
            elif info.pp > 1 and info.tp_rank == 0:
                pending.append(dist.isend(x.view(torch.uint8), 0, group=self.group))
            elif info.driver:
                outs.append(x)
        for work in pending:
            work.wait()
        return torch.cat(outs) if info.driver else None

    def _layers(self, mb: HostBatch, x: torch.Tensor | None) -> torch.Tensor:
        """This rank's layers over the micro-batch (from its ids on the first stage, else from x): replayed from a
        decode program where one fits, else eagerly. Ranks decide alike, but need not: eager calls and replays
        number their all-reduces the same way."""
        if self.programs is not None and self.programs.fits(mb):
            out = self.programs.run(mb, x)
            if out is not None:
                return out.clone()  # the programs' arena: the next micro-batch (any size) would overwrite it
        ids, batch = mb.to_device(self.device, self.caches, self.attention)
        return self.body.forward_layers(self.body.embed(ids) if x is None else x, batch).contiguous()
