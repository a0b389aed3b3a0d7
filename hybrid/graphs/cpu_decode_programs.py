"""CPU-only decode steps replayed from kernel programs (cpu_kernels/program.py): the CPU's decode graphs.

With the cpu backend and recordable experts (in-process kernels, or the expert process's slot calls: a submit
and a wait, with the shared experts recorded in between), a decode step's layers are nothing but C++ kernel calls
with Python between them, and that Python (plus the small torch ops it used to run) cost ~0.1 ms per layer with
the caches warm and ~0.4 ms right after the experts' weights streamed through them (Qwen3-30B-A3B shapes, 2-core
EPYC): at 16 cores as long as such a layer's whole read. A program records the calls of `forward_layers` once per
batch size, over static inputs (ids, positions, slots, block tables, context lengths, the rotary tables and the
embedded rows) that each step rewrites in place, and replays them from C++.

Programs are recorded per exact batch size up to `MAX_PROGRAM_BATCH` (no padding rows: a padding row would stream
the weights of the experts it routes to), at each size's first use (a few ms per layer); larger batches run
eagerly, as does any model whose step does more than call kernels: recording raises RecordError at the first
torch op that computes (an fp32 run of an fp8 DeepSeek checkpoint keeps MLA's absorption in torch, for one), and
the engine logs why and runs eagerly from then on. A restarted expert process has new slots: programs recorded
over the old ones are dropped (the experts' `epoch`) and recorded again.

Since one program runs at a time, every size shares its memory: the static inputs are the first rows of one set
sized for the largest batch, and the intermediates live in one arena (cpu_kernels/arena.py) in which a recording
reuses the ranges of tensors it has dropped, so its peak is about one layer's live tensors: 40 KB per row for
Qwen3-30B-A3B shapes in bf16 and 0.4 MB per row for DeepSeek-V3's (MLA), whatever the number of layers (a
program keeping every intermediate held 61 KB per row and layer for Qwen3: 3 MB per row for its 48 layers).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from cpu_kernels.arena import Arena
from cpu_kernels.program import Program, RecordError, record
from hybrid.experts.base import Experts
from hybrid.layers.attention.backend import AttentionBackend
from hybrid.layers.forward_batch import ForwardBatch, HostBatch
from hybrid.layers.rotary_embedding import RotaryEmbedding

log = logging.getLogger(__name__)

MAX_PROGRAM_BATCH = 64


class StaticInputs:
    """What a replayed step reads besides the weights and caches, for the largest batch: a step of n sequences
    records the first n rows. One program runs at a time and each step rewrites its rows before replaying, so every
    batch size shares them."""

    def __init__(self, max_batch: int, max_blocks: int, hidden: int, dtype: torch.dtype):
        self.io = torch.zeros(3, max_batch, dtype=torch.long)  # ids, positions, slots
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32)
        self.ctx = torch.ones(max_batch, dtype=torch.int32)
        self.query_lens = torch.ones(max_batch, dtype=torch.int32)
        self.x = torch.zeros(max_batch, hidden, dtype=dtype)


class StaticStep:
    """A decode step of `size` sequences over the first rows of the static inputs, and its program."""

    def __init__(self, size: int, inputs: StaticInputs, dtype: torch.dtype, kv_caches: list,
                 attention: AttentionBackend, ropes: list[RotaryEmbedding]):
        self.io, self.tables, self.ctx, self.x = inputs.io[:, :size], inputs.tables[:size], inputs.ctx[:size], \
            inputs.x[:size]
        self.ropes, self.dtype = ropes, dtype
        self.batch = ForwardBatch.static_decode(self.io[1], self.io[2], self.tables, self.ctx, kv_caches, attention,
                                                None)
        self.batch.query_lens_tensor = inputs.query_lens[:size]
        # The rotary tables live in static tensors that `load` rewrites, not made again at each replay.
        self.batch.memo = {rope.step_key(dtype): rope.cos_sin(self.io[1], dtype) for rope in ropes}
        self.program: Program | None = None

    def load(self, host: HostBatch, embed: torch.Tensor | None, x: torch.Tensor | None) -> None:
        """The step's inputs: the hidden states x a previous pipeline stage sent, or else the ids' embedded rows."""
        host.write_static(self.io, self.tables, self.ctx, pad_block=0)
        for rope in self.ropes:
            for static, fresh in zip(self.batch.memo[rope.step_key(self.dtype)], rope.cos_sin(self.io[1], self.dtype)):
                static.copy_(fresh)
        if x is None:
            torch.index_select(embed, 0, self.io[0], out=self.x)
        else:
            self.x.copy_(x)


class CpuDecodePrograms:
    """Decode steps of up to MAX_PROGRAM_BATCH sequences through recorded programs (`fits` / `run`, as
    DecodeGraphs offers them), recorded at first use of each batch size."""

    def __init__(self, body: nn.Module, kv_caches: list, attention: AttentionBackend, experts: Experts,
                 block_size: int, max_model_len: int, max_batch: int, hidden: int, dtype: torch.dtype):
        self.body, self.kv_caches, self.attention, self.dtype = body, kv_caches, attention, dtype
        self.experts, self.epoch = experts, experts.epoch
        self.max_blocks = -(-max_model_len // block_size)
        self.max_batch = min(max_batch, MAX_PROGRAM_BATCH)
        self.ropes = list({id(m): m for m in body.modules() if isinstance(m, RotaryEmbedding)}.values())
        self.inputs = StaticInputs(self.max_batch, self.max_blocks, hidden, dtype)
        self.steps: dict[int, StaticStep] = {}
        self.arena = Arena()  # every size's intermediates: one program runs at a time
        self.refused: str | None = None  # why this model's steps cannot be recorded

    @property
    def num_captured(self) -> int:
        return sum(step.program is not None for step in self.steps.values())

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def fits(self, host: HostBatch) -> bool:
        return (self.refused is None and host.is_decode and len(host.ids) <= self.max_batch
                and max(len(t) for t in host.block_tables) <= self.max_blocks)

    def run(self, host: HostBatch, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """This rank's output [n, H] of the decode step (the final hidden states on the last pipeline stage) from
        the embedded ids, or from x on a later stage; None where its program could not be recorded (the caller runs
        the step eagerly; `refused` says why, and no later step is tried). The output is the program's own
        buffer, rewritten by its next replay."""
        if self.experts.epoch != self.epoch:  # a restarted expert process: new slots
            self.steps.clear()
            self.epoch = self.experts.epoch
        n = len(host.ids)
        step = self.steps.get(n)
        if step is None or step.program.generation != self.arena.generation:
            step = self._record(n)
            if step is None:
                return None
        step.load(host, None if x is not None else self.body.embed_tokens.weight, x)
        return step.program.run()

    def _record(self, n: int) -> StaticStep | None:
        """A new step of n sequences with its program, or None (refused). The step is new each time: what a
        recording memoizes in it lies in the arena block it was recorded into."""
        step = StaticStep(n, self.inputs, self.dtype, self.kv_caches, self.attention, self.ropes)
        generation = self.arena.generation
        try:
            # An arena that must grow grows for the largest batch at once (intermediates scale with the rows): the
            # sizes recorded meanwhile are then not recorded again at every new largest batch.
            step.program = record(lambda: self.body.forward_layers(step.x, step.batch), self.arena,
                                  headroom=self.max_batch / n)
        except RecordError as e:
            self.refused = str(e)
            log.warning("decode steps run eagerly: %s", e)
            return None
        if self.arena.generation != generation:  # the arena grew: the other sizes' programs are stale
            self.steps.clear()
        self.steps[n] = step
        log.info("recorded the decode step of %d sequences: %d kernel calls, %.1f KB of intermediates at their peak "
                 "(arena %.1f KB)", n, len(step.program), step.program.nbytes / 1024, self.arena.nbytes / 1024)
        return step
