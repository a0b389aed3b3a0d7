"""CPU-only decode steps replayed from kernel programs (cpu_kernels/program.py): the CPU's decode graphs.

With the cpu backend and recordable experts (in-process kernels, or the expert process's slot calls: a submit
and a wait, with the shared experts recorded in between), a decode step's layers are nothing but C++ kernel calls
with Python between them, and that Python (plus the small torch ops it used to run) cost ~0.1 ms per layer with
the caches warm and ~0.4 ms right after the experts' weights streamed through them (Qwen3-30B-A3B shapes, 2-core
EPYC): at 16 cores as long as such a layer's whole read. A program records the calls of `forward_layers` once per
batch size, over static inputs (ids, positions, slots, block tables, context lengths) that each step rewrites in
place, and replays them from C++. A program also gathers its step's embedded rows and rotary rows (from a table of
every position below max_model_len, made once: 21 MB in bf16 for Qwen3-30B-A3B's 40,960 positions of 128 dims),
which the step's Python computed with torch ops before (~0.15 ms of a 2-core step with cold caches). In a
single-process engine the program ends with the lm_head, so a replay gives the step's logits (whose rows, 300 KB
each in bf16 for a 152K vocabulary, then set the arena's peak).

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
from cpu_kernels.elementwise import gather_rows
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
    """A decode step of `size` sequences over the first rows of the static inputs, and its program. The program
    gathers the step's rotary rows from their tables by position and, on a rank that embeds (`embeds`), the ids'
    embedded rows: only ids, positions, slots, tables and context lengths are written between replays."""

    def __init__(self, size: int, inputs: StaticInputs, dtype: torch.dtype, kv_caches: list,
                 attention: AttentionBackend, ropes: list[RotaryEmbedding], max_positions: int, embeds: bool):
        self.io, self.tables, self.ctx, self.x = inputs.io[:, :size], inputs.tables[:size], inputs.ctx[:size], \
            inputs.x[:size]
        self.embeds = embeds
        self.batch = ForwardBatch.static_decode(self.io[1], self.io[2], self.tables, self.ctx, kv_caches, attention,
                                                None)
        self.batch.query_lens_tensor = inputs.query_lens[:size]
        self.rotary: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []  # (tables, step's rows)
        self.batch.memo = {}
        for rope in ropes:
            tables = rope.table(dtype, max_positions)
            rows = tuple(torch.empty_like(t[:size]) for t in tables)
            self.rotary.append((tables, rows))
            self.batch.memo[rope.step_key(dtype)] = rows
        self.program: Program | None = None

    def forward(self, body: nn.Module, head: nn.Module | None) -> torch.Tensor:
        """What the program records: the step's rotary rows and embedded rows gathered, then the layers, and the
        head over their output when given."""
        for tables, rows in self.rotary:
            for table, out in zip(tables, rows):
                gather_rows(table, self.io[1], out)
        if self.embeds:
            gather_rows(body.embed_tokens.weight, self.io[0], self.x)
        hidden = body.forward_layers(self.x, self.batch)
        return hidden if head is None else head(hidden)

    def load(self, host: HostBatch, x: torch.Tensor | None) -> None:
        """The step's inputs, and the hidden states x a previous pipeline stage sent (on a rank that does not
        embed)."""
        host.write_static(self.io, self.tables, self.ctx, pad_block=0)
        if x is not None:
            self.x.copy_(x)


class CpuDecodePrograms:
    """Decode steps of up to MAX_PROGRAM_BATCH sequences through recorded programs (`fits` / `run`, as
    DecodeGraphs offers them), recorded at first use of each batch size."""

    def __init__(self, body: nn.Module, kv_caches: list, attention: AttentionBackend, experts: Experts,
                 block_size: int, max_model_len: int, max_batch: int, hidden: int, dtype: torch.dtype,
                 head: nn.Module | None = None):
        self.body, self.kv_caches, self.attention, self.dtype = body, kv_caches, attention, dtype
        self.head = head  # recorded after the layers: the programs then give logits
        self.experts, self.epoch = experts, experts.epoch
        self.max_blocks = -(-max_model_len // block_size)
        self.max_positions = max_model_len
        self.max_batch = min(max_batch, MAX_PROGRAM_BATCH)
        self.ropes = list({id(m): m for m in body.modules() if isinstance(m, RotaryEmbedding)}.values())
        self.inputs = StaticInputs(self.max_batch, self.max_blocks, hidden, dtype)
        self.steps: dict[int, StaticStep] = {}
        self.arena = Arena()  # every size's intermediates: one program runs at a time
        self.refused: str | None = None  # why this model's steps cannot be recorded

    @property
    def gives_logits(self) -> bool:
        return self.head is not None

    @property
    def num_captured(self) -> int:
        return sum(step.program is not None for step in self.steps.values())

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    def fits(self, host: HostBatch) -> bool:
        return (self.refused is None and host.is_decode and len(host.ids) <= self.max_batch
                and max(len(t) for t in host.block_tables) <= self.max_blocks
                and max(host.positions) < self.max_positions)  # rows of the rotary tables

    def run(self, host: HostBatch, x: torch.Tensor | None = None) -> torch.Tensor | None:
        """This rank's output [n, H] of the decode step (the final hidden states on the last pipeline stage) from
        the embedded ids, or from x on a later stage, or with a head its logits [n, vocab]; None where its program
        could not be recorded (the caller runs the step eagerly; `refused` says why, and no later step is tried).
        The output is the program's own buffer, rewritten by its next replay."""
        if self.experts.epoch != self.epoch:  # a restarted expert process: new slots
            self.steps.clear()
            self.epoch = self.experts.epoch
        n = len(host.ids)
        step = self.steps.get(n)
        if step is None or step.program.generation != self.arena.generation or step.embeds != (x is None):
            step = self._record(n, embeds=x is None)
            if step is None:
                return None
        step.load(host, x)
        return step.program.run()

    def _record(self, n: int, embeds: bool) -> StaticStep | None:
        """A new step of n sequences with its program, or None (refused). The step is new each time: what a
        recording memoizes in it lies in the arena block it was recorded into."""
        step = StaticStep(n, self.inputs, self.dtype, self.kv_caches, self.attention, self.ropes, self.max_positions,
                          embeds)
        generation = self.arena.generation
        try:
            # An arena that must grow grows for the largest batch at once (intermediates scale with the rows): the
            # sizes recorded meanwhile are then not recorded again at every new largest batch.
            step.program = record(lambda: step.forward(self.body, self.head), self.arena, headroom=self.max_batch / n)
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
