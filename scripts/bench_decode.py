"""CPU-only prefill and decode speed of the engine on a real-shaped (truncated) MoE model.

Prefill is reported against the planner's time for the prompt from probes of the same kernels alone (their dense,
attention and expert rates, in the engine's chunks: what the engine would reach with no cost between kernels).
Decode is reported as a fraction of the memory-bandwidth roofline: tokens/s <= read bandwidth /
bytes touched per token, with the bandwidth measured by scripts/membw.c around every run (the median over
runs of each run's fraction of the mean of the probes either side: the machine's bandwidth drifts).

    python scripts/bench_decode.py                          # Qwen3-30B-A3B shapes, 4 layers, bf16
    python scripts/bench_decode.py --preset moonlight --layers 3
    python scripts/bench_decode.py --model /path/to/checkpoint
    python scripts/bench_decode.py --prompt-len 4096 --attention torch   # long context, torch attention
    python scripts/bench_decode.py --breakdown              # and where a decode step's time goes
    python scripts/bench_decode.py --compare eager,program  # decode programs against eager steps, paired
    python scripts/bench_decode.py --compare eager,program --batch 16   # the same, 16 sequences per step
    python scripts/bench_decode.py --preset moonlight --layers 3 --compare mla-torch,eager

CPU-only decode replays recorded kernel programs (hybrid/graphs/cpu_decode_programs.py) unless --enforce-eager.
--compare runs rounds of one engine switching between modes (eager steps, program replays, or eager steps with
MLA's absorbed projections in torch's einsums instead of the kernels) and reports each mode's median decode step
and the paired ratio against the first mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from make_tiny_model import make_model  # noqa: E402
from membw import BandwidthProbe, interleaved  # noqa: E402
from step_breakdown import breakdown, decode_steps, program_breakdown  # noqa: E402

from cpu_kernels.moe import kernel_isa_name  # noqa: E402
from hybrid import LLM, SamplingParams  # noqa: E402
from hybrid.config import ModelConfig  # noqa: E402
from hybrid.experts.kernel_experts import KernelExperts  # noqa: E402
from hybrid.experts.pack import EXPERTS_FILE, engine_pack  # noqa: E402
from hybrid.experts.process.process_experts import ProcessExperts  # noqa: E402
from hybrid.model_loader.dense_pack import decode_dense_bytes  # noqa: E402
from hybrid.planner.plan import measure  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def bytes_per_decode_token(llm: LLM, context: int) -> dict[str, int]:
    """Bytes one batch-1 decode step reads: dense weights (packed where the kernels hold them), one
    embedding row, top-k experts per MoE layer in their stored format, and the KV cache of `context` tokens."""
    cfg: ModelConfig = llm.engine.model_config
    runner = llm.engine.runner
    embed = runner.model.model.embed_tokens.weight
    dense = decode_dense_bytes(runner.model)
    if isinstance(runner.experts, KernelExperts):
        expert = next(iter(runner.experts.layers.values())).expert_bytes()
    elif isinstance(runner.experts, ProcessExperts):  # the pack the expert process maps
        _, pack = engine_pack(cfg, llm.engine.config.expert_format, llm.engine.config.expert_pack)
        expert = (pack / EXPERTS_FILE).stat().st_size // (len(cfg.moe_layers) * cfg.num_experts)
    else:
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * runner.dtype.itemsize
    routed = len(cfg.moe_layers) * cfg.num_experts_per_tok * expert
    kv = context * sum(c[0].numel() // c[0].shape[0] // c[0].shape[1] * c[0].element_size() * len(c)
                       for c in runner.kv_pool.caches)
    return {"dense": dense + cfg.hidden_size * embed.element_size(), "routed": routed, "kv": kv}


def set_mode(engine, mode: str, programs, absorbed: dict) -> None:
    """eager: steps run eagerly; program: replays; mla-torch: eager with MLA's kv_b absorption in torch."""
    engine.runner.graphs = programs if mode == "program" else None
    for module, packed in absorbed.items():
        module.absorbed = None if mode == "mla-torch" else packed


