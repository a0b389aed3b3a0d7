"""Tensor parallelism on one machine: what the collectives cost, what share of a decode step they take, decode with
--tp 1 vs --tp 2, and whether a rank should hold a slice of every expert or whole experts.

1. all-reduce latency vs message size, the shared-memory collective vs gloo's, two ranks on a core each
   (torchrun); the last column is gloo's time over shm's.
2. decode tokens/s with --tp 1 (one engine over every core) and --tp 2 (a rank per core group, HYBRIDD_NUMA_NODES
   or the machine's NUMA nodes), each in a fresh process, alternating, with a memory-bandwidth probe around every
   run; and the share of the driver's decode step spent in collectives (all-reduce plus the step broadcast,
   waiting for the other rank included; inside a replayed decode program the all-reduce calls are timed in C++).
   Steps replay each rank's decode programs unless --enforce-eager.
3. expert placement for a rank of two: a slice of every expert (half of each expert's intermediate features:
   every rank streams half of every routed expert) vs whole experts (even ids on rank 0, odd on rank 1: the step
   waits for the rank that drew more of the token's experts), timed through the kernel on one core per rank
   over the same random routing; the ratio is whole over slice.

    python scripts/bench_tp.py
    python scripts/bench_tp.py --model bench_models/qwen3-30b-a3b-L4 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import make_model  # noqa: E402
from membw import BandwidthProbe  # noqa: E402

from cpu_kernels.moe import kernel_isa_name  # noqa: E402

SIZES = [(1, 2048), (1, 7168), (8, 7168), (64, 7168), (512, 7168)]


def collectives_worker(out: str, reps: int) -> None:
    import torch.distributed as dist

    from cpu_kernels.thread_pool import restrict_cpus
    from hybrid.distributed.communicator import GlooCommunicator
    from hybrid.distributed.placement import rank_cpus
    from hybrid.distributed.shm_communicator import ShmCommunicator

    restrict_cpus(rank_cpus(int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("gloo")
    ranks = list(range(dist.get_world_size()))
    comms = [ShmCommunicator(None, ranks), GlooCommunicator(None, ranks)]
    rows = []
    for shape in SIZES:
        x = torch.randn(shape, dtype=torch.bfloat16)
        row = {"shape": shape, "bytes": x.numel() * 2}
        for comm in comms:
            for _ in range(5):
                comm.all_reduce(x.clone())
            times = []
            for _ in range(reps):
                y = x.clone()
                dist.barrier()
                t = time.perf_counter()
                comm.all_reduce(y)
                times.append(time.perf_counter() - t)
            row[comm.name] = statistics.median(times)
        rows.append(row)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def decode_worker(model: str, tp: int, tokens: int, batch: int, eager: bool, out: str) -> None:
    from cpu_kernels.program import Program
    from hybrid import LLM, SamplingParams
    from hybrid.distributed.shm_communicator import ShmCommunicator

    spent = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapper

    def replay_timed(self):
        """A decode program's replay, its all-reduce calls timed in C++ (no Python calls them there)."""
        outputs, by_kernel = self.run_timed()
        spent[0] += by_kernel.get("all_reduce", 0.0)
        return outputs

    ShmCommunicator.all_reduce = timed(ShmCommunicator.all_reduce)  # eager steps
    ShmCommunicator.broadcast = timed(ShmCommunicator.broadcast)
    Program.run = replay_timed
    llm = LLM(model, dtype="bfloat16", tp=tp, max_num_seqs=max(batch, 1), enforce_eager=eager)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 2000, (16,), generator=g).tolist() for _ in range(batch)]
    params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    llm.generate(prompts, params(4))
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, params(tokens + 1))
    engine.step()  # the prefill and first token
    spent[0], steps = 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        steps += 1
    wall = time.perf_counter() - start
    llm.close()
    programs = engine.runner.graphs
    Path(out).write_text(json.dumps({"tok_s": batch * steps / wall, "step_s": wall / steps,
                                     "comm_share": spent[0] / wall,
                                     "programs": programs is not None and programs.num_captured > 0}))


def run_decode(model: str, tp: int, tokens: int, batch: int, eager: bool) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, __file__, "--worker", "decode", "--model", model, "--tp", str(tp),
                        "--tokens", str(tokens), "--batch", str(batch), "--out", f.name]
                       + (["--enforce-eager"] if eager else []), check=True)
        return json.loads(Path(f.name).read_text())


