"""Builds the `Experts` an engine config asks for: the torch reference, the kernels in this process (packed now
or mapped from a pack), or the expert process; optionally with the hottest experts kept on the device."""

from __future__ import annotations

import torch

from hybrid.checkpoint.reader import CheckpointReader
from hybrid.config import EngineConfig, ModelConfig
from hybrid.distributed.tensor_parallel import ModelShard
from hybrid.experts.base import Experts
from hybrid.experts.kernel_experts import KernelExperts
from hybrid.experts.torch_experts import TorchExperts
from hybrid.triton_env import prepare_triton


def load_experts(backend: str, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype,
                 expert_format: str = "auto", num_threads: int | None = None, pack_dir=None,
                 shard: ModelShard | None = None) -> Experts:
    """The in-process experts for `backend`: 'cpu' kernels (from a mapped pack when `pack_dir` is given,
    else packed in RAM now) or the 'torch' reference. A rank of a parallel run packs its own part in RAM: its
    stage's layers and its tensor-parallel share of every expert's intermediate features, in memory of the NUMA
    node it runs on (first touch by its own threads)."""
    fmt = None if expert_format == "auto" else expert_format
    layers = features = None
    if shard is not None and (shard.layers is not None or shard.tp.size > 1):
        layers = [i for i in config.moe_layers if shard.has_layer(i)]
        if shard.tp.size > 1:
            start, count = shard.tp.split(config.moe_intermediate_size, "expert intermediate features")
            features = range(start, start + count)
    if backend == "torch":
        return TorchExperts.load(reader, config, dtype, layers, features)
    if pack_dir is not None:
        from hybrid.experts.pack import load_pack

        return KernelExperts(load_pack(pack_dir, config, fmt), num_threads)
    return KernelExperts.load(reader, config, fmt, num_threads, layers, features)


def build_experts(engine: EngineConfig, model: ModelConfig, reader: CheckpointReader, dtype: torch.dtype,
                  device: torch.device, given: Experts | None = None, shard: ModelShard | None = None) -> Experts:
    """The engine's experts: `given`, else in the expert process or in this process; behind hot experts on
    the device when asked."""
    if given is not None:
        experts = given
    elif engine.experts == "process":
        from hybrid.experts.process.process_experts import process_experts

        fmt = None if engine.expert_format == "auto" else engine.expert_format
        experts = process_experts(model.model_dir, engine.max_num_batched_tokens, model.num_experts_per_tok,
                                  control=engine.expert_server, pack_dir=engine.expert_pack, fmt=fmt,
                                  threads=engine.num_threads, timeout_s=engine.expert_timeout_s)
    else:
        experts = load_experts(engine.backend, reader, model, dtype, engine.expert_format, engine.num_threads,
                               engine.expert_pack, shard)
    if engine.gpu_experts:
        from hybrid.experts.hot_experts import HotExperts

        experts = HotExperts(experts, reader, model, dtype, device, engine.gpu_experts, engine.expert_profile)
    if engine.streams_prefill and given is None:
        prepare_triton(device)
        from hybrid.experts.streamed_experts import streamed_experts

        experts = streamed_experts(engine, model, experts, dtype, device)
    return experts