def compare(llm: LLM, programs, a, vocab: int, gen: torch.Generator, make_params, console: Console) -> dict:
    """Rounds of one engine cycling through the --compare modes (a request of --decode-tokens steps each): the
    median step of each and the median of each round's ratio against the first mode's step."""
    engine = llm.engine
    modes = a.compare.split(",")
    absorbed = {m: m.absorbed for m in engine.runner.model.modules() if getattr(m, "absorbed", None) is not None}
    if "program" in modes and programs is None:
        raise SystemExit("--compare program needs decode programs (CPU-only, no --enforce-eager)")
    if "mla-torch" in modes and not absorbed:
        raise SystemExit("--compare mla-torch needs an MLA model whose kv_b the kernels hold (bf16 runs)")
    layers = len(engine.runner.model.model.layers)
    prompt = torch.randint(10, vocab, (a.prompt_len,), generator=gen).tolist()
    steps: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(a.pairs):
        for mode in modes:
            set_mode(engine, mode, programs, absorbed)
            steps[mode].append(decode_steps(engine, prompt, a.decode_tokens, make_params(a.decode_tokens + 2),
                                            batch=a.batch))
    set_mode(engine, "program", programs, absorbed)
    base = modes[0]
    t = Table(title=f"decode step of {a.batch} sequence(s) by mode, {a.pairs} rounds, {layers} layers "
                    f"({a.threads} threads)")
    for col in ("mode", "median step", f"{base} / mode (median of rounds)", "rounds faster than " + base):
        t.add_column(col, justify="left" if col == "mode" else "right")
    res = {}
    for mode in modes:
        ratios = [b / m for b, m in zip(steps[base], steps[mode])]
        faster = sum(r > 1 for r in ratios)
        res[mode] = {"step_s": statistics.median(steps[mode]), "ratio": statistics.median(ratios),
                     "rounds_faster": faster}
        t.add_row(mode, f"{res[mode]['step_s'] * 1e3:.3f} ms", f"{res[mode]['ratio']:.3f}x",
                  "" if mode == base else f"{faster}/{a.pairs}")
    console.print(t)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: generate --preset under bench_models/)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fp8", action="store_true", help="generate the checkpoint with fp8 block weights")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "torch"], help="C++ kernels or torch reference")
    ap.add_argument("--expert-format", default="auto", help="auto (checkpoint's), bf16, fp8, int8, int4")
    ap.add_argument("--dense-format", default="auto", help="auto (checkpoint's), bf16, fp8, int8")
    ap.add_argument("--attention", default="auto", choices=["auto", "cpu", "torch"],
                    help="decode attention: C++ kernel (cpu, the cpu backend's default) or torch")
    ap.add_argument("--experts", default="inline", choices=["inline", "process"],
                    help="routed experts in the engine or in the expert process (hybridd start's default)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--breakdown", action="store_true", help="also split a decode step into kernels, torch ops "
                    "and Python")
    ap.add_argument("--enforce-eager", action="store_true", help="decode eagerly (no kernel programs)")
    ap.add_argument("--compare", metavar="MODES", help="also time rounds switching between modes (comma list of "
                    "eager, program, mla-torch; ratios against the first)")
    ap.add_argument("--pairs", type=int, default=8, help="rounds of --compare")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together in --compare's steps")
    ap.add_argument("--json", help="also write the results to this file")
    a = ap.parse_args()
    console = Console()
    if a.backend == "torch":
        torch.set_num_threads(a.threads)

    model_dir = Path(a.model) if a.model else ROOT / "bench_models" / f"{a.preset}-L{a.layers}{'-fp8' if a.fp8 else ''}"
    if not (model_dir / "config.json").exists():
        console.print(f"writing {a.preset} ({a.layers} layers) to {model_dir} ...")
        make_model(model_dir, a.preset, layers=a.layers, fp8=a.fp8 or None)

    probe = BandwidthProbe(a.threads)
    t0 = time.perf_counter()
    llm = LLM(model_dir, dtype=a.dtype, max_num_batched_tokens=max(512, a.prompt_len),
              max_model_len=a.prompt_len + a.decode_tokens + 8, max_num_seqs=a.batch, backend=a.backend,
              expert_format=a.expert_format, dense_format=a.dense_format, num_threads=a.threads,
              attention=a.attention,
              enforce_eager=a.enforce_eager, experts=a.experts)
    load_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=a.decode_tokens, ignore_eos=True)
    llm.generate(torch.randint(10, vocab, (32,), generator=gen).tolist(), SamplingParams(max_tokens=4))
    touched = bytes_per_decode_token(llm, a.prompt_len + a.decode_tokens // 2)
    total = sum(touched.values())
    prefill = []

    def run(_: int) -> float:
        """One request; returns the bytes per second its decode steps read."""
        out = llm.generate(torch.randint(10, vocab, (a.prompt_len,), generator=gen).tolist(), params)[0]
        prefill.append(a.prompt_len / out.ttft_s)
        return total / out.tpot_s / 1e9

    runs = interleaved(probe, run, a.runs)
    probe.close()
    # Prefill's bound: the planner's time for the prompt from its probes of the same kernels alone (dense and
    # attention FLOP/s, experts' prefill rate, per-step overhead), in the engine's chunks.
    plan = measure(model_dir, expert_format=a.expert_format, chunk_tokens=max(512, a.prompt_len),
                   dense_format=a.dense_format) \
        if a.backend == "cpu" else None
    planned_tok_s = a.prompt_len / plan.ttft(a.prompt_len)["cpu"] if plan else None
    decode = [r * 1e9 / total for r in runs.rates]
    roofline = runs.bandwidth * 1e9 / total
    res = {
        "model": str(model_dir), "dtype": a.dtype, "threads": a.threads, "backend": a.backend,
        "kernel_path": kernel_isa_name() if a.backend == "cpu" else "torch",
        "experts": type(llm.engine.runner.experts).__name__, "load_s": load_s,
        "attention": llm.engine.config.attention,
        "prefill_tok_s": statistics.median(prefill), "prefill_planned_tok_s": planned_tok_s,
        "decode_tok_s": statistics.median(decode),
        "bytes_per_token": total, "routed_bytes_per_token": touched["routed"],
        "read_gbps_probes": runs.probes, "roofline_tok_s": roofline,
        "decode_fraction_of_roofline": runs.fraction,
        "effective_gbps": runs.rate,
    }
    t = Table(title=f"bench_decode: {model_dir.name}, {a.dtype}, {a.threads} threads, {res['kernel_path']}, "
                    f"experts={res['experts']}, attention={res['attention']}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row(f"prefill pp{a.prompt_len} tok/s (median of {a.runs})", f"{res['prefill_tok_s']:.1f}")
    if planned_tok_s:
        t.add_row("prefill tok/s at the kernels' probed rates (planner)", f"{planned_tok_s:.1f}")
        t.add_row("[bold]prefill / probed rates", f"[bold]{res['prefill_tok_s'] / planned_tok_s:.3f}")
    t.add_row(f"decode tok/s (batch 1, {a.decode_tokens} tokens)", f"{res['decode_tok_s']:.2f}")
    t.add_row("bytes touched per decode token", f"{total / 1e6:.1f} MB (routed {touched['routed'] / 1e6:.1f} MB, "
                                                f"KV {touched['kv'] / 1e6:.1f} MB)")
    t.add_row("read bandwidth around the runs", " / ".join(f"{b:.1f}" for b in runs.probes) + " GB/s")
    t.add_row("roofline decode tok/s", f"{roofline:.1f}")
    t.add_row("effective GB/s in decode", f"{res['effective_gbps']:.1f}")
    t.add_row("[bold]decode / roofline", f"[bold]{res['decode_fraction_of_roofline']:.3f}")
    console.print(t)
    make_params = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    programs = llm.engine.runner.graphs
    if a.breakdown:
        prompt = torch.randint(10, vocab, (a.prompt_len,), generator=gen).tolist()
        splits = {"eager": breakdown(llm.engine, prompt, a.decode_tokens, make_params)}
        if programs is not None:
            splits["program"] = program_breakdown(llm.engine, prompt, a.decode_tokens, make_params)
        res["breakdown_s"] = splits
        for mode, split in splits.items():
            split = dict(split)
            step = split.pop("step")
            t = Table(title=f"one {mode} decode step ({step * 1e3:.2f} ms), {a.threads} threads")
            for col in ("part", "ms", "share"):
                t.add_column(col, justify="right" if col != "part" else "left")
            for part, s in split.items():
                t.add_row(part, f"{s * 1e3:.3f}", f"{s / step:.1%}")
            console.print(t)
    if a.compare:
        res["compare"] = compare(llm, programs, a, vocab, gen, make_params, console)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
