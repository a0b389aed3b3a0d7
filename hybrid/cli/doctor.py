"""`hybridd doctor`: what this machine offers (CPU features and kernel path, NUMA, GPUs, memory), whether a
model fits in RAM, what to change when something is off, and the planner's predicted TTFT / TPOT for the model on
this machine (hybrid/planner/), from short probes, before the model is loaded."""

from __future__ import annotations

import argparse
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from hybrid.config.engine_config import DENSE_FORMATS, EXPERT_FORMATS

BITS_PER_WEIGHT = {"bf16": 16.0, "fp8": 8.0 + 32 / (128 * 128), "int8": 8.0, "int4": 4.0 + 32 / 32}
KEY_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx512vbmi", "amx_bf16", "amx_int8")


@dataclass
class Finding:
    topic: str
    detail: str
    ok: bool = True


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    def add(self, topic: str, detail: str, ok: bool = True) -> None:
        self.findings.append(Finding(topic, detail, ok))


def check_cpu(d: Diagnosis) -> None:
    from cpu_kernels.cpu_features import best_path, cpu_flags
    from cpu_kernels.thread_pool import ALLOWED_CPUS, numa_nodes

    flags = cpu_flags()
    d.add("CPU", f"{len(ALLOWED_CPUS)} usable cores, {len(numa_nodes())} NUMA node(s); "
                 + ", ".join(f for f in KEY_FLAGS if f in flags))
    try:
        from cpu_kernels.moe import kernel_isa_name

        path = kernel_isa_name()
        d.add("kernel path", f"{path} (best this CPU allows: {best_path()})", path != "generic")
        if path == "generic":
            d.advice.append("no AVX-512 path: the portable kernels run, several times slower than on an AVX-512 CPU")
    except ImportError as e:
        d.add("kernel path", f"the C++ extension is not built ({e})", False)
        d.advice.append("build the kernels: pip install -e . (needs g++ and pybind11)")


def check_gpus(d: Diagnosis) -> None:
    import torch

    if not torch.cuda.is_available():
        d.add("GPUs", "none usable (torch.cuda.is_available() is False); run with --cpu-only")
        return
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        d.add(f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.1f} GiB")
    d.advice.append("serve with the GPU: hybridd start --gpus 0 (attention and dense layers on GPU 0, routed experts "
                    "on the CPU, long prefills streaming their experts to the GPU)")


def check_memory(d: Diagnosis) -> None:
    vm = psutil.virtual_memory()
    d.add("memory", f"{vm.total / 2**30:.1f} GiB total, {vm.available / 2**30:.1f} GiB available")
    shm = shutil.disk_usage("/dev/shm") if Path("/dev/shm").exists() else None
    if shm is not None:
        d.add("/dev/shm", f"{shm.free / 2**30:.1f} GiB free (expert-process call slots live here)", shm.free > 2**26)


def model_bytes(model_dir: Path, expert_format: str) -> tuple[int, int]:
    """(dense bytes as stored, routed-expert bytes in expert_format)."""
    from hybrid.config import ModelConfig
    from hybrid.experts.pack import expert_bytes_to_read, expert_weight_count

    config = ModelConfig.from_dir(model_dir)
    on_disk = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    dense = max(on_disk - expert_bytes_to_read(config), 0)
    return dense, int(expert_weight_count(config) * BITS_PER_WEIGHT[expert_format] / 8)


def check_model(d: Diagnosis, model_dir: Path, kv_cache_bytes: int) -> None:
    from hybrid.config import ConfigError, ModelConfig
    from hybrid.experts.kernel_experts import default_expert_format

    try:
        config = ModelConfig.from_dir(model_dir)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        d.add("model", str(e), False)
        d.advice.append("point --model at a Hugging Face DeepSeek-V3/R1 or Qwen3-MoE directory (config.json, "
                        "*.safetensors, tokenizer.json)")
        return
    fmt = default_expert_format(config)
    dense, experts = model_bytes(model_dir, fmt)
    need = dense + experts + kv_cache_bytes
    avail = psutil.virtual_memory().available
    fits = need <= avail
    d.add("model", f"{model_dir.name}: {config.model_type}, {config.num_hidden_layers} layers, "
                   f"{config.num_experts} experts (top-{config.num_experts_per_tok})")
    d.add("fits in RAM", f"needs {need / 2**30:.2f} GiB (dense {dense / 2**30:.2f} + experts as {fmt} "
                         f"{experts / 2**30:.2f} + KV {kv_cache_bytes / 2**30:.2f}); {avail / 2**30:.1f} GiB available",
          fits)
    if not fits:
        for smaller in ("int8", "int4"):
            if BITS_PER_WEIGHT[smaller] < BITS_PER_WEIGHT[fmt]:
                _, e2 = model_bytes(model_dir, smaller)
                if dense + e2 + kv_cache_bytes <= avail:
                    d.advice.append(f"pack the experts as {smaller} (--expert-format {smaller}): "
                                    f"{(dense + e2 + kv_cache_bytes) / 2**30:.1f} GiB in all")
                    break
        else:
            d.advice.append("the model does not fit in this machine's RAM even as int4; use a bigger machine "
                            "or a smaller model")


