"""The engine flags `generate` and `start` share, and their translation into EngineConfig fields."""

from __future__ import annotations

import argparse
import math
import os
import sys

from hybrid.config import ConfigError
from hybrid.config.engine_config import DENSE_FORMATS, EXPERT_FORMATS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model directory (default: the embedded tiny model)")
    p.add_argument("--dtype", default="auto", help="compute dtype: auto (checkpoint's), bfloat16, float32")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's, within the KV pool)")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="prefill chunk / step token budget")
    p.add_argument("--num-kv-blocks", type=int, help="KV pool size in blocks (default: from --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=gib, default=1.0, help="the most memory the KV pool may take, in GiB "
                   "(default 1): it holds what four sequences of --max-model-len need (at most --max-num-seqs), "
                   "within this")
    p.add_argument("--threads", type=int, help="compute threads (default: every allowed core)")
    p.add_argument("--backend", choices=["cpu", "torch"],
                   help="cpu (default): C++ AVX-512 kernels for experts and dense layers; torch: the pure-torch "
                   "reference; with --gpus the device runs torch and Triton")
    p.add_argument("--expert-format", default="auto", choices=EXPERT_FORMATS,
                   help="routed-expert weights in RAM (auto: the checkpoint's, fp8 stays fp8)")
    p.add_argument("--dense-format", default="auto", choices=DENSE_FORMATS,
                   help="dense linear weights with the cpu backend (auto: the checkpoint's)")
    p.add_argument("--expert-pack", help="map the experts from this `hybridd pack` directory instead of packing")
    p.add_argument("--experts", choices=["inline", "process"],
                   help="run the routed experts in this process (generate's default) or in the expert process "
                   "(start's default, and always with --gpus)")
    p.add_argument("--expert-server", help="control address of a running expert process (with --experts process)")
    p.add_argument("--attn-device", help="with --gpus: the device that plays GPU 0's role (cpu: the hybrid path "
                   "on the CPU, Triton attention under TRITON_INTERPRET=1)")
    p.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                   help="with --gpus: dual-batch attention/MoE overlap in decode; auto splits a step where the "
                   "engine's measured steps say it pays (default)")
    p.add_argument("--no-overlap", dest="overlap", action="store_const", const="off", help="--overlap off")
    p.add_argument("--enforce-eager", action="store_true", help="run decode eagerly instead of replaying "
                   "captured CUDA graphs (--gpus) or recorded kernel programs (CPU-only)")
    p.add_argument("--gpu-experts", type=int, default=0, help="with --gpus: keep the N most used experts of each "
                   "layer on the GPU (from --expert-profile, else from routing counts collected while serving)")
    p.add_argument("--expert-profile", help="routing-frequency profile JSON {layer: [count per expert]}")
    p.add_argument("--slp-threshold", default="auto", help="with --gpus: prefills of at least N tokens stream their "
                   "experts to the GPU (SLP); auto (default) picks from measured bandwidth and expert throughput; off "
                   "never streams")
    p.add_argument("--slp-max-tokens", type=int, help="with --gpus: the most tokens of one streamed pass (default: "
                   "what the device memory holds); longer prompts stream in pieces of this size")
    p.add_argument("--slp-copy", default="auto", choices=["auto", "register", "bounce"],
                   help="with --gpus: stream from the expert pack registered with CUDA (register) or through pinned "
                   "bounce buffers (bounce); auto registers and falls back")
    p.add_argument("--tp", type=int, default=1, help="CPU-only: tensor-parallel ranks, one per NUMA node (or per "
                   "group of cores in HYBRIDD_NUMA_NODES), summing over shared memory")
    p.add_argument("--pp", type=int, default=1, help="CPU-only: pipeline stages (machines, under torchrun), layers "
                   "split evenly")
    p.add_argument("--all-reduce", default="auto", choices=["auto", "shm", "gloo"],
                   help="with --tp: how ranks sum (auto: shared memory on one machine, gloo across machines)")
    p.add_argument("--grammar-masks", default="process", choices=["process", "inline"],
                   help="where constrained requests' token masks are computed: in a mask process while the model runs "
                   "(default), or on the engine thread between steps")
    p.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt whole instead of reusing "
                   "the KV blocks of a prefix computed before (a chat's history)")


def gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 2**40:
        raise argparse.ArgumentTypeError(f"wants a positive number of GiB, got {text!r}")
    return value


def parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus wants comma-separated device indices, got {text!r}") from None
    if not gpus:
        raise argparse.ArgumentTypeError("--gpus needs at least one device index")
    return gpus


def engine_kwargs(a: argparse.Namespace) -> dict:
    """EngineConfig's fields from the flags; refuses --backend cpu / --experts inline with --gpus, whose path
    runs the device part in torch and the experts in the expert process (they were overridden silently)."""
    gpus = getattr(a, "gpus", None)
    if gpus and a.backend == "cpu":
        raise ConfigError("--gpus runs the device's part in torch and Triton: leave --backend cpu out")
    if gpus and a.experts == "inline":
        raise ConfigError("--gpus runs the routed experts in the expert process: leave --experts inline out")
    return dict(dtype=a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens, num_kv_blocks=a.num_kv_blocks,
                kv_cache_bytes=int(a.kv_cache_gb * 2**30), backend=a.backend or "cpu",
                expert_format=a.expert_format, dense_format=a.dense_format, num_threads=a.threads,
                expert_pack=a.expert_pack, experts=a.experts or "inline", expert_server=a.expert_server,
                gpus=gpus, attn_device=a.attn_device,
                overlap=a.overlap, enforce_eager=a.enforce_eager, gpu_experts=a.gpu_experts,
                expert_profile=a.expert_profile, enable_prefix_caching=not a.no_prefix_cache, tp=a.tp, pp=a.pp,
                all_reduce=a.all_reduce, slp_threshold=a.slp_threshold, slp_max_tokens=a.slp_max_tokens,
                slp_copy=a.slp_copy, grammar_masks=a.grammar_masks)


def follow_if_not_rank0(a: argparse.Namespace, model) -> bool:
    """Under torchrun, a rank other than the driving one (rank 0) runs the driver's steps here until it stops,
    instead of the command; True when it did."""
    from hybrid.distributed.torchrun import under_torchrun

    if not under_torchrun() or int(os.environ["RANK"]) == 0:
        return False
    from hybrid.config import EngineConfig
    from hybrid.engine.follower import follow

    follow(EngineConfig(model=model, **engine_kwargs(a)))
    return True


def explain_gpus(gpus: list[int] | None, slp_threshold: str) -> None:
    if not gpus or len(gpus) == 1:
        return
    rest = ",".join(map(str, gpus[1:]))
    if str(slp_threshold).lower() == "off":
        print(f"hybridd: GPU(s) {rest} stay idle: further GPUs stream and compute a share of the experts of long "
              "prefills (SmallEP), which --slp-threshold off turns off", file=sys.stderr)
        return
    print(f"hybridd: GPU {gpus[0]} runs attention, the KV cache and the dense layers; in streamed prefills GPU "
          f"{gpus[0]} and GPU(s) {rest} each stream and compute 1/{len(gpus)} of every layer's experts (SmallEP)",
          file=sys.stderr)
