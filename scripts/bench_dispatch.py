"""Cost of running the routed experts in the expert process instead of in the engine.

Prints the round trip of a per-layer call through the shared-memory slots and doorbells with no
compute (the server echoes the hidden states) for a tiny payload (the tiny model: H=64, k=4)
and a real decode payload (H=7168, k=8, one token), and that echo as a fraction of the same call with its
MoE compute; then end-to-end decode tok/s of the real-shaped benchmark model with inline experts vs the expert
process, in the same run.

    python scripts/bench_dispatch.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from make_tiny_model import make_model  # noqa: E402

from hybrid import LLM, SamplingParams  # noqa: E402
from hybrid.config import ModelConfig  # noqa: E402
from hybrid.experts.pack import write_pack  # noqa: E402
from hybrid.experts.process.client import ExpertClient, ExpertServerProcess  # noqa: E402
from hybrid.experts.process.slots import ECHO_LAYER  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def round_trips(model_dir: Path, calls: int, compute: bool) -> list[float]:
    config = ModelConfig.from_dir(model_dir)
    with tempfile.TemporaryDirectory() as pack:
        write_pack(model_dir, pack)
        proc = ExpertServerProcess.spawn(model_dir, pack, threads=1)
        client = ExpertClient(proc.control, max_tokens=1, max_topk=config.num_experts_per_tok, process=proc)
        try:
            k = config.num_experts_per_tok
            x = torch.randn(1, config.hidden_size).to(torch.bfloat16)
            ids = torch.randperm(config.num_experts)[:k].view(1, k)
            w = torch.rand(1, k)
            layer = config.moe_layers[0] if compute else ECHO_LAYER
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                client.submit(layer, x, ids, w).wait()
                times.append(time.perf_counter() - t)
            return times[calls // 10:]
        finally:
            client.close()
            proc.stop()


def decode_tok_s(model_dir: Path, tokens: int, **kwargs) -> float:
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=1, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(list(range(100, 116)), SamplingParams(temperature=0, max_tokens=4))
        return statistics.median(1 / llm.generate(list(range(100 + r, 132 + r)), params)[0].tpot_s for r in range(3))
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--pairs", type=int, default=4, help="alternating inline/process decode runs")
    ap.add_argument("--json")
    a = ap.parse_args()
    console = Console()
    models = ROOT / "bench_models"
    tiny = make_model(models / "tiny-qwen3-moe", "tiny-qwen3-moe") if not (models / "tiny-qwen3-moe").exists() \
        else models / "tiny-qwen3-moe"
    wide = make_model(models / "dispatch-7168", "dispatch-7168") if not (models / "dispatch-7168").exists() \
        else models / "dispatch-7168"
    rows = {}
    for name, model, compute in (("tiny payload (H=64, k=4), echo", tiny, False),
                                 ("decode payload (H=7168, k=8, T=1), echo", wide, False),
                                 ("decode payload (H=7168, k=8, T=1), with MoE compute", wide, True)):
        t = round_trips(model, a.calls, compute)
        rows[name] = {"median_us": statistics.median(t) * 1e6, "p99_us": sorted(t)[int(len(t) * 0.99)] * 1e6}
    table = Table(title="expert process round trip per layer call")
    for col in ("call", "median us", "p99 us"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, f"{r['median_us']:.1f}", f"{r['p99_us']:.1f}")
    console.print(table)
    echo, compute = (rows[f"decode payload (H=7168, k=8, T=1), {kind}"]["median_us"]
                     for kind in ("echo", "with MoE compute"))
    rows["echo_over_compute"] = echo / compute
    console.print(f"[bold]dispatch / MoE call: {echo / compute:.3f}[/bold] (echo round trip over the same call with "
                  "its compute, medians: the share of a decode layer's expert call the process boundary costs)")
    if not a.skip_e2e:
        bench = models / "qwen3-30b-a3b-L4"
        if not (bench / "config.json").exists():
            make_model(bench, "qwen3-30b-a3b", layers=4)
        pack = models / "qwen3-30b-a3b-L4-pack-bf16"
        write_pack(bench, pack, "bf16")
        # Alternating inline/process pairs: the machine's bandwidth drifts between runs, so one pair says little.
        pairs = []
        for _ in range(a.pairs):
            inline = decode_tok_s(bench, a.decode_tokens, expert_pack=str(pack))
            process = decode_tok_s(bench, a.decode_tokens, experts="process", expert_pack=str(pack))
            pairs.append((inline, process))
        ratios = [p / i for i, p in pairs]
        rows["e2e"] = {"pairs_tok_s": pairs, "process_over_inline": ratios,
                       "median_process_over_inline": statistics.median(ratios)}
        console.print(f"decode {bench.name}, inline/process tok/s pairs: "
                      + ", ".join(f"{i:.1f}/{p:.1f}" for i, p in pairs)
                      + f" -> process/inline median {statistics.median(ratios):.3f} "
                        f"(each: {', '.join(f'{r:.2f}' for r in ratios)})")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