def check_packs(d: Diagnosis, model_dir: Path | None) -> None:
    """Room on the disk of $HYBRIDD_HOME/packs for the model's pack, if it has none yet, and packs no model
    uses."""
    from hybrid.config import ModelConfig
    from hybrid.experts.kernel_experts import default_expert_format
    from hybrid.experts.pack import default_pack_dir, is_current
    from hybrid.experts.pack_inventory import list_packs, packs_root

    root = packs_root()
    existing = next(p for p in (root, *root.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    dead = [e for e in list_packs() if e.removable()]
    if dead:
        d.advice.append(f"{sum(e.nbytes for e in dead) / 1e9:.1f} GB in {len(dead)} stale or incomplete pack(s): "
                        "hybridd packs --prune")
    if model_dir is None or not (model_dir / "config.json").is_file():
        d.add("packs", f"{root}: {free / 1e9:.1f} GB free")
        return
    config = ModelConfig.from_dir(model_dir)
    fmt = default_expert_format(config)
    if is_current(default_pack_dir(model_dir, fmt), config, fmt):
        d.add("packs", f"{root}: this model's experts are packed ({fmt}); {free / 1e9:.1f} GB free")
        return
    need = model_bytes(model_dir, fmt)[1]
    d.add("packs", f"{root}: the first start packs this model's experts as {fmt}, {need / 1e9:.1f} GB; "
                   f"{free / 1e9:.1f} GB free", free >= need)
    if free < need:
        d.advice.append("make room for the pack, or pack it on a larger disk: hybridd pack MODEL --out DIR, then "
                        "start with --expert-pack DIR")


def diagnose(model_dir: Path | None, kv_cache_bytes: int = 1 << 30) -> Diagnosis:
    d = Diagnosis()
    check_cpu(d)
    check_gpus(d)
    check_memory(d)
    if model_dir is not None:
        check_model(d, model_dir, kv_cache_bytes)
    if all(f.ok for f in d.findings if f.topic == "model"):
        check_packs(d, model_dir)
    return d


def render(d: Diagnosis):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title="hybridd doctor", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    t.add_column("")
    for f in d.findings:
        t.add_row(f.topic, f.detail, "[green]ok[/]" if f.ok else "[red]problem[/]")
    advice = d.advice or ["nothing to change"]
    return Group(t, Text("What to change:", style="bold"), *(Text(f"  - {a}") for a in advice))


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def render_plan(p: dict):
    """The planner's inputs and predictions as tables."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    cpu, dev = p["cpu"], p["device"]
    inputs = Table(title="measured now (short probes over the model's shapes)", show_header=False)
    inputs.add_column("", style="bold")
    inputs.add_column("")
    inputs.add_row("CPU read bandwidth", f"{cpu['read_bytes_per_s'] / 1e9:.1f} GB/s")
    per_token = cpu["expert_prefill_s_per_token"]
    inputs.add_row("CPU experts, prefill", f"{per_token * 1e6:.2f} us per token and MoE layer at {p['chunk_tokens']} "
                   f"tokens per step = {1 / (per_token * p['moe_layers']):.0f} tokens/s over {p['moe_layers']} MoE "
                   "layers")
    inputs.add_row("CPU experts, decode", f"{cpu['expert_read_bytes_per_s'] / 1e9:.1f} GB/s read + "
                   f"{cpu['expert_call_s'] * 1e6:.0f} us per call (experts of {p['expert_bytes'] / 1e6:.2f} MB, "
                   f"{p['expert_format']})")
    inputs.add_row("CPU dense / attention kernels", f"{cpu['dense_flops'] / 1e12:.2f} / "
                   f"{cpu['attention_flops'] / 1e12:.2f} TFLOP/s")
    inputs.add_row("engine overhead", f"{cpu['step_overhead_s_per_layer'] * 1e6:.0f} us per layer and decode step")
    if dev is not None:
        inputs.add_row("device", f"{dev['name']} x {dev['devices']}")
        inputs.add_row("host -> device", f"{dev['h2d_bytes_per_s'] / 1e9:.1f} GB/s per device, all copying at once")
        inputs.add_row("device experts", f"{dev['expert_s_per_token'] * 1e6:.2f} us per token and MoE layer "
                       f"(passes of up to {p['pass_tokens']} tokens)")
        inputs.add_row("device matmul / attention", f"{dev['matmul_flops'] / 1e12:.2f} / "
                       f"{dev['attention_flops'] / 1e12:.4f} TFLOP/s")
        inputs.add_row("device memory", f"{dev['memory_bytes_per_s'] / 1e9:.0f} GB/s")
        if dev["devices"] > 1:
            inputs.add_row("SmallEP exchange", f"{dev['exchange_s_per_token'] * 1e6:.3f} us per token and MoE layer")
    ttft = Table(title=f"predicted TTFT ({p['model']}, {p['layers']} layers)")
    cols = ["cpu"] + (["slp"] if dev else []) + (["smallep"] if dev and dev["devices"] > 1 else []) + ["picked"]
    names = {"cpu": "CPU experts", "slp": "SLP (1 device)", "picked": "the engine picks",
             "smallep": f"SmallEP ({dev['devices'] if dev else 0} devices)"}
    ttft.add_column("prompt", justify="right")
    for col in cols:
        ttft.add_column(names[col], justify="right")
    for tokens, row in p["ttft_s"].items():
        mark = " *" if int(tokens) > p["max_position_embeddings"] else ""
        ttft.add_row(f"{int(tokens) // 1024}K{mark}", *(_ms(row.get(col)) for col in cols))
    tpot = Table(title=f"predicted TPOT (roofline of one sequence: {_ms(p['tpot_bound_s'])})")
    tpot.add_column("concurrency", justify="right")
    contexts = list(next(iter(p["tpot_s"].values())))
    for ctx in contexts:
        tpot.add_column(f"context {int(ctx) // 1024}K", justify="right")
    for n, row in p["tpot_s"].items():
        tpot.add_row(n, *(_ms(row[ctx]) for ctx in contexts))
    threshold = p["threshold"]
    notes = [f"streams prefills from {threshold} tokens" if threshold is not None else
             ("the CPU experts are faster at every length: nothing would stream" if dev else
              "CPU only: give --gpus to predict streamed prefill")]
    if any(int(t) > p["max_position_embeddings"] for t in p["ttft_s"]):
        notes.append(f"* past the model's {p['max_position_embeddings']} positions: arithmetic only")
    if dev is not None and dev["interpreted"]:
        notes.append("the device is the CPU running Triton's interpreter: these are NOT GPU predictions")
    return Group(inputs, ttft, tpot, *(Text(f"  - {n}") for n in notes))


def register(sub) -> None:
    from hybrid.cli.engine_args import parse_gpus

    dr = sub.add_parser("doctor", help="CPU features, kernel path, GPUs, memory, whether the model fits, and "
                        "predicted TTFT / TPOT")
    dr.add_argument("--model", help="model directory to check (default: the embedded tiny model)")
    dr.add_argument("--kv-cache-gb", type=float, default=1.0)
    dr.add_argument("--gpus", type=parse_gpus, help="predict for these GPUs (streamed prefill; SmallEP with 2+)")
    dr.add_argument("--attn-device", help="with --gpus: cpu to let the CPU play the GPUs (tests; not a GPU's figures)")
    dr.add_argument("--expert-format", default="auto", choices=EXPERT_FORMATS)
    dr.add_argument("--dense-format", default="auto", choices=DENSE_FORMATS,
                    help="predict for the engine's --dense-format")
    dr.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill tokens per step (CPU path)")
    dr.add_argument("--slp-max-tokens", type=int, help="most tokens of a streamed pass (default: what the device "
                    "holds)")
    dr.add_argument("--no-plan", action="store_true", help="skip the probes and predictions")
    dr.add_argument("--json", action="store_true", help="print the prediction and the checks' findings as JSON "
                    "instead of tables")
    dr.set_defaults(func=cmd_doctor)


def cmd_doctor(a: argparse.Namespace) -> int:
    import json

    from rich.console import Console

    from hybrid.config import ConfigError
    from hybrid.llm import DEFAULT_MODEL_DIR

    model = Path(a.model) if a.model else DEFAULT_MODEL_DIR
    diagnosis = diagnose(model, int(a.kv_cache_gb * 2**30))
    plan = None
    if not a.no_plan and all(f.ok for f in diagnosis.findings if f.topic == "model"):
        from hybrid.planner.plan import measure, summary

        try:
            plan = summary(measure(model, a.gpus, a.attn_device, a.expert_format, a.max_num_batched_tokens,
                                   a.slp_max_tokens, a.dense_format))
        except (ConfigError, ValueError, RuntimeError) as e:
            diagnosis.add("prediction", f"could not probe: {e}", False)
    healthy = all(f.ok for f in diagnosis.findings)
    if a.json:
        print(json.dumps({**(plan or {}), "findings": [asdict(f) for f in diagnosis.findings],
                          "advice": diagnosis.advice}))
        return 0 if healthy else 1
    console = Console()
    console.print(render(diagnosis))
    if plan is not None:
        console.print(render_plan(plan))
    return 0 if healthy else 1
