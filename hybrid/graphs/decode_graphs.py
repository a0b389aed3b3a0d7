"""Hybrid decode steps replayed from captured graphs (CUDA graphs on a GPU, the guarded stand-in on the CPU).

A hybrid decode step leaves the device at every MoE layer, where the routed experts run in the expert
process, so a step is captured in pieces: the segments of hybrid/models/segments.py. For stage s the route
segment and the device part (shared experts) are captured graphs; the host replays the route graph, submits the
routed call, replays the device-part graph while the CPU computes, and combines into the next stage's static
input. The tail (layers after the last MoE layer, final norm) is one more graph.

Graphs are captured per (lane, batch-size bucket) at first use, with static input tensors the host rewrites
before each replay; a batch of n sequences runs in the smallest bucket >= n, its extra rows pointed at a
padding KV block no sequence owns. Lane 1 serves the second half of dual-batch overlap, whose two halves
are in flight at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpu.decode_attention import split_count
from hybrid.graphs.device_graph import DeviceGraph
from hybrid.layers.attention.backend import AttentionBackend
from hybrid.layers.forward_batch import ForwardBatch, HostBatch
from hybrid.models.overlap import interleave
from hybrid.models.segments import Routed


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, ... below max_batch, then max_batch."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return sizes + [max_batch]


class StaticDecode:
    """One lane's static inputs for batches of up to `size` sequences, and its captured segments."""

    def __init__(self, size: int, max_blocks: int, pad_block: int, block_size: int, hidden: int,
                 dtype: torch.dtype, device: torch.device, kv_caches: list, attention: AttentionBackend,
                 splits: int):
        self.pad_block, self.pad_slot = pad_block, pad_block * block_size
        self.io = torch.zeros(3, size, dtype=torch.long, device=device)  # ids, positions, slots
        self.io[2] = self.pad_slot
        self.tables = torch.full((size, max_blocks), pad_block, dtype=torch.int32, device=device)
        self.ctx = torch.ones(size, dtype=torch.int32, device=device)
        self.x = torch.zeros(size, hidden, dtype=dtype, device=device)
        self.batch = ForwardBatch.static_decode(self.io[1], self.io[2], self.tables, self.ctx, kv_caches, attention,
                                                splits)
        self.n = size  # rows loaded by the last step: rows past it are reset to the padding block
        self.route: list[DeviceGraph] = []
        self.device_part: list[DeviceGraph | None] = []
        self.tail: DeviceGraph | None = None
        self.routed: list[Routed] = []  # per stage: the route graph's latest outputs

    @property
    def ids(self) -> torch.Tensor:
        return self.io[0]

    def load(self, host: HostBatch) -> None:
        n = len(host.ids)
        host.write_static(self.io, self.tables, self.ctx, self.pad_block)
        if n < self.n:
            self.io[2, n:self.n] = self.pad_slot
            self.tables[n:self.n, 0] = self.pad_block
            self.ctx[n:self.n] = 1
        self.n = n


class DecodeGraphs:
    gives_logits = False  # run() gives the final hidden states; the runner's lm_head follows

    def __init__(self, body: nn.Module, kv_caches: list, attention: AttentionBackend, pad_block: int,
                 block_size: int, max_model_len: int, max_batch: int, dtype: torch.dtype, device: torch.device,
                 lanes: int = 1):
        if not attention.graph_safe:
            raise ValueError(f"decode graphs need an attention backend that reads per-sequence values from device "
                             f"tensors; {type(attention).__name__} reads host lists that a replay would not update")
        self.body, self.kv_caches, self.attention = body, kv_caches, attention
        self.pad_block, self.block_size, self.dtype, self.device = pad_block, block_size, dtype, device
        self.max_blocks = -(-max_model_len // block_size)
        # Triton's interpreter (the CPU stand-in) runs programs one after another: two splits still take the
        # split-and-combine path without multiplying test time by the GPU's eight.
        self.splits = split_count(max_model_len) if device.type == "cuda" else min(2, split_count(max_model_len))
        self.sizes = bucket_sizes(max_batch)
        self.stages, self.tail = body.stages, body.tail
        # One memory pool per lane. Within a lane, graphs replay in capture order and each one's outputs are
        # used up before an earlier-captured graph runs again, so they may share temporaries; the two lanes
        # interleave with outputs in flight, so a shared pool would let one lane's temporaries overwrite them.
        self.pools = [torch.cuda.graph_pool_handle() if device.type == "cuda" else None for _ in range(lanes)]
        self.lanes: list[dict[int, StaticDecode]] = [{} for _ in range(lanes)]

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def fits(self, host: HostBatch) -> bool:
        return (host.is_decode and len(host.ids) <= self.max_batch
                and max(len(t) for t in host.block_tables) <= self.max_blocks)

    @property
    def num_captured(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    def _static(self, lane: int, host: HostBatch) -> StaticDecode:
        size = next(s for s in self.sizes if s >= len(host.ids))
        static = self.lanes[lane].get(size)
        if static is None:
            static = self._capture(size, self.pools[lane])
            self.lanes[lane][size] = static
        static.load(host)
        return static

    def _capture(self, size: int, pool) -> StaticDecode:
        """Captures every segment of a step of `size` sequences, all rows on the padding block."""
        hidden = self.body.embed_tokens.weight.shape[1]
        static = StaticDecode(size, self.max_blocks, self.pad_block, self.block_size, hidden, self.dtype, self.device,
                              self.kv_caches, self.attention, self.splits)
        for s, stage in enumerate(self.stages):
            graph = DeviceGraph(self.device, pool)
            static.routed.append(graph.capture(lambda s=s, stage=stage: stage.route(self._input(static, s),
                                                                                       static.batch)))
            static.route.append(graph)
            part = None
            if stage.has_device_part:
                part = DeviceGraph(self.device, pool)
                part.capture(lambda s=s, stage=stage: stage.alongside(static.routed[s]))
            static.device_part.append(part)
        static.tail = DeviceGraph(self.device, pool)
        static.tail.capture(lambda: self.tail(self._input(static, len(self.stages)), static.batch))
        return static

    def _input(self, static: StaticDecode, s: int) -> torch.Tensor:
        """Stage s's input: the embedded ids for the first, else the previous stage's combined output."""
        return self.body.embed(static.ids) if s == 0 else static.x

    def _begin_stage(self, static: StaticDecode, s: int) -> Callable[[], None]:
        """Replays stage s's route graph, submits its routed call, replays its device part meanwhile; the
        returned call waits and combines into the next stage's input."""
        n = static.n
        static.routed[s] = static.route[s].replay()
        rows = static.routed[s].rows(n)
        stage = self.stages[s]
        routed = stage.submit(rows)
        part = static.device_part[s]
        device_out = None if part is None else part.replay()[:n]

        def finish() -> None:
            static.x[:n] = stage.combine(rows, routed(), device_out)
        return finish

    def run(self, host: HostBatch) -> torch.Tensor:
        """Final hidden states [n, H] of a decode step of n <= max_batch sequences."""
        static = self._static(0, host)
        for s in range(len(self.stages)):
            self._begin_stage(static, s)()
        return static.tail.replay()[:static.n]

    def run_overlapped(self, a: HostBatch, b: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Dual-batch overlap in the eager body's order (hybrid/models/overlap.py): one micro-batch's segment
        runs on the device while the expert process computes the other's routed experts."""
        statics = (self._static(0, a), self._static(1, b))
        interleave(len(self.stages), lambda mb, s: self._begin_stage(statics[mb], s))
        out_a, out_b = (static.tail.replay()[:static.n] for static in statics)
        return out_a, out_b
