"""Streamed prefill (SLP): host->device copy of each layer's experts as a fraction of the pinned H2D bandwidth probed
in the same run, device expert TFLOP/s as a fraction of a dense bf16 matmul's (also probed in the same run), prefill
tokens/s through the MoE layers with CPU experts vs SLP vs SmallEP (two devices, half the experts each: an expert
rank process streams the other half), the crossover in tokens, and the predicted MoE time of a 32K-token prompt over
the full model's layers.

The experts are a synthetic pack in the real shapes (one properly packed expert repeated: the bytes and shapes
the kernels see, without a checkpoint), mapped from a file as the expert process maps its pack. Streaming uses
hybrid's own ExpertStream / StreamedExperts, the device kernel is gpu/fused_moe.py, the CPU side is the C++
kernels over the same mapping.

Without a GPU the CPU plays the device: the "H2D" copy is a memcpy and the Triton kernel runs in its interpreter,
so the device numbers are NOT GPU numbers (the interpreter is orders of magnitude slower than the CPU kernels,
and auto would never stream here). They show the pipeline works and what it costs here, nothing more. SmallEP
runs over two CPU processes there, and needs two GPUs on a GPU machine (a one-GPU machine says so and skips it).

    python scripts/bench_prefill.py                                    # small shapes (CPU as the device)
    python scripts/bench_prefill.py --shape deepseek-v3 --layers 3 --tokens 8192     # on a GPU machine
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cpu_kernels.moe import PackedExperts, kernel_isa_name, pack_experts  # noqa: E402
from cpu_kernels.moe import fused_moe as cpu_fused_moe  # noqa: E402
from cpu_kernels.thread_pool import unpin_child  # noqa: E402
from gpu.fused_moe import fused_moe, tile_shape  # noqa: E402
from hybrid.distributed.local_store import LocalStore, open_local_store  # noqa: E402
from hybrid.experts.expert_rank import serve  # noqa: E402
from hybrid.experts.expert_stream import ExpertStream, device_expert_bytes  # noqa: E402
from hybrid.experts.kernel_experts import KernelExperts  # noqa: E402
from hybrid.experts.slp_policy import SlpPolicy, SlpRates  # noqa: E402
from hybrid.experts.small_ep import (  # noqa: E402
    IDLE_TIMEOUT,
    JOIN_TIMEOUT,
    PEER_TIMEOUT,
    ExpertPeers,
    PeerGroups,
    expert_share,
)
from hybrid.experts.streamed_experts import StreamedExperts, piece_experts, share_stream  # noqa: E402


@dataclass(frozen=True)
class Shape:
    experts: int
    hidden: int
    inter: int
    top_k: int
    fmt: str
    model_layers: int  # MoE layers of the full model, for the predicted TTFT


TILES = [(16, 32), (32, 64), (64, 64), (64, 128), (128, 64), (128, 128)]  # (block_m, block_n) timed on a GPU
SHAPES = {
    "deepseek-v3": Shape(256, 7168, 2048, 8, "fp8", 58),
    "qwen3-30b-a3b": Shape(128, 2048, 768, 8, "bf16", 48),
    "small": Shape(16, 256, 128, 4, "fp8", 58),
}
FIELDS = ("w13_data", "w2_data", "w13_scales", "w2_scales", "w13_comp", "w2_comp", "w13_flags", "w2_flags")


def one_expert(s: Shape) -> PackedExperts:
    g = torch.Generator().manual_seed(0)
    w = lambda n, k: [torch.randn(n, k, generator=g) * 0.05]  # noqa: E731
    return pack_experts(w(s.inter, s.hidden), w(s.inter, s.hidden), w(s.hidden, s.inter), s.fmt)


def layout(one: PackedExperts, s: Shape, layers: int) -> dict[tuple[int, str], int]:
    """Offsets of every (layer, field) run of experts in the pack file, 64-byte aligned."""
    spans, pos = {}, 0
    for layer in range(layers):
        for field in FIELDS:
            t = getattr(one, field)
            if t is not None:
                pos += -pos % 64
                spans[layer, field] = pos
                pos += t.nbytes * s.experts
    return spans


def synthetic_pack(path: Path, s: Shape, layers: int) -> dict[int, PackedExperts]:
    """A pack file of `layers` layers, each expert a copy of one packed random expert; mapped read-only."""
    one = one_expert(s)
    spans = layout(one, s, layers)
    with open(path, "wb") as f:
        for (layer, field), off in spans.items():
            f.write(b"\0" * (off - f.tell()))
            raw = getattr(one, field).contiguous().view(torch.uint8).numpy().tobytes()
            for _ in range(s.experts):
                f.write(raw)
    return mapped_pack(path, s, layers, one)


def mapped_pack(path: Path, s: Shape, layers: int, one: PackedExperts | None = None) -> dict[int, PackedExperts]:
    """The pack file written by synthetic_pack, mapped read-only (as the expert process maps a pack)."""
    one = one or one_expert(s)
    spans = {key: (off, getattr(one, key[1])) for key, off in layout(one, s, layers).items()}
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    warnings.simplefilter("ignore", UserWarning)  # read-only shared mapping: nothing writes it
    pack = {}
    for layer in range(layers):
        views = {}
        for field in FIELDS:
            if (layer, field) not in spans:
                continue
            off, t = spans[layer, field]
            n = t.nbytes * s.experts
            views[field] = torch.from_numpy(mm[off:off + n]).view(t.dtype).view(s.experts, *t.shape[1:])
        pack[layer] = PackedExperts(one.fmt, one.hidden, one.inter, one.kp13, one.kp2, views["w13_data"],
                                    views["w2_data"], views.get("w13_scales"), views.get("w2_scales"),
                                    views.get("w13_comp"), views.get("w2_comp"), views.get("w13_flags"),
                                    views.get("w2_flags"), one.block_k, one.group)
    return pack


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def h2d_probe(nbytes: int) -> float:
    """Best-of-3 bytes/s of one copy from pinned host memory to the device (on CPU: a memcpy between buffers)."""
    nbytes = max(min(nbytes, 1 << 30), 256 << 20)  # past the caches
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE.type == "cuda").fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    best = float("inf")
    for _ in range(3):
        sync()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def dense_flops(m: int, k: int, n: int) -> float:
    """Best-of-3 FLOP/s of one dense bf16 matmul [m, k] x [k, n] on the device: the bound of the experts' kernel,
    which does the same multiply-adds split over experts (from fp8, dequantized to bf16 in registers)."""
    a = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(k, n, device=DEVICE).to(torch.bfloat16)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(3):
        sync()
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best


def stream_layers(stream: ExpertStream, layers: list[int], owned: list[int]) -> list[float]:
    """Seconds to copy each layer's experts to the device, one layer at a time."""
    times = []
    for layer in layers:
        sync()
        start = time.perf_counter()
        for piece in stream.pieces(layer, owned):
            stream.release(stream.start(piece))
        sync()
        times.append(time.perf_counter() - start)
    return times


