"""Hybrid decode steps replayed from captured graphs (CUDA graphs on a GPU, the guarded stand-in on the CPU).

A hybrid decode step leaves the device at every MoE layer, where the routed experts run in the expert
process, so a step is captured in pieces. Segment s runs the dense layers before MoE layer m_s whole, then
m_s's attention, post-attention norm and router; the host sends the routed call, replays m_s's device-part
graph (shared experts) while the CPU computes, and adds the result into the next segment's static input.
The tail segment runs the layers after the last MoE layer and the final norm.

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
from gpu.device_graph import DeviceGraph
from gpu.triton_attention import TritonAttention
from hybrid.dual_batch import interleave
from hybrid.forward_batch import ForwardBatch, HostBatch
from hybrid.models.routed_moe import RoutedMoe


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
                 dtype: torch.dtype, device: torch.device, kv_caches: list, attention, splits: int):
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
        self.routed_inputs: list = []  # per segment: the route graph's latest (h, y, ids, weights)

    @property
    def ids(self) -> torch.Tensor:
        return self.io[0]

    def load(self, host: HostBatch) -> None:
        n = len(host.ids)
        self.io[:, :n].copy_(torch.tensor([host.ids, host.positions, host.slots], dtype=torch.long))
        width = max(len(t) for t in host.block_tables)
        rows = [t + [self.pad_block] * (width - len(t)) for t in host.block_tables]
        self.tables[:n, :width].copy_(torch.tensor(rows, dtype=torch.int32))
        self.ctx[:n].copy_(torch.tensor(host.context_lens, dtype=torch.int32))
        if n < self.n:
            self.io[2, n:self.n] = self.pad_slot
            self.tables[n:self.n, 0] = self.pad_block
            self.ctx[n:self.n] = 1
        self.n = n


class DecodeGraphs:
    def __init__(self, body: nn.Module, kv_caches: list, attention, pad_block: int, block_size: int,
                 max_model_len: int, max_batch: int, dtype: torch.dtype, device: torch.device, lanes: int = 1):
        if not isinstance(attention, TritonAttention):
            raise ValueError("decode graphs need the Triton attention: the torch path reads per-sequence host lists "
                             "that a replay would not update")
        self.body, self.kv_caches, self.attention = body, kv_caches, attention
        self.pad_block, self.block_size, self.dtype, self.device = pad_block, block_size, dtype, device
        self.max_blocks = -(-max_model_len // block_size)
        # Triton's interpreter (the CPU stand-in) runs programs one after another: two splits still take the
        # split-and-combine path without multiplying test time by the GPU's eight.
        self.splits = split_count(max_model_len) if device.type == "cuda" else min(2, split_count(max_model_len))
        self.sizes = bucket_sizes(max_batch)
        self.layers = list(body.layers)
        self.moe_layers = [i for i, layer in enumerate(self.layers) if isinstance(layer.mlp, RoutedMoe)]
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
        start = 0
        for s, m in enumerate(self.moe_layers):
            graph = DeviceGraph(self.device, pool)
            static.routed_inputs.append(graph.capture(lambda a=start, m=m: self._route_segment(static, a, m)))
            static.route.append(graph)
            part = None
            if self.layers[m].mlp.shared_experts is not None:
                part = DeviceGraph(self.device, pool)
                part.capture(lambda s=s, m=m: self.layers[m].mlp.device_part(static.routed_inputs[s][1]))
            static.device_part.append(part)
            start = m + 1
        static.tail = DeviceGraph(self.device, pool)
        static.tail.capture(lambda a=start: self._tail_segment(static, a))
        return static

    def _segment_input(self, static: StaticDecode, start: int) -> torch.Tensor:
        x = self.body.embed_tokens.weight[static.ids] if start == 0 else static.x
        for layer in self.layers[start:]:
            if isinstance(layer.mlp, RoutedMoe):
                break
            x = layer(x, static.batch)
        return x

    def _route_segment(self, static: StaticDecode, start: int, moe: int):
        """Dense layers start..moe-1, then layer moe up to its router: (h, y, topk ids, topk weights)."""
        layer = self.layers[moe]
        h = layer.attend(self._segment_input(static, start), static.batch)
        y = layer.post_attention_layernorm(h)
        ids, weights = layer.mlp.gate(y)
        return h, y, ids, weights

    def _tail_segment(self, static: StaticDecode, start: int) -> torch.Tensor:
        return self.body.norm(self._segment_input(static, start))

    def _begin_moe(self, static: StaticDecode, s: int) -> Callable[[], None]:
        """Replays segment s, sends its routed call, runs its device part meanwhile; the returned call waits
        and writes h + routed (+ device part) into the next segment's input."""
        n = static.n
        h, y, ids, weights = static.routed_inputs[s] = static.route[s].replay()
        mlp = self.layers[self.moe_layers[s]].mlp
        routed = mlp.experts.submit(mlp.layer, y[:n], ids[:n], weights[:n])
        part = static.device_part[s]
        device_out = None if part is None else part.replay()[:n]

        def finish() -> None:
            static.x[:n] = h[:n] + mlp.combine(routed(), device_out)
        return finish

    def run(self, host: HostBatch) -> torch.Tensor:
        """Final hidden states [n, H] of a decode step of n <= max_batch sequences."""
        static = self._static(0, host)
        for s in range(len(self.moe_layers)):
            self._begin_moe(static, s)()
        return static.tail.replay()[:static.n]

    def run_overlapped(self, a: HostBatch, b: HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Dual-batch overlap in the eager runner's order (hybrid.dual_batch): one micro-batch's segment runs
        on the device while the expert process computes the other's routed experts."""
        statics = (self._static(0, a), self._static(1, b))
        interleave(len(self.moe_layers), lambda mb, s: self._begin_moe(statics[mb], s))
        out_a, out_b = (static.tail.replay()[:static.n] for static in statics)
        return out_a, out_b
