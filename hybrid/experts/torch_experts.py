"""The pure-torch routed experts: the reference every other implementation is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid.checkpoint.reader import CheckpointReader
from hybrid.config import ModelConfig
from hybrid.experts.base import Experts, expert_weight_name
from hybrid.experts.kernel_experts import intermediate_shard


class TorchExperts(Experts):
    """Stacked [E, 2I, H] gate/up and [E, H, I] down weights per layer; loops over the experts that got tokens
    in ascending id order and accumulates in the hidden dtype, as the transformers reference does."""

    def __init__(self, w13: dict[int, torch.Tensor], w2: dict[int, torch.Tensor]):
        self.w13, self.w2 = w13, w2

    @classmethod
    def load(cls, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype, layers: list[int] | None = None,
             features: range | None = None) -> "TorchExperts":
        """The experts of `layers` (default: every MoE layer), only their intermediate `features` if given."""
        h, n = config.hidden_size, config.num_experts
        i = config.moe_intermediate_size if features is None else len(features)
        shard = {proj: None if features is None else intermediate_shard(config, features.start, i, proj)
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        w13, w2 = {}, {}
        for layer in config.moe_layers if layers is None else layers:
            gate_up = torch.empty(n, 2 * i, h, dtype=dtype)
            down = torch.empty(n, h, i, dtype=dtype)
            for e in range(n):
                def weight(proj: str, shape: tuple[int, int]) -> torch.Tensor:
                    return reader.weight(expert_weight_name(layer, e, proj), shape, dtype, shard[proj])

                gate_up[e, :i] = weight("gate_proj", (i, h))
                gate_up[e, i:] = weight("up_proj", (i, h))
                down[e] = weight("down_proj", (h, i))
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
