"""The copy side of streamed prefill (SLP): pieces of a MoE layer's packed experts, straight from the mapped pack,
into a ring of two device buffers on a copy stream, ordered against the compute stream by events.

A piece is up to `piece_experts` experts of one layer (a whole layer where the device has room). While the device
computes piece p, piece p + 1 (of this layer or the next) is copied into the other buffer; the copy waits on an
event that the compute stream records once it has read that buffer's previous piece. The host never waits inside
the pipeline.

The source is the pack the expert process maps (hybrid/experts/pack.py): RAM holds the experts once. On CUDA the
mapping is registered with cudaHostRegister (read-only), so each copy is one DMA from it ("register"); "bounce"
copies through two bounded pinned buffers instead, the host memcpy-ing into one while the other's DMA runs (for
systems that refuse to register a file mapping). On a CPU "device" a copy is a memcpy into the buffer: the same
calls in the same order, without streams.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from gpu.fused_moe import DeviceExperts

log = logging.getLogger(__name__)

FIELDS = ("w13_data", "w2_data", "w13_scales", "w2_scales")  # what the device kernel reads (not the CPU's flags)
BOUNCE_BYTES = 64 << 20
HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly
COPY_MODES = ("auto", "register", "bounce")


@dataclass
class Piece:
    layer: int
    experts: list[int]  # global expert ids, in buffer order
    nbytes: int = 0


def device_expert_bytes(packed) -> int:
    """Bytes of one expert that a piece copies (`packed`: a layer's PackedExperts)."""
    return sum(getattr(packed, f)[0].nbytes for f in FIELDS if getattr(packed, f) is not None)


def register_spans(pack: dict, share: range, page: int = os.sysconf("SC_PAGE_SIZE")) -> list[tuple[int, int]]:
    """Page-aligned, merged [start, end) address spans covering experts `share` of every field the device copies."""
    run = slice(share.start, share.stop)
    spans = sorted((t[run].data_ptr() // page * page, -(-(t[run].data_ptr() + t[run].nbytes) // page) * page)
                   for packed in pack.values() for f in FIELDS if (t := getattr(packed, f)) is not None)
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class _Buffer:
    """One device buffer: room for `capacity` experts of every field, an expert -> index map, and its events."""

    def __init__(self, template, capacity: int, num_experts: int, device: torch.device):
        self.tensors = {f: torch.empty((capacity, *getattr(template, f).shape[1:]), dtype=getattr(template, f).dtype,
                                       device=device) for f in FIELDS if getattr(template, f) is not None}
        self.slot = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
        self.host_slot = torch.full((num_experts,), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.filled = self.free = None
        self.piece: Piece | None = None


class ExpertStream:
    """Copies pieces of layers from `pack` ({layer: PackedExperts}, mapped) to `device`."""

    def __init__(self, pack: dict, device: torch.device, piece_experts: int, copy: str = "auto",
                 share: range | None = None):
        """`share`: the run of expert ids this device streams (SmallEP), the only part registered with CUDA; the
        rest, should this device ever stream it, is copied from pageable memory."""
        if copy not in COPY_MODES:
            raise ValueError(f"slp copy mode must be one of {', '.join(COPY_MODES)}, got {copy!r}")
        if piece_experts < 1:
            raise ValueError("a streamed piece needs room for at least one expert")
        self.pack, self.device = pack, device
        first = next(iter(pack.values()))
        self.num_experts = first.num_experts
        self.share = range(self.num_experts) if share is None else share
        self.piece_experts = min(piece_experts, self.num_experts)
        self.expert_bytes = device_expert_bytes(first)
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.buffers = [_Buffer(first, self.piece_experts, self.num_experts, device) for _ in range(2)]
        self._next = 0
        self._registered: list[int] = []
        self.copy = self._choose_copy(copy)
        self._bounce: list[torch.Tensor] = []
        self._bounce_events: list = [None, None]

    def _choose_copy(self, asked: str) -> str:
        if not self.cuda:
            return "memcpy"
        if asked in ("auto", "register"):
            try:
                self._register()
                return "register"
            except RuntimeError as e:
                if asked == "register":
                    raise
                log.warning("streamed prefill: cannot register the expert pack with CUDA (%s); copying through "
                            "pinned bounce buffers", e)
        return "bounce"

    def _register(self) -> None:
        """Registers the pages holding this device's share of every field of every layer (fields share pages at
        their ends, so page-rounded spans are merged: a page can be registered once)."""
        cudart = torch.cuda.cudart()
        for start, end in register_spans(self.pack, self.share):
            err = cudart.cudaHostRegister(start, end - start, HOST_REGISTER_READ_ONLY)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister returned {int(err)}")
            self._registered.append(start)

    def pieces(self, layer: int, experts: list[int]) -> list[Piece]:
        """`experts` of `layer` in pieces that fit one buffer."""
        size = self.piece_experts
        return [Piece(layer, experts[i:i + size], len(experts[i:i + size]) * self.expert_bytes)
                for i in range(0, len(experts), size)]

    def start(self, piece: Piece) -> _Buffer:
        """Issues the copy of `piece` into the next buffer, once the device has read that buffer's last piece."""
        buf = self.buffers[self._next]
        self._next ^= 1
        n, first = len(piece.experts), piece.experts[0]
        ids = torch.tensor(piece.experts)
        # a run of experts is a slice of the mapping (copied from in place), anything else a gathered copy
        pick = slice(first, first + n) if piece.experts == list(range(first, first + n)) else ids
        sources = {field: getattr(self.pack[piece.layer], field)[pick] for field in buf.tensors}
        if self.cuda and buf.filled is not None:
            buf.filled.synchronize()  # its host slot map may be rewritten only once its last upload is done
        slot = buf.host_slot if self.cuda else buf.slot
        slot.fill_(-1)
        slot[ids] = torch.arange(n, dtype=torch.int32)
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if buf.free is not None:
                    self.copy_stream.wait_event(buf.free)
                buf.slot.copy_(buf.host_slot, non_blocking=True)
                for field, dst in buf.tensors.items():
                    self._copy(dst[:n], sources[field])
                buf.filled = torch.cuda.Event()
                buf.filled.record(self.copy_stream)
        else:
            for field, dst in buf.tensors.items():
                dst[:n].copy_(sources[field])
        buf.piece = piece
        return buf

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.copy == "register":
            dst.copy_(src, non_blocking=True)
            return
        if not self._bounce:
            self._bounce = [torch.empty(BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        flat_src, flat_dst = src.contiguous().view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        for i, off in enumerate(range(0, flat_src.numel(), BOUNCE_BYTES)):
            n = min(BOUNCE_BYTES, flat_src.numel() - off)
            k = i % 2
            if self._bounce_events[k] is not None:
                self._bounce_events[k].synchronize()
            self._bounce[k][:n].copy_(flat_src[off:off + n])
            flat_dst[off:off + n].copy_(self._bounce[k][:n], non_blocking=True)
            self._bounce_events[k] = torch.cuda.Event()
            self._bounce_events[k].record(self.copy_stream)

    def ready(self, buf: _Buffer) -> DeviceExperts:
        """The buffer's piece for the compute stream (which waits for its copy)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(buf.filled)
        p = self.pack[buf.piece.layer]
        n = len(buf.piece.experts)
        t = {f: v[:n] for f, v in buf.tensors.items()}
        return DeviceExperts(int(p.fmt), p.hidden, p.inter, p.kp13, p.kp2, t["w13_data"], t["w2_data"],
                             t.get("w13_scales"), t.get("w2_scales"), buf.slot, p.block_k, p.group)

    def release(self, buf: _Buffer) -> None:
        """Marks the point of the compute stream after which the buffer may be overwritten."""
        if self.cuda:
            buf.free = torch.cuda.Event()
            buf.free.record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        if self._registered:
            torch.cuda.synchronize(self.device)
            for ptr in self._registered:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            self._registered = []
