"""Paged attention kernel (cpu_kernels.attention) against the machine's read bandwidth and the torch path.

Decode (one query per sequence) reads each sequence's K and V once: the script prints the KV bytes read per
second as a fraction of the read bandwidth that scripts/membw.c measures around it (blocks of calls between
probes, median over blocks), and the speedup over the torch path (gpu.paged_reference.paged_attention, gather +
matmul + softmax). The KV pool is >= 3x the last-level cache and every call reads the next window of blocks,
so caches do not flatter it. Prefill
(a whole prompt as one query span) is compute-bound: it prints GFLOP/s (QK^T and PV over the causal
triangle) and the speedup over the torch path.

    python scripts/bench_attention.py
    python scripts/bench_attention.py --cases qwen3-decode --contexts 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from membw import BandwidthProbe, calls_per_block, interleaved_calls, last_level_cache_bytes  # noqa: E402
from timing import timed  # noqa: E402

from cpu_kernels.attention import paged_attention  # noqa: E402
from cpu_kernels.moe import kernel_isa_name  # noqa: E402
from gpu.paged_reference import paged_attention as torch_paged_attention  # noqa: E402

BLOCK = 16
# (query heads, KV heads, K dim, V dim): Qwen3-30B-A3B GQA; DeepSeek-V3 MLA in latent space (V = K[:512]).
SHAPES = {"qwen3": (32, 4, 128, 128), "deepseek-mla": (128, 1, 576, 512)}
CASES = ["qwen3-decode", "deepseek-mla-decode", "qwen3-prefill"]
ROUNDS = 5  # blocks of decode calls per case, each between bandwidth probes


def make_pool(shape: tuple, tokens: int, gen: torch.Generator, latent: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches of `tokens` tokens; latent (MLA): V is the first columns of K, as in the engine."""
    _, hkv, d, dv = shape
    blocks = -(-tokens // BLOCK)
    k = torch.randn(blocks, BLOCK, hkv, d, generator=gen).to(torch.bfloat16)
    v = k[..., :dv] if latent else torch.randn(blocks, BLOCK, hkv, dv, generator=gen).to(torch.bfloat16)
    return k, v


def decode_case(name: str, shape: tuple, ctx: int, batch: int, threads: int, probe: BandwidthProbe) -> dict:
    hq, hkv, d, dv = shape
    latent = name.startswith("deepseek")
    per_seq = -(-ctx // BLOCK)
    kv_bytes = batch * ctx * hkv * (d if latent else d + dv) * 2
    windows = max(2, -(-3 * last_level_cache_bytes() // kv_bytes))
    gen = torch.Generator().manual_seed(0)
    k, v = make_pool(shape, windows * batch * per_seq * BLOCK, gen, latent)
    # Scattered blocks, as a serving pool's are: in-order tables would let the prefetcher stream straight through.
    tables = torch.randperm(windows * batch * per_seq, generator=gen).to(torch.int32).view(windows, batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=gen).to(torch.bfloat16)
    scale = d ** -0.5
    paged_attention(q, k, v, tables[-1], lens, scale, num_threads=threads)
    per_block = calls_per_block(timed(lambda _: paged_attention(q, k, v, tables[-1], lens, scale,
                                                                num_threads=threads), 1))

    def call(r: int) -> int:
        paged_attention(q, k, v, tables[r % windows], lens, scale, num_threads=threads)
        return kv_bytes

    res = interleaved_calls(probe, call, per_block, ROUNDS)
    kernel_s = statistics.median(res.call_s)
    torch_s = timed(lambda r: torch_paged_attention(q, k, v, list(range(batch)), [1] * batch, [ctx] * batch,
                                                    list(tables[r % windows]), scale), 3)
    return dict(case=name, context=ctx, batch=batch, kernel_ms=kernel_s * 1e3, kv_gbps=res.rate, bw_gbps=res.bandwidth,
                bw_fraction=res.fraction, speedup_vs_torch=torch_s / kernel_s)


def prefill_case(shape: tuple, ctx: int, threads: int) -> dict:
    hq, hkv, d, dv = shape
    gen = torch.Generator().manual_seed(1)
    k, v = make_pool(shape, ctx, gen, False)
    tables = torch.randperm(-(-ctx // BLOCK), generator=gen).to(torch.int32)[None]
    q = torch.randn(ctx, hq, d, generator=gen).to(torch.bfloat16)
    lens, qlens = torch.tensor([ctx], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32)
    kernel = lambda _: paged_attention(q, k, v, tables, lens, d ** -0.5, qlens, num_threads=threads)  # noqa: E731
    baseline = lambda _: torch_paged_attention(q, k, v, [0], [ctx], [ctx], [tables[0]], d ** -0.5)  # noqa: E731
    kernel(0), baseline(0)  # both warm, both the median of 3
    kernel_s, torch_s = timed(kernel, 3), timed(baseline, 3)
    flops = 2 * hq * (d + dv) * ctx * (ctx + 1) / 2
    return dict(case="qwen3-prefill", context=ctx, batch=1, kernel_ms=kernel_s * 1e3, gflops=flops / kernel_s / 1e9,
                speedup_vs_torch=torch_s / kernel_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated from {CASES}")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = ap.parse_args()
    console = Console()
    torch.set_num_threads(a.threads)
    contexts = [int(c) for c in a.contexts.split(",")]
    console.print(f"kernel path: {kernel_isa_name()}, {a.threads} threads")
    rows = []
    probe = BandwidthProbe(a.threads)
    for case in a.cases.split(","):
        if case == "qwen3-prefill":
            for ctx in (c for c in contexts if c <= 8192):
                rows.append(prefill_case(SHAPES["qwen3"], ctx, a.threads))
                console.print(rows[-1])
            continue
        name = case.removesuffix("-decode")
        for ctx in contexts:
            for batch in (int(b) for b in a.batches.split(",")):
                if name == "deepseek-mla" and batch * ctx > 8 * 4096:
                    continue
                rows.append(decode_case(case, SHAPES[name], ctx, batch, a.threads, probe))
                console.print(rows[-1])
    probe.close()
    t = Table(title="paged attention: decode KV GB/s vs measured read bandwidth; prefill GFLOP/s; vs torch path")
    for col in ("case", "context", "batch", "ms", "KV GB/s", "of BW", "GFLOP/s", "x torch"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["case"], str(r["context"]), str(r["batch"]), f"{r['kernel_ms']:.2f}",
                  f"{r['kv_gbps']:.1f}" if "kv_gbps" in r else "",
                  f"{r['bw_fraction']:.2f}" if "bw_fraction" in r else "",
                  f"{r['gflops']:.0f}" if "gflops" in r else "", f"{r['speedup_vs_torch']:.1f}")
    console.print(t)


if __name__ == "__main__":
    main()
