"""Fused-MoE kernel benchmark against the machine's measured read bandwidth and against torch.

For each expert shape, weight format and token count T it prints: GB/s of expert weights read (distinct
experts touched x bytes per expert), that as a fraction of the read bandwidth measured by scripts/membw.c
around it (blocks of calls alternate with probes; the median over blocks of each block's GB/s over the mean of
the probes either side, with the lowest and highest in brackets), the speedup over the torch reference
(dequantize the touched experts to bf16, then matmul), and for T >= 128 the achieved TFLOP/s next to torch's
own bf16 matmul on the same per-expert GEMMs. Several layers are allocated so the working set is >= 1 GB and
>= 3x the last-level cache (300 MB on this machine's Xeon), calls cycle through the layers, and each call
routes to the next window of its layer's experts, so an expert's bytes come back only after the whole working
set has been read: every call reads its experts from DRAM while its activations, buffers and page tables stay
as warm as in a real model.

    python scripts/bench_moe.py                                   # everything (~10 min)
    python scripts/bench_moe.py --shapes qwen3 --formats fp8 --tokens 1,512
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from membw import BandwidthProbe, calls_per_block, interleaved_calls, last_level_cache_bytes  # noqa: E402
from timing import timed  # noqa: E402

from cpu_kernels.moe import fused_moe, kernel_isa_name, pack_experts  # noqa: E402
from cpu_kernels.pack import Format, quantize_fp8_blocks  # noqa: E402

SHAPES = {
    "deepseek-v3": dict(hidden=7168, inter=2048, experts=32, top_k=8),
    "qwen3-30b-a3b": dict(hidden=2048, inter=768, experts=128, top_k=8),
}
WORKING_SET = max(1 << 30, 3 * last_level_cache_bytes())
# Blocks of calls (membw.BLOCK_S seconds, or one call where a call is longer) per case, each between probes.
ROUNDS, ROUNDS_LONG = 7, 4


def source_weights(shape: dict, seed: int) -> tuple[list, list, list]:
    g = torch.Generator().manual_seed(seed)
    h, i, e = shape["hidden"], shape["inter"], shape["experts"]
    rnd = lambda *s: (torch.randn(*s, generator=g) / math.sqrt(s[-1])).to(torch.bfloat16)  # noqa: E731
    return [rnd(i, h) for _ in range(e)], [rnd(i, h) for _ in range(e)], [rnd(h, i) for _ in range(e)]


class PlainQuantized:
    """One weight in the layout a plain torch implementation keeps: codes [N, K] and block scales.
    Dequantization is a broadcast multiply to bf16, as transformers does for DeepSeek's fp8."""

    def __init__(self, w: torch.Tensor, fmt: Format):
        n, k = w.shape
        self.fmt, self.n, self.k = fmt, n, k
        wf = w.float()
        if fmt == Format.BF16:
            self.codes, self.scales, self.block = w, None, None
        elif fmt == Format.FP8:
            self.codes, self.scales = quantize_fp8_blocks(wf)
            self.block = (128, 128)
        elif fmt == Format.INT8:
            s = wf.abs().amax(dim=1, keepdim=True) / 127
            self.codes, self.scales, self.block = torch.round(wf / s).to(torch.int8), s, (1, k)
        else:
            s = wf.view(n, k // 32, 32).abs().amax(dim=2) / 7
            self.codes = torch.round(wf.view(n, k // 32, 32) / s[..., None]).clamp(-8, 7).to(torch.int8).view(n, k)
            self.scales, self.block = s, (1, 32)

    def dequantize(self) -> torch.Tensor:
        if self.scales is None:
            return self.codes
        br, bc = self.block
        s = self.scales.to(torch.bfloat16)
        w = self.codes.to(torch.bfloat16).view(self.n // br, br, self.k // bc, bc) * s.view(self.n // br, 1, -1, 1)
        return w.view(self.n, self.k)


def routing(tokens: int, shape: dict, gen: torch.Generator, call: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing within the call-th window of tokens * top_k experts (all experts for large T):
    consecutive calls to a layer use the next window, so an expert is reused only after all the others."""
    e, k = shape["experts"], shape["top_k"]
    window = min(e, tokens * k)
    experts = (call * window + torch.arange(window)) % e
    ids = torch.stack([experts[torch.randperm(window, generator=gen)[:k]] for _ in range(tokens)])
    return ids.to(torch.int32), torch.rand(tokens, k, generator=gen)


def torch_reference(plain: list[tuple[PlainQuantized, ...]], inter: int, x, ids, w) -> torch.Tensor:
    """A plain torch MoE over quantized weights: per touched expert dequantize to bf16, then matmul."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        gate, up, down = (p.dequantize() for p in plain[e])
        y = F.linear(F.silu(F.linear(x[tok], gate)) * F.linear(x[tok], up), down)
        out.index_add_(0, tok, y.float() * w[tok, slot, None])
    return out.to(torch.bfloat16)


def grouped_bf16_matmul_s(source, x, ids) -> float:
    """Time of torch's own bf16 matmuls (weights already bf16) for the same per-expert GEMMs."""
    gate, up, down = source

    def run(_):
        for e in torch.unique(ids).tolist():
            xe = x[torch.nonzero(ids == e, as_tuple=True)[0]]
            F.linear(F.linear(xe, gate[e]) * F.linear(xe, up[e]), down[e])
    run(0)
    return timed(run, 3)


def bench_case(name: str, shape: dict, fmt: Format, tokens: list[int], threads: int, probe: BandwidthProbe,
               console: Console) -> list[dict]:
    source = source_weights(shape, 0)
    first = pack_experts(*source, fmt)
    plain = [tuple(PlainQuantized(m[e], fmt) for m in source) for e in range(shape["experts"])]
    nlayers = max(1, math.ceil(WORKING_SET / first.nbytes()))
    layers = [first] + [pack_experts(*source_weights(shape, s), fmt) for s in range(1, nlayers)]
    gen = torch.Generator().manual_seed(1)
    rows = []
    for t in tokens:
        x = torch.randn(t, shape["hidden"], generator=gen).to(torch.bfloat16)
        warm = routing(t, shape, gen, call=nlayers)
        fused_moe(layers[-1], x, *warm, num_threads=threads)  # warm-up, cold by reuse
        per_block = calls_per_block(timed(lambda _: fused_moe(layers[-1], x, *warm, num_threads=threads), 1))
        rounds = ROUNDS if per_block > 1 else ROUNDS_LONG
        routes = [routing(t, shape, gen, call=r // nlayers) for r in range(rounds * per_block)]
        read = [len(torch.unique(ids)) * first.expert_bytes() for ids, _ in routes]

        def call(r: int) -> int:
            fused_moe(layers[r % nlayers], x, *routes[r], num_threads=threads)
            return read[r]

        res = interleaved_calls(probe, call, per_block, rounds)
        kernel_s = statistics.median(res.call_s)
        # The torch path reads layer 0's experts: each timed call takes the next window of them (cold where the
        # window is not all of them, as the kernel's calls are), after one warm-up call of its own.
        ref_routes = [routing(t, shape, gen, call=r) for r in range(4)]
        torch_reference(plain, shape["inter"], x, *ref_routes[3])
        ref_s = timed(lambda r: torch_reference(plain, shape["inter"], x, *ref_routes[r]), 3 if t <= 32 else 1)
        flops = 2 * t * shape["top_k"] * 3 * shape["hidden"] * shape["inter"]
        fr = res.fractions
        row = dict(shape=name, fmt=fmt.name.lower(), tokens=t, kernel_ms=kernel_s * 1e3, gbps=res.rate,
                   bw_gbps=res.bandwidth, bw_fraction=res.fraction, bw_fraction_min=min(fr), bw_fraction_max=max(fr),
                   blocks=rounds, calls_per_block=per_block, speedup_vs_torch=ref_s / kernel_s,
                   tflops=flops / kernel_s / 1e12)
        if t >= 128:
            row["torch_bf16_matmul_tflops"] = flops / grouped_bf16_matmul_s(source, x, routes[0][0]) / 1e12
        rows.append(row)
        console.print(_line(row))
    return rows


def _line(r: dict) -> str:
    extra = ""
    if "torch_bf16_matmul_tflops" in r:
        extra = f"  {r['tflops']:.3f} TFLOP/s vs torch bf16 {r['torch_bf16_matmul_tflops']:.3f}"
    return (f"{r['shape']:>14} {r['fmt']:>4} T={r['tokens']:<4} {r['kernel_ms']:8.2f} ms  {r['gbps']:6.1f} GB/s "
            f"= {r['bw_fraction']:.2f} ({r['bw_fraction_min']:.2f}-{r['bw_fraction_max']:.2f}) x {r['bw_gbps']:.1f}  "
            f"{r['speedup_vs_torch']:6.1f}x torch{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated from {list(SHAPES)}")
    ap.add_argument("--formats", default="fp8,bf16,int8,int4")
    ap.add_argument("--tokens", default="1,2,4,8,32,128,512")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", help="write all rows to this file")
    a = ap.parse_args()
    console = Console()
    torch.set_num_threads(a.threads)
    console.print(f"kernel path: {kernel_isa_name()}, {a.threads} threads, >= {WORKING_SET >> 20} MB of experts "
                  "per case")
    rows = []
    with BandwidthProbe(a.threads) as probe:
        for name in a.shapes.split(","):
            for fmt in a.formats.split(","):
                rows += bench_case(name, SHAPES[name], Format.parse(fmt), [int(t) for t in a.tokens.split(",")],
                                   a.threads, probe, console)
    table = Table(title="fused MoE (one layer): weights read vs measured bandwidth, vs torch")
    for col in ("shape", "fmt", "T", "ms", "GB/s", "of BW", "x torch", "TFLOP/s", "torch bf16 TFLOP/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["shape"], r["fmt"], str(r["tokens"]), f"{r['kernel_ms']:.2f}", f"{r['gbps']:.1f}",
                      f"{r['bw_fraction']:.2f}", f"{r['speedup_vs_torch']:.1f}", f"{r['tflops']:.3f}",
                      f"{r['torch_bf16_matmul_tflops']:.3f}" if "torch_bf16_matmul_tflops" in r else "")
    console.print(table)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
