"""The routed-experts interface every model calls, and its pure-torch reference implementation.

A model hands one layer's hidden states with top-k ids and weights to an `Experts` object and gets
the weighted sum of expert outputs back. The C++ kernels and the expert process implement the same
interface, so models never change when the experts move.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybrid.config import ModelConfig
from hybrid.loader import CheckpointReader


def expert_weight_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


class Experts(ABC):
    """Routed experts of every MoE layer: out[t] = sum_j w[t, j] * expert_{ids[t, j]}(x[t])."""

    @abstractmethod
    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [T, H] in the model dtype, topk_ids [T, k] int64, topk_weights [T, k] -> [T, H]."""

    def __call__(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        return self.forward(layer, hidden_states, topk_ids, topk_weights)

    def submit(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Starts a call and returns what waits for its result. In-process experts compute here; the expert
        process returns at once, so the caller can run attention of another micro-batch meanwhile."""
        out = self.forward(layer, hidden_states, topk_ids, topk_weights)
        return lambda: out

    def close(self) -> None:
        """Releases what the implementation holds outside this process (nothing for in-process experts)."""


class TorchExperts(Experts):
    """Stacked [E, 2I, H] gate/up and [E, H, I] down weights per layer; loops over the experts that got tokens
    in ascending id order and accumulates in the hidden dtype, as the transformers reference does."""

    def __init__(self, w13: dict[int, torch.Tensor], w2: dict[int, torch.Tensor]):
        self.w13, self.w2 = w13, w2

    @classmethod
    def load(cls, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype) -> "TorchExperts":
        h, i, n = config.hidden_size, config.moe_intermediate_size, config.num_experts
        w13, w2 = {}, {}
        for layer in config.moe_layers:
            gate_up = torch.empty(n, 2 * i, h, dtype=dtype)
            down = torch.empty(n, h, i, dtype=dtype)
            for e in range(n):
                gate_up[e, :i] = reader.weight(expert_weight_name(layer, e, "gate_proj"), (i, h), dtype)
                gate_up[e, i:] = reader.weight(expert_weight_name(layer, e, "up_proj"), (i, h), dtype)
                down[e] = reader.weight(expert_weight_name(layer, e, "down_proj"), (h, i), dtype)
            w13[layer], w2[layer] = gate_up, down
        return cls(w13, w2)

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.w13[layer], self.w2[layer]
        out = torch.zeros_like(hidden_states)
        flat_ids = topk_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
        k = topk_ids.shape[1]
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            idx = order[start:start + count]
            start += count
            token_idx = idx // k
            gate, up = F.linear(hidden_states[token_idx], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
            y = y * topk_weights.reshape(-1)[idx, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def default_expert_format(config: ModelConfig) -> str:
    return "fp8" if config.fp8_block else "bf16"


def pack_layer(reader: CheckpointReader, config: ModelConfig, layer: int, fmt: str | None = None):
    """One MoE layer's experts in the kernels' layout. fp8 checkpoint weights packed as fp8 keep their own
    block scales (no requantization); every other combination goes through bf16."""
    from cpu_kernels.moe import pack_experts
    from cpu_kernels.pack import Format

    fmt = Format.parse(fmt or default_expert_format(config))
    h, i = config.hidden_size, config.moe_intermediate_size
    mats: dict[str, list] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    scales: dict[str, list] = {k: [] for k in mats}
    for e in range(config.num_experts):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            name = expert_weight_name(layer, e, proj)
            if fmt == Format.FP8 and config.fp8_block and reader.is_fp8(name):
                mats[proj].append(reader.get(name))
                scales[proj].append(reader.get(f"{name}_scale_inv"))
            else:
                mats[proj].append(reader.weight(name, shape, torch.bfloat16))
    native = bool(scales["gate_proj"])
    return pack_experts(
        mats["gate_proj"], mats["up_proj"], mats["down_proj"], fmt,
        gate_scale=scales["gate_proj"] if native else None, up_scale=scales["up_proj"] if native else None,
        down_scale=scales["down_proj"] if native else None, block=tuple(config.fp8_block) if native else (128, 128),
    )


class KernelExperts(Experts):
    """The C++ fused-MoE kernels over packed weights (cpu_kernels): fp8 checkpoints stay fp8 in RAM unless
    another format is asked for; activations in the model dtype (bf16, or fp32 carried exactly)."""

    def __init__(self, layers: dict, num_threads: int | None = None):
        self.layers, self.num_threads = layers, num_threads

    @classmethod
    def load(cls, reader: CheckpointReader, config: ModelConfig, fmt: str | None = None,
             num_threads: int | None = None) -> "KernelExperts":
        return cls({layer: pack_layer(reader, config, layer, fmt) for layer in config.moe_layers}, num_threads)

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        from cpu_kernels.moe import fused_moe

        x = hidden_states if hidden_states.dtype in (torch.bfloat16, torch.float32) else hidden_states.float()
        out = fused_moe(self.layers[layer], x, topk_ids, topk_weights, num_threads=self.num_threads)
        return out.to(hidden_states.dtype)


def load_experts(backend: str, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype,
                 expert_format: str = "auto", num_threads: int | None = None, pack_dir=None) -> Experts:
    """The in-process experts for `backend`: 'cpu' kernels (from a mapped pack when `pack_dir` is given,
    else packed in RAM now) or the 'torch' reference."""
    fmt = None if expert_format == "auto" else expert_format
    if backend == "torch":
        return TorchExperts.load(reader, config, dtype)
    if pack_dir is not None:
        from hybrid.expert_pack import load_pack

        return KernelExperts(load_pack(pack_dir, config, fmt), num_threads)
    return KernelExperts.load(reader, config, fmt, num_threads)
