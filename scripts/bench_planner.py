"""The planner against the engine: what `hybridd doctor` predicts (hybrid/planner/) for a real-shaped (truncated)
model, then what the engine measures on the same model in the same run: TTFT of prompts of several lengths (one
at a time) and decode TPOT at concurrency 1 and 8; printed as measured / predicted. The read bandwidth is probed
(scripts/membw.c) before and after: the planner's own probe runs at one moment, and this machine's bandwidth moves.

    python scripts/bench_planner.py                                   # Qwen3-30B-A3B shapes, 4 layers, bf16
    python scripts/bench_planner.py --model DIR --prompts 512,4096
    python scripts/bench_planner.py --model DIR --gpus 0              # on a GPU machine
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from make_tiny_model import make_model  # noqa: E402
from membw import BandwidthProbe  # noqa: E402

from cpu_kernels.moe import kernel_isa_name  # noqa: E402
from hybrid import LLM, SamplingParams  # noqa: E402
from hybrid.planner.plan import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (n,), generator=g).tolist()


def ttft(llm: LLM, tokens: int, seed: int) -> float:
    """Seconds to the first token of a fresh prompt (its own seed: nothing comes from the prefix cache)."""
    vocab = llm.engine.model_config.vocab_size
    start = time.perf_counter()
    llm.generate([ids(tokens, seed, vocab)], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return time.perf_counter() - start


def tpot(llm: LLM, concurrency: int, context: int, steps: int, seed: int) -> float:
    """Seconds per decode step of `concurrency` sequences, after their prefills, over `steps` steps."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(ids(context, seed + i, vocab), params)
    while any(not s.num_completion_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: qwen3-30b-a3b, 4 layers, in bench_models/)")
    ap.add_argument("--prompts", default="512,2048", help="prompt lengths for TTFT")
    ap.add_argument("--context", type=int, default=512, help="prompt length of the decoding sequences")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per concurrency")
    ap.add_argument("--gpus", help="as for hybridd start")
    ap.add_argument("--attn-device")
    a = ap.parse_args()
    model = Path(a.model) if a.model else ROOT / "bench_models" / "qwen3-30b-a3b-L4"
    if not model.exists():
        make_model(model, "qwen3-30b-a3b", layers=4)
    gpus = [int(g) for g in a.gpus.split(",")] if a.gpus else None
    prompts = [int(p) for p in a.prompts.split(",")]
    console = Console()
    console.print(f"CPU kernel path {kernel_isa_name()}; model {model.name}")
    with BandwidthProbe(torch.get_num_threads()) as probe:
        before = probe.gbps()
        plan = measure(model, gpus, a.attn_device)
        kw = {"gpus": gpus, "attn_device": a.attn_device} if gpus else {}
        llm = LLM(model, dtype="bfloat16", **kw)
        rows = []
        try:
            for i, n in enumerate(prompts):
                measured = min(ttft(llm, n, 1000 * i + r) for r in range(2))
                rows.append((f"TTFT, {n}-token prompt", plan.ttft(n)["picked"], measured))
            for c in (1, 8):
                measured = tpot(llm, c, a.context, a.steps, 50_000 + 100 * c)
                rows.append((f"TPOT, concurrency {c}, context ~{a.context}",
                             plan.tpot(c, a.context + a.steps // 2), measured))
        finally:
            llm.close()
        after = probe.gbps()
    table = Table(title=f"planner vs engine ({model.name}); membw read bandwidth {before:.1f} GB/s before, "
                        f"{after:.1f} after; planner's probe {plan.cpu.read_bytes_per_s / 1e9:.1f}")
    for col in ("what", "predicted", "measured", "measured / predicted"):
        table.add_column(col, justify="right")
    for what, pred, got in rows:
        table.add_row(what, f"{pred * 1e3:.1f} ms", f"{got * 1e3:.1f} ms", f"{got / pred:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