def placement(model: str, samples: int) -> dict:
    """Per decode token on one core: the kernel time of rank 0's slice of every chosen expert vs, with whole
    experts, the slower rank's share of the chosen experts."""
    from cpu_kernels.moe import fused_moe
    from hybrid.checkpoint.reader import CheckpointReader
    from hybrid.config import ModelConfig
    from hybrid.experts.kernel_experts import pack_layer

    cfg = ModelConfig.from_dir(model)
    reader = CheckpointReader(cfg.model_dir, cfg.fp8_block)
    layer = cfg.moe_layers[0]
    whole = pack_layer(reader, cfg, layer, "bf16")
    half = cfg.moe_intermediate_size // 2
    sliced = pack_layer(reader, cfg, layer, "bf16", range(0, half))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, cfg.hidden_size, dtype=torch.bfloat16)
    w = torch.full((1, cfg.num_experts_per_tok), 1.0 / cfg.num_experts_per_tok)

    def once(p, ids) -> float:
        t = time.perf_counter()
        fused_moe(p, x, ids, w, num_threads=1)
        return time.perf_counter() - t

    # Each call reads its experts once, as decode does: a repeat of the same ids would find them in the cache
    # (a layer's experts are far larger than it, and every sample draws new ids). The first sample only warms up.
    slice_s, whole_s, imbalance = [], [], []
    for sample in range(samples + 1):
        ids = torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok].view(1, -1)
        sliced_s = once(sliced, ids)
        per_rank = [torch.where(ids % 2 == r, ids, torch.full_like(ids, -1)) for r in range(2)]
        slowest_s = max(once(whole, r_ids) for r_ids in per_rank)
        if sample == 0:
            continue
        slice_s.append(sliced_s)
        whole_s.append(slowest_s)
        counts = [int((r_ids >= 0).sum()) for r_ids in per_rank]
        imbalance.append(max(counts) / (cfg.num_experts_per_tok / 2))
    return {"slice_us": statistics.median(slice_s) * 1e6, "whole_us": statistics.median(whole_s) * 1e6,
            "imbalance": statistics.mean(imbalance)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint (default: the qwen3-30b-a3b preset, 2 layers, under bench_models/)")
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per run")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="alternating --tp 1 / --tp 2 runs")
    ap.add_argument("--reps", type=int, default=200, help="all-reduces per size")
    ap.add_argument("--enforce-eager", action="store_true", help="decode eagerly (no kernel programs on any rank)")
    ap.add_argument("--worker", choices=["collectives", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker == "collectives":
        return collectives_worker(a.out, a.reps)
    if a.worker == "decode":
        return decode_worker(a.model, a.tp, a.tokens, a.batch, a.enforce_eager, a.out)

    model = a.model or str(ROOT / "bench_models" / "qwen3-30b-a3b-L2")
    if not Path(model, "config.json").exists():
        make_model(model, "qwen3-30b-a3b", layers=2)
    from cpu_kernels.thread_pool import numa_nodes

    if len(numa_nodes()) == 1:  # one node: two ranks split its cores (one "node" per core)
        os.environ.setdefault("HYBRIDD_NUMA_NODES", ";".join(map(str, sorted(os.sched_getaffinity(0)))))
    console = Console()
    console.print(f"kernel path {kernel_isa_name()}, {os.cpu_count()} cores, HYBRIDD_NUMA_NODES="
                  f"{os.environ.get('HYBRIDD_NUMA_NODES')!r}, model {model}")

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        __file__, "--worker", "collectives", "--out", f.name, "--reps", str(a.reps)], check=True,
                       stderr=subprocess.DEVNULL)
        rows = json.loads(Path(f.name).read_text())
    t = Table(title="all-reduce, 2 ranks, bf16 (median)")
    for col in ("rows x hidden", "bytes", "shm us", "gloo us", "gloo / shm"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(f"{r['shape'][0]} x {r['shape'][1]}", f"{r['bytes']:,}", f"{r['shm'] * 1e6:.1f}",
                  f"{r['gloo'] * 1e6:.1f}", f"{r['gloo'] / r['shm']:.1f}x")
    console.print(t)

    runs: dict[int, list[dict]] = {1: [], 2: []}
    with BandwidthProbe(threads=len(os.sched_getaffinity(0))) as probe:
        for _ in range(a.rounds):
            for tp in (1, 2):
                before = probe.gbps()
                r = run_decode(model, tp, a.tokens, a.batch, a.enforce_eager)
                r["gbps"] = (before + probe.gbps()) / 2
                runs[tp].append(r)
    steps = "eager steps" if a.enforce_eager else "decode programs"
    t = Table(title=f"decode, batch {a.batch}, {a.tokens} tokens, bf16, {steps} (median of {a.rounds} runs)")
    for col in ("--tp", "tokens/s", "step ms", "collectives share", "bandwidth GB/s", "vs --tp 1", "replayed"):
        t.add_column(col, justify="right")
    base = statistics.median(r["tok_s"] for r in runs[1])
    for tp, rs in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in rs)
        t.add_row(str(tp), f"{tok_s:.2f}", f"{statistics.median(r['step_s'] for r in rs) * 1e3:.1f}",
                  f"{statistics.median(r['comm_share'] for r in rs):.1%}" if tp > 1 else "-",
                  f"{statistics.median(r['gbps'] for r in rs):.1f}", f"{tok_s / base:.2f}x",
                  "yes" if all(r["programs"] for r in rs) else "no")
    console.print(t)

    p = placement(model, samples=40)
    t = Table(title="expert placement, 2 ranks, one decode token through one MoE layer, one core per rank")
    for col in ("slice of every expert us", "whole experts (slower rank) us", "mean max/even share", "whole / slice"):
        t.add_column(col, justify="right")
    t.add_row(f"{p['slice_us']:.0f}", f"{p['whole_us']:.0f}", f"{p['imbalance']:.2f}",
              f"{p['whole_us'] / p['slice_us']:.2f}x")
    console.print(t)


if __name__ == "__main__":
    main()
