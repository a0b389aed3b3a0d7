"""Routed experts in this process through the C++ fused-MoE kernels, over weights packed in their tile layout."""

from __future__ import annotations

import torch

from hybrid.checkpoint.reader import CheckpointReader
from hybrid.checkpoint.shard import Shard
from hybrid.config import ModelConfig
from hybrid.experts.base import Experts, expert_weight_name


def default_expert_format(config: ModelConfig) -> str:
    return "fp8" if config.fp8_block else "bf16"


def intermediate_shard(config: ModelConfig, start: int, size: int, proj: str) -> Shard:
    """A tensor-parallel rank's features [start, start + size) of an expert's intermediate dimension: rows of
    gate / up, columns of down."""
    return Shard(1 if proj == "down_proj" else 0, start, size, config.moe_intermediate_size)


def pack_layer(reader: CheckpointReader, config: ModelConfig, layer: int, fmt: str | None = None,
               features: range | None = None):
    """One MoE layer's experts in the kernels' layout (only the intermediate `features` given, for a
    tensor-parallel rank). fp8 checkpoint weights packed as fp8 keep their own block scales (no requantization)
    unless a rank's features cut scale blocks; every other combination goes through bf16."""
    from cpu_kernels.moe import pack_experts
    from cpu_kernels.pack import Format

    fmt = Format.parse(fmt or default_expert_format(config))
    h, i = config.hidden_size, config.moe_intermediate_size
    local = i if features is None else len(features)
    mats: dict[str, list] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    scales: dict[str, list] = {k: [] for k in mats}
    for e in range(config.num_experts):
        for proj, shape in (("gate_proj", (local, h)), ("up_proj", (local, h)), ("down_proj", (h, local))):
            name = expert_weight_name(layer, e, proj)
            shard = None if features is None else intermediate_shard(config, features.start, local, proj)
            kept = (reader.fp8_shard(name, shape, shard)
                    if fmt == Format.FP8 and config.fp8_block and reader.is_fp8(name) else None)
            if kept is not None:
                mats[proj].append(kept[0])
                scales[proj].append(kept[1])
            else:
                mats[proj].append(reader.weight(name, shape, torch.bfloat16, shard))
    native = bool(scales["gate_proj"])
    if features is not None and fmt == Format.FP8 and config.fp8_block and \
            any(len(scales[k]) < len(mats[k]) for k in mats):
        return pack_layer(reader, config, layer, "bf16", features)  # shards cut scale blocks: their bf16 values
    return pack_experts(
        mats["gate_proj"], mats["up_proj"], mats["down_proj"], fmt,
        gate_scale=scales["gate_proj"] if native else None, up_scale=scales["up_proj"] if native else None,
        down_scale=scales["down_proj"] if native else None, block=tuple(config.fp8_block) if native else (128, 128),
    )


class KernelExperts(Experts):
    """The C++ fused-MoE kernels over packed weights (cpu_kernels): fp8 checkpoints stay fp8 in RAM unless
    another format is asked for; activations in the model dtype (bf16, or fp32 carried exactly)."""

    recordable = True

    def __init__(self, layers: dict, num_threads: int | None = None):
        self.layers, self.num_threads = layers, num_threads

    @classmethod
    def load(cls, reader: CheckpointReader, config: ModelConfig, fmt: str | None = None,
             num_threads: int | None = None, layers: list[int] | None = None,
             features: range | None = None) -> "KernelExperts":
        """Packs the experts of `layers` (default: every MoE layer), only their intermediate `features` if given."""
        layers = config.moe_layers if layers is None else layers
        return cls({layer: pack_layer(reader, config, layer, fmt, features) for layer in layers}, num_threads)

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        from cpu_kernels.moe import fused_moe

        x = hidden_states if hidden_states.dtype in (torch.bfloat16, torch.float32) else hidden_states.float()
        out = fused_moe(self.layers[layer], x, topk_ids, topk_weights, num_threads=self.num_threads)
        return out.to(hidden_states.dtype)