def pipeline_bound(copy_s: float, compute_s: float, layers: int) -> float:
    """Seconds per layer of a perfect two-stage pipeline over `layers` layers: the first copy and the last compute
    overlap nothing, every other step takes the slower stage."""
    return (layers * max(copy_s, compute_s) + min(copy_s, compute_s)) / layers


def routed(s: Shape, tokens: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(tokens, s.hidden, generator=g) * 0.1).to(dtype)
    ids = torch.stack([torch.randperm(s.experts, generator=g)[:s.top_k] for _ in range(tokens)])
    return x, ids, torch.full((tokens, s.top_k), 1.0 / s.top_k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--layers", type=int, default=3, help="MoE layers in the synthetic pack")
    ap.add_argument("--tokens", type=int, help="tokens of the prefill pass (default: 8192 on a GPU, 64 here)")
    ap.add_argument("--dir", help="where to write the synthetic pack (default: a temporary directory)")
    for hidden in ("--serve-rank", "--world"):  # an expert rank of the SmallEP pass (started by it)
        ap.add_argument(hidden, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pack-file", help=argparse.SUPPRESS)
    ap.add_argument("--device", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_rank:
        serve_rank(a)
        return
    s = SHAPES[a.shape]
    tokens = a.tokens or (8192 if DEVICE.type == "cuda" else 64)
    dtype = torch.bfloat16
    print(f"CPU: {cpu_model()} (kernel path {kernel_isa_name()}); device: "
          f"{torch.cuda.get_device_name() if DEVICE.type == 'cuda' else 'the CPU (Triton interpreted)'}")
    if DEVICE.type == "cpu":
        print("NOTE: no GPU here -- the device numbers below are the CPU running Triton's interpreter and a memcpy, "
              "NOT GPU numbers.")
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        pack = synthetic_pack(Path(tmp) / "experts.bin", s, a.layers)
        layers = list(pack)
        owned = list(range(s.experts))
        first = pack[0]
        expert_bytes = device_expert_bytes(first)
        layer_bytes = expert_bytes * s.experts
        print(f"shape {a.shape}: {s.experts} experts x ({s.hidden} x {s.inter}) {s.fmt}, top-{s.top_k}; "
              f"{layer_bytes / 1e9:.3f} GB per layer, {a.layers} layers, a pass of {tokens} tokens")
        h2d = h2d_probe(layer_bytes)
        print(f"pinned H2D bound (probed now): {h2d / 1e9:.2f} GB/s")
        modes = ["register", "bounce"] if DEVICE.type == "cuda" else ["auto"]
        pieces = piece_experts(DEVICE, expert_bytes, s.experts)
        best_rate = 0.0
        for mode in modes:
            stream = ExpertStream(pack, DEVICE, pieces, mode)
            times = stream_layers(stream, layers, owned)
            rate = layer_bytes / min(times)
            best_rate = max(best_rate, rate)
            print(f"stream ({stream.copy}, pieces of {stream.piece_experts} experts): per layer "
                  f"{' '.join(f'{t * 1e3:.1f}' for t in times)} ms = {rate / 1e9:.2f} GB/s = {rate / h2d:.2f} of H2D")
            stream.close()
        stream = ExpertStream(pack, DEVICE, pieces, "auto")
        x, ids, w = routed(s, tokens, dtype)
        dx, di, dw = (t.to(DEVICE) for t in (x, ids, w))
        buf = stream.start(stream.pieces(0, owned)[0])
        weights = stream.ready(buf)
        pieces_per_layer = len(stream.pieces(0, owned))

        def device_layer_s(tile: tuple[int, int] | None = None) -> float:
            """Seconds of the device kernels over a layer's pass (after a warm-up call that compiles them)."""
            fused_moe(weights, dx, di, dw, *(tile or ()))
            sync()
            start = time.perf_counter()
            fused_moe(weights, dx, di, dw, *(tile or ()))
            sync()
            return (time.perf_counter() - start) * pieces_per_layer

        flops = 6 * s.hidden * s.inter * tokens * s.top_k
        compute_s = device_layer_s()
        tile = "x".join(map(str, tile_shape(tokens * s.top_k, s.experts)))
        peak = dense_flops(tokens * s.top_k, s.hidden, s.inter)
        print(f"device experts: {compute_s * 1e3:.1f} ms per layer at {tokens} tokens = "
              f"{flops / compute_s / 1e12:.3f} TFLOP/s (tile {tile}) = {flops / compute_s / peak:.3g} of a dense "
              f"bf16 matmul over the same {tokens * s.top_k} rows ({peak / 1e12:.3f} TFLOP/s, probed now)")
        if DEVICE.type == "cuda":
            for block_m, block_n in TILES:
                try:
                    tile_s = device_layer_s((block_m, block_n))
                except Exception as e:  # a tile the device cannot hold (Triton's OutOfResources): report, go on
                    print(f"  tile {block_m}x{block_n}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    continue
                print(f"  tile {block_m}x{block_n}: {tile_s * 1e3:.1f} ms per layer = "
                      f"{flops / tile_s / 1e12:.3f} TFLOP/s = {flops / tile_s / peak:.3f} of the dense matmul")
        stream.release(buf)
        cpu_experts = KernelExperts(pack)
        cpu_fused_moe(pack[0], x, ids, w)
        start = time.perf_counter()
        cpu_fused_moe(pack[0], x, ids, w)
        cpu_s = time.perf_counter() - start
        print(f"CPU experts: {cpu_s * 1e3:.1f} ms per layer = {tokens / cpu_s:.0f} tokens/s per layer, "
              f"{tokens / (cpu_s * s.model_layers):.1f} tokens/s over {s.model_layers} MoE layers")
        streamed = StreamedExperts(cpu_experts, stream, SlpPolicy(1), layers, s.top_k)
        sync()
        # The clock starts before begin_pass, which already starts copying the first layer.
        start = time.perf_counter()
        streamed.begin_pass(tokens, tokens)
        for layer in layers:
            streamed.submit(layer, dx, di, dw)()
        streamed.end_pass()
        pass_s = (time.perf_counter() - start) / len(layers)
        bound = pipeline_bound(layer_bytes / h2d, compute_s, len(layers))
        print(f"SLP pipelined pass: {pass_s * 1e3:.1f} ms per layer = {tokens / pass_s:.0f} tokens/s per layer, "
              f"{tokens / (pass_s * s.model_layers):.1f} tokens/s over {s.model_layers} MoE layers; bound "
              f"{bound * 1e3:.1f} ms (copy at H2D {layer_bytes / h2d * 1e3:.1f}, compute {compute_s * 1e3:.1f}, "
              f"the pipeline's fill over {len(layers)} layers) = {bound / pass_s:.2f} of bound")
        print(f"SLP / CPU experts at {tokens} tokens: {cpu_s / pass_s:.2f}x")
        rates = SlpRates(best_rate, compute_s / tokens, cpu_s / tokens, layer_bytes)
        cross = rates.crossover()
        print(f"crossover: {'streaming never wins here' if cross is None else f'{cross} tokens'}")
        ttft = s.model_layers * rates.stream_s(32768)
        copy_total = s.model_layers * layer_bytes / best_rate
        compute_total = s.model_layers * 32768 * rates.device_s_per_token
        print(f"predicted MoE time of a 32K prompt over {s.model_layers} layers: {ttft:.1f} s streamed (copy "
              f"{copy_total:.1f} s, compute {compute_total:.1f} s) vs {s.model_layers * rates.cpu_s(32768):.1f} s on "
              "the CPU (attention and dense layers not included)")
        streamed.close()
        devices = small_ep_devices()
        if devices is None:
            print("SmallEP: needs two GPUs, this machine has one -- not measured")
            return
        sep_s, exchange_s, moved = small_ep_pass(Path(tmp) / "experts.bin", a, pack, cpu_experts, (dx, di, dw),
                                                 devices)
        half = SlpRates(best_rate, compute_s / tokens / len(devices), cpu_s / tokens,
                        -(-layer_bytes // len(devices)), exchange_s / tokens)
        share_bound = pipeline_bound(half.copy_s(), half.compute_s(tokens), len(layers))
        print(f"SmallEP pass over {len(devices)} {'GPUs' if DEVICE.type == 'cuda' else 'CPU processes'}: "
              f"{sep_s * 1e3:.1f} ms per layer = {tokens / sep_s:.0f} tokens/s per layer "
              f"({pass_s / sep_s:.2f}x the one-device pass), {moved / len(layers) / 1e9:.3f} GB streamed per layer "
              f"over all devices; exchange of the layer's tokens {exchange_s * 1e3:.1f} ms; bound (share's copy, "
              f"share's compute + exchange, the pipeline's fill) {share_bound * 1e3:.1f} ms = "
              f"{share_bound / sep_s:.2f} of bound")
        print(f"predicted MoE time of a 32K prompt over {s.model_layers} layers with SmallEP: "
              f"{s.model_layers * half.stream_s(32768):.1f} s; crossover {half.crossover() or 'never'}")


def small_ep_devices() -> list[torch.device] | None:
    """Two GPUs, or two CPU processes playing them; None on a one-GPU machine."""
    if DEVICE.type == "cpu":
        return [DEVICE, DEVICE]
    if torch.cuda.device_count() < 2:
        return None
    return [torch.device("cuda:0"), torch.device("cuda:1")]


def small_ep_pass(path: Path, a, pack, cpu_experts, batch, devices) -> tuple[float, float, int]:
    """A pass split over an expert rank per further device (this script again, --serve-rank): seconds per layer
    (after a warm-up pass), seconds of one exchange of the pass's tokens, bytes streamed by all devices."""
    s = SHAPES[a.shape]
    world = len(devices)
    local = LocalStore(world, JOIN_TIMEOUT)  # kept until the end: NCCL connects, through it, at the first pass
    procs = [subprocess.Popen([sys.executable, __file__, "--shape", a.shape, "--layers", str(a.layers),
                               "--serve-rank", str(r), "--world", str(world),
                               "--pack-file", str(path), "--device", str(devices[r])],
                              env=dict(os.environ, **local.child_env()), preexec_fn=unpin_child)
             for r in range(1, world)]  # unpin_child: the CPU kernels pinned this thread to one core
    peers = ExpertPeers(PeerGroups(local.store, 0, world, devices[0], PEER_TIMEOUT), procs, s.hidden, s.top_k)
    share = expert_share(s.experts, world, 0)
    stream = share_stream(pack, devices[0], share)
    sep = StreamedExperts(cpu_experts, stream, SlpPolicy(1), list(pack), s.top_k, share, peers=peers)
    x, ids, w = batch
    try:
        times = []
        for _ in range(2):
            before = sep.stats.streamed_bytes
            sync()
            start = time.perf_counter()
            sep.begin_pass(x.shape[0], x.shape[0])
            for layer in pack:
                sep.submit(layer, x, ids, w)()
            sep.end_pass()
            times.append((time.perf_counter() - start) / len(pack))
        moved = sep.stats.streamed_bytes - before
        start = time.perf_counter()
        peers.probe(x.shape[0], x.dtype, devices[0])
        sync()
        exchange_s = time.perf_counter() - start
    finally:
        sep.close()
        local.close()
    return times[-1], exchange_s, moved


def serve_rank(a) -> None:
    """An expert rank of small_ep_pass: its share of the same mapped pack, served until rank 0 stops it."""
    s = SHAPES[a.shape]
    device = torch.device(a.device)
    pack = mapped_pack(Path(a.pack_file), s, a.layers)
    share = expert_share(s.experts, a.world, a.serve_rank)
    stream = share_stream(pack, device, share)
    experts = StreamedExperts(None, stream, SlpPolicy(1), list(pack), s.top_k, share)
    store = open_local_store(a.world, JOIN_TIMEOUT)
    serve(experts, PeerGroups(store, a.serve_rank, a.world, device, IDLE_TIMEOUT), s.hidden, s.top_k, torch.bfloat16)
    experts.close()


if __name__ == "__main__":
    main()
