"""Stream-loading prefill (SLP): a pass of many tokens runs its routed experts on the device, each layer's experts
streamed from the mapped pack while the previous piece computes; other passes go to the CPU experts.

The model runs a step layer by layer over all its tokens, so a long prompt scheduled as one step (the scheduler
gives it up to --slp-max-tokens at once) is already the layer-outer pass SLP needs: this class only decides, per
step (`begin_pass`), where that step's routed experts run, and for a streamed step issues layer L + 1's first copy
before layer L computes. Passes with few tokens copy only the experts their tokens route to (known once the layer
has routed, so that copy is not overlapped); passes long enough that nearly every expert is routed stream whole
layers ahead. With SmallEP (hybrid/experts/small_ep.py) this is rank 0: it owns a share of every layer's experts
(`owned`) and streams only those, sends each layer's tokens to the expert ranks (`peers`), which stream and compute
theirs, and sums their partial outputs into its own. Should an expert rank fail, rank 0 computes that layer whole
and streams every expert itself from then on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu.fused_moe import fused_moe
from hybrid.distributed.communicator import CommunicationError
from hybrid.experts.base import Experts
from hybrid.experts.expert_stream import ExpertStream, Piece, device_expert_bytes
from hybrid.experts.slp_policy import SlpPolicy, SlpRates
from hybrid.experts.small_ep import ExpertPeers, expert_share, start_expert_ranks

log = logging.getLogger(__name__)

WHOLE_LAYER_COVERAGE = 0.9  # expected share of experts routed from which a pass streams whole layers ahead
PROBE_TOKENS = 16
EXCHANGE_SCALE = 64  # SmallEP's exchange is probed at PROBE_TOKENS and this many times as many


@dataclass
class SlpStats:
    passes: int = 0
    streamed_bytes: int = 0
    seconds: float = 0.0  # wall time of streamed passes: bytes / seconds is the streaming rate they achieved
    tokens: int = 0
    peer_bytes: int = 0  # of streamed_bytes, what SmallEP's expert ranks streamed to their GPUs

    @property
    def gb_per_s(self) -> float:
        return self.streamed_bytes / self.seconds / 1e9 if self.seconds else 0.0


class StreamedExperts(Experts):
    """`cpu`: where passes that do not stream go (None on an expert rank, which only streams); `owned`: the experts
    this device streams (all without SmallEP); `peers`: SmallEP's expert ranks, on rank 0."""

    def __init__(self, cpu: Experts | None, stream: ExpertStream, policy: SlpPolicy, moe_layers: list[int],
                 top_k: int, owned: list[int] | None = None, max_pass_tokens: int = 8192,
                 peers: ExpertPeers | None = None):
        self.remote, self.stream, self.policy, self.max_pass_tokens = cpu, stream, policy, max_pass_tokens
        self.moe_layers, self.top_k, self.peers = list(moe_layers), top_k, peers
        self.owned = list(range(stream.num_experts)) if owned is None else list(owned)
        self.stats = SlpStats()
        self._streaming = False
        self._ahead = False
        self._queued: dict[int, list] = {}
        self._pass_start = 0.0

    def window(self) -> tuple[int, int] | None:
        """(fewest, most) prefill tokens of one streamed pass now; None while no prefill would stream."""
        low = self.policy.min_tokens()
        return None if low is None else (low, max(low, self.max_pass_tokens))

    @property
    def streamed_bytes(self) -> int:
        return self.stats.streamed_bytes

    def begin_pass(self, num_tokens: int, longest_prefill: int) -> None:
        self._finish_pass()
        self._streaming = self.policy.streams(longest_prefill)
        if not self._streaming:
            return
        coverage = 1 - (1 - self.top_k / self.stream.num_experts) ** num_tokens
        self._ahead = coverage >= WHOLE_LAYER_COVERAGE
        self._pass_start = time.perf_counter()
        self.stats.passes += 1
        self.stats.tokens += num_tokens
        self._queued = {}
        if self.peers is not None:
            try:
                self.peers.begin(num_tokens, longest_prefill)
            except CommunicationError as e:
                self._lose_peers(e)
        if self._ahead:
            self._prefetch(self.moe_layers[0])

    @property
    def devices(self) -> int:
        """Devices streaming experts: 1, or SmallEP's ranks."""
        return 1 if self.peers is None else self.peers.ranks

    def _lose_peers(self, error: CommunicationError) -> None:
        """An expert rank failed: from now on this device streams and computes every expert."""
        log.error("%s; streaming every expert on this device from now on", error)
        self.peers.abandon()
        self.peers = None
        self.owned = list(range(self.stream.num_experts))
        self._queued = {}  # prefetched pieces hold only this device's former share

    def _issue(self, layer: int, experts: list[int]) -> list:
        """The layer's pieces of `experts`, the first one's copy issued; each next one is issued while the one
        before it computes."""
        pieces = self.stream.pieces(layer, experts)
        return [(p, self.stream.start(p) if i == 0 else None) for i, p in enumerate(pieces)]

    def _prefetch(self, layer: int) -> None:
        self._queued[layer] = self._issue(layer, self.owned)

    def _next_layer(self, layer: int) -> int | None:
        i = self.moe_layers.index(layer) + 1
        return self.moe_layers[i] if i < len(self.moe_layers) else None

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return self.submit(layer, hidden_states, topk_ids, topk_weights)()

    def submit(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        if not self._streaming:
            return self._on_cpu(layer, hidden_states, topk_ids, topk_weights)
        if self.peers is None:
            out = self._stream_layer(layer, hidden_states, topk_ids, topk_weights)
            return lambda: out
        try:
            self.peers.send_layer(layer, hidden_states, topk_ids, topk_weights)
        except CommunicationError as e:
            self._lose_peers(e)
            return self.submit(layer, hidden_states, topk_ids, topk_weights)
        out = None
        try:
            out = self._stream_layer(layer, hidden_states, topk_ids, topk_weights)
        finally:  # the expert ranks wait for this layer's sum whatever happened here: an error sends nothing
            try:
                self.peers.sum_into(torch.zeros_like(hidden_states) if out is None else out)
            except CommunicationError as e:
                self._lose_peers(e)
                out = None
        if out is None:  # the expert ranks' part is lost: this device computes the whole layer
            out = self._stream_layer(layer, hidden_states, topk_ids, topk_weights)
        return lambda: out

    def _stream_layer(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        """This device's share of the layer: its pieces streamed (the next one's copy issued before each computes)
        and computed."""
        if self._ahead:
            queue = self._queued.pop(layer, None)
            if queue is None:  # a layer the pass skipped to (or a lost peer's): stream it now, over any prefetch
                self._queued = {}
                self._prefetch(layer)
                queue = self._queued.pop(layer)
        else:
            used = sorted(set(torch.unique(topk_ids[topk_ids >= 0]).tolist()) & set(self.owned))
            queue = self._issue(layer, used)
        out = torch.zeros_like(hidden_states)
        following = self._next_layer(layer)
        for i, (piece, buf) in enumerate(queue):
            weights = self.stream.ready(buf)
            if i + 1 < len(queue):
                nxt, _ = queue[i + 1]
                queue[i + 1] = (nxt, self.stream.start(nxt))
            elif self._ahead and following is not None:
                self._prefetch(following)
            out += fused_moe(weights, hidden_states, topk_ids, topk_weights)
            self.stream.release(buf)
            self.stats.streamed_bytes += piece.nbytes
        return out

    def _on_cpu(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The CPU experts' call; prefill-sized ones are timed, so `auto` follows what the CPU really does."""
        tokens = hidden_states.shape[0]
        start = time.perf_counter()
        pending = self.remote.submit(layer, hidden_states, topk_ids, topk_weights)
        if tokens < PROBE_TOKENS:
            return pending

        def wait() -> torch.Tensor:
            out = pending()
            self.policy.record("cpu", tokens, time.perf_counter() - start)
            return out
        return wait

    def _finish_pass(self) -> None:
        if not self._streaming:
            return
        self._streaming = False
        if self.peers is not None:
            try:
                peer_bytes = self.peers.end()
                self.stats.streamed_bytes += peer_bytes
                self.stats.peer_bytes += peer_bytes
            except CommunicationError as e:
                self._lose_peers(e)
        if self.stream.cuda:
            torch.cuda.synchronize(self.stream.device)
        self.stats.seconds += time.perf_counter() - self._pass_start

    def end_pass(self) -> None:
        """Closes the bookkeeping of the current streamed pass (its time counts toward the reported GB/s)."""
        self._finish_pass()

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        self.stream.close()
        if self.remote is not None:
            self.remote.close()


def probe_rates(cpu: Experts, stream: ExpertStream, hidden: int, top_k: int, layer: int, dtype: torch.dtype,
                owned: list[int], peers: ExpertPeers | None = None) -> SlpRates:
    """Measures what `auto` decides from: the copy of this device's share of one layer (bytes/s), the device's
    seconds per token for that share and the CPU's for the whole layer at PROBE_TOKENS tokens, and with SmallEP
    the seconds per token of sending a layer's tokens to the expert ranks and summing their outputs back."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(PROBE_TOKENS, hidden, generator=g) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(stream.num_experts, generator=g)[:top_k] for _ in range(PROBE_TOKENS)])
    weights = torch.full((PROBE_TOKENS, top_k), 1.0 / top_k)
    sync = (lambda: torch.cuda.synchronize(stream.device)) if stream.cuda else (lambda: None)
    pieces = stream.pieces(layer, owned)
    start = time.perf_counter()
    for piece in pieces:
        stream.release(stream.start(piece))
    sync()
    copy_s = time.perf_counter() - start
    layer_bytes = sum(p.nbytes for p in pieces)
    dx, di, dw = (t.to(stream.device) for t in (x, ids, weights))
    used = sorted(set(ids.flatten().tolist()) & set(owned))
    buf = stream.start(Piece(layer, used[:stream.piece_experts], 0))
    w = stream.ready(buf)
    if stream.cuda:  # compiles the kernels; Triton's interpreter has nothing to compile, and a call costs seconds
        fused_moe(w, dx, di, dw)
        sync()
    start = time.perf_counter()
    fused_moe(w, dx, di, dw)
    sync()
    device_s = (time.perf_counter() - start) / PROBE_TOKENS
    stream.release(buf)
    cpu.forward(layer, x, ids, weights)
    start = time.perf_counter()
    cpu.forward(layer, x, ids, weights)
    cpu_s = (time.perf_counter() - start) / PROBE_TOKENS
    comm_s = comm_layer_s = 0.0
    if peers is not None:  # a fixed cost per layer and one per token, from exchanges of two sizes

        def exchange(tokens: int) -> float:
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                peers.probe(tokens, dtype, stream.device)
                sync()
                best = min(best, time.perf_counter() - start)
            return best
        few, many = exchange(PROBE_TOKENS), exchange(PROBE_TOKENS * EXCHANGE_SCALE)
        comm_s = max(0.0, (many - few) / (PROBE_TOKENS * (EXCHANGE_SCALE - 1)))
        comm_layer_s = max(0.0, few - PROBE_TOKENS * comm_s)
    rates = SlpRates(layer_bytes / max(copy_s, 1e-9), device_s, cpu_s, layer_bytes, comm_s, comm_layer_s)
    log.info("streamed prefill: %.2f GB/s to the device, %.1f us/token on the device (its share) + %.1f us/token "
             "and %.0f us/layer to and from the expert ranks vs %.1f us/token on the CPU per MoE layer; streaming from "
             "%s tokens", rates.h2d_bytes_per_s / 1e9, device_s * 1e6, comm_s * 1e6, comm_layer_s * 1e6, cpu_s * 1e6,
             rates.crossover() or "never")
    return rates


DEVICE_MEMORY_SHARE = 0.4  # of the device memory free when the experts are set up, what the two buffers may take
ACTIVATION_SHARE = 0.5  # of the device memory free then, what one pass's activations may take
CPU_DEVICE_PASS_TOKENS = 8192


def share_stream(pack: dict, device: torch.device, owned: list[int], copy: str = "auto") -> ExpertStream:
    """The stream of a device that copies `owned` (a contiguous run of expert ids) of every layer of `pack`: pieces
    sized to its memory, only that run registered with CUDA."""
    first = next(iter(pack.values()))
    return ExpertStream(pack, device, piece_experts(device, device_expert_bytes(first), len(owned)), copy,
                        range(owned[0], owned[-1] + 1))


def max_pass_tokens(device: torch.device, model, dtype: torch.dtype, piece_bytes: int) -> int:
    """The most tokens one streamed pass holds on the device: its activations at one layer (hidden states and
    their copies, attention's projections, the experts' intermediate and per-pair float32 outputs) in what is left
    of the device's memory once the expert buffers are taken."""
    if device.type != "cuda":
        return CPU_DEVICE_PASS_TOKENS
    item = torch.finfo(dtype).bits // 8
    k, h = model.num_experts_per_tok, model.hidden_size
    per_token = 16 * h * item + k * (model.moe_intermediate_size * item + 4 * h + 8)
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, int((free - 2 * piece_bytes) * ACTIVATION_SHARE) // per_token)


def piece_experts(device: torch.device, expert_bytes: int, num_experts: int) -> int:
    """Experts per streamed piece: a whole layer where two of them fit the device's share, else what does."""
    if device.type != "cuda":
        return num_experts
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(num_experts, int(free * DEVICE_MEMORY_SHARE) // (2 * expert_bytes)))


def streamed_experts(engine, model, cpu: Experts, dtype: torch.dtype, device: torch.device) -> Experts:
    """`cpu` behind streamed prefill, mapping the same pack the expert process serves (packed before it started).
    Without a pack to map (an expert process attached by address, no --expert-pack) prefill stays on the CPU."""
    from hybrid.experts.pack import PackError, engine_pack, load_pack

    if engine.expert_server is not None and engine.expert_pack is None:
        if isinstance(engine.slp_threshold, int):
            raise PackError("streamed prefill maps the expert pack: with --expert-server pass --expert-pack too")
        log.warning("streamed prefill is off: an expert process attached by address, and no --expert-pack to map")
        return cpu
    fmt, pack_dir = engine_pack(model, engine.expert_format, engine.expert_pack)
    pack = load_pack(pack_dir, model, fmt)
    first = next(iter(pack.values()))
    ranks = len(engine.gpus)
    owned = expert_share(first.num_experts, ranks, 0)
    stream = share_stream(pack, device, owned, engine.slp_copy)
    pass_tokens = engine.slp_max_tokens or max_pass_tokens(device, model, dtype,
                                                           stream.piece_experts * stream.expert_bytes)
    policy = SlpPolicy(engine.slp_threshold)
    peers = None
    try:
        if ranks > 1:
            peers = start_expert_ranks(engine, pack_dir, model.hidden_size, model.num_experts_per_tok, dtype)
        if policy.threshold == "auto":
            policy.rates = probe_rates(cpu, stream, model.hidden_size, model.num_experts_per_tok,
                                       model.moe_layers[0], dtype, owned, peers)
    except BaseException:
        if peers is not None:
            peers.abandon()
        stream.close()
        raise
    log.info("streamed prefill: %s copy, pieces of %d experts (%.1f MB), passes of up to %d tokens, threshold %s%s",
             stream.copy, stream.piece_experts, stream.piece_experts * stream.expert_bytes / 1e6, pass_tokens,
             policy.min_tokens() if policy.min_tokens() is not None else "never",
             f"; SmallEP over {ranks} devices, experts {owned[0]}..{owned[-1]} here" if peers else "")
    return StreamedExperts(cpu, stream, policy, model.moe_layers, model.num_experts_per_tok, owned, pass_tokens,
                           peers)
