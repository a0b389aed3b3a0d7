"""Streamed prefill (SLP): host->device copy of each layer's experts as a fraction of the pinned H2D bandwidth probed
in the same run, device expert TFLOP/s, prefill tokens/s through the MoE layers with CPU experts vs SLP, the
crossover in tokens, and the predicted MoE time of a 32K-token prompt over the full model's layers.

The experts are a synthetic pack in the real shapes (one properly packed expert repeated: the bytes and shapes
the kernels see, without a checkpoint), mapped from a file as the expert process maps its pack. Streaming uses
hybrid's own ExpertStream / StreamedExperts, the device kernel is gpu/fused_moe.py, the CPU side is the C++
kernels over the same mapping.

Without a GPU the CPU plays the device: the "H2D" copy is a memcpy and the Triton kernel runs in its interpreter,
so the device numbers are NOT GPU numbers (the interpreter is orders of magnitude slower than the CPU kernels,
and auto would never stream here). They show the pipeline works and what it costs here, nothing more.

    python scripts/bench_prefill.py                                    # small shapes (CPU as the device)
    python scripts/bench_prefill.py --shape deepseek-v3 --layers 3 --tokens 8192     # on a GPU machine
"""

from __future__ import annotations

import argparse
import os
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
from gpu.fused_moe import fused_moe  # noqa: E402
from hybrid.experts.expert_stream import ExpertStream, device_expert_bytes  # noqa: E402
from hybrid.experts.kernel_experts import KernelExperts  # noqa: E402
from hybrid.experts.slp_policy import SlpPolicy, SlpRates  # noqa: E402
from hybrid.experts.streamed_experts import StreamedExperts, piece_experts  # noqa: E402


@dataclass(frozen=True)
class Shape:
    experts: int
    hidden: int
    inter: int
    top_k: int
    fmt: str
    model_layers: int  # MoE layers of the full model, for the predicted TTFT


SHAPES = {
    "deepseek-v3": Shape(256, 7168, 2048, 8, "fp8", 58),
    "qwen3-30b-a3b": Shape(128, 2048, 768, 8, "bf16", 48),
    "small": Shape(16, 256, 128, 4, "fp8", 58),
}
FIELDS = ("w13_data", "w2_data", "w13_scales", "w2_scales", "w13_comp", "w2_comp", "w13_flags", "w2_flags")


def synthetic_pack(path: Path, s: Shape, layers: int) -> dict[int, PackedExperts]:
    """A pack file of `layers` layers, each expert a copy of one packed random expert; mapped read-only."""
    g = torch.Generator().manual_seed(0)
    w = lambda n, k: [torch.randn(n, k, generator=g) * 0.05]  # noqa: E731
    one = pack_experts(w(s.inter, s.hidden), w(s.inter, s.hidden), w(s.hidden, s.inter), s.fmt)
    spans = {}
    with open(path, "wb") as f:
        for layer in range(layers):
            for field in FIELDS:
                t = getattr(one, field)
                if t is None:
                    continue
                f.write(b"\0" * (-f.tell() % 64))
                spans[layer, field] = (f.tell(), t)
                raw = t.contiguous().view(torch.uint8).numpy().tobytes()
                for _ in range(s.experts):
                    f.write(raw)
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
    a = ap.parse_args()
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
        fused_moe(weights, dx, di, dw)
        sync()
        start = time.perf_counter()
        fused_moe(weights, dx, di, dw)
        sync()
        compute_s = (time.perf_counter() - start) * len(stream.pieces(0, owned))
        stream.release(buf)
        flops = 6 * s.hidden * s.inter * tokens * s.top_k
        print(f"device experts: {compute_s * 1e3:.1f} ms per layer at {tokens} tokens = "
              f"{flops / compute_s / 1e12:.3f} TFLOP/s")
        cpu_experts = KernelExperts(pack)
        cpu_fused_moe(pack[0], x, ids, w)
        start = time.perf_counter()
        cpu_fused_moe(pack[0], x, ids, w)
        cpu_s = time.perf_counter() - start
        print(f"CPU experts: {cpu_s * 1e3:.1f} ms per layer = {tokens / cpu_s:.0f} tokens/s per layer, "
              f"{tokens / (cpu_s * s.model_layers):.1f} tokens/s over {s.model_layers} MoE layers")
        streamed = StreamedExperts(cpu_experts, stream, SlpPolicy(1), layers, s.top_k)
        streamed.begin_pass(tokens, tokens)
        sync()
        start = time.perf_counter()
        for layer in layers:
            streamed.submit(layer, dx, di, dw)()
        streamed.end_pass()
        pass_s = (time.perf_counter() - start) / len(layers)
        bound = max(layer_bytes / h2d, compute_s)
        print(f"SLP pipelined pass: {pass_s * 1e3:.1f} ms per layer = {tokens / pass_s:.0f} tokens/s per layer, "
              f"{tokens / (pass_s * s.model_layers):.1f} tokens/s over {s.model_layers} MoE layers; "
              f"bound max(copy at H2D, compute) {bound * 1e3:.1f} ms = {bound / pass_s:.2f} of bound")
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
        print("SmallEP (two devices, half the experts each): not built yet -- not measured")
        streamed.close()


if __name__ == "__main__":
    main()
