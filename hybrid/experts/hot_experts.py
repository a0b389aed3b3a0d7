"""Hot experts on the device: the N most used routed experts of each MoE layer stay in device memory and
run there (torch), the rest run in the expert process; the two partial sums are added.

Which experts are hot comes from a routing-frequency profile: a JSON file ({layer: [count per expert]},
as `save_profile` writes it) or, without one, the counts collected while serving, used once a layer
has routed `warmup_tokens` tokens. Slots of hot experts reach the CPU kernels as id -1 (not computed).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybrid.checkpoint.reader import CheckpointReader
from hybrid.config import ModelConfig
from hybrid.experts.base import Experts, expert_weight_name


@dataclass
class HotLayer:
    ids: list[int]
    local: torch.Tensor  # [E] on the device: index into w13/w2, -1 for experts left to the CPU
    w13: torch.Tensor  # [N, 2I, H] gate then up
    w2: torch.Tensor  # [N, H, I]


class HotExperts(Experts):
    def __init__(self, remote: Experts, reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, num_hot: int, profile: str | Path | None = None, warmup_tokens: int = 256):
        if not 0 < num_hot <= config.num_experts:
            raise ValueError(f"gpu_experts must be in 1..{config.num_experts}, got {num_hot}")
        self.remote, self.reader, self.config = remote, reader, config
        self.dtype, self.device, self.num_hot, self.warmup_tokens = dtype, device, num_hot, warmup_tokens
        self.counts = {layer: torch.zeros(config.num_experts, dtype=torch.long) for layer in config.moe_layers}
        self.layers: dict[int, HotLayer] = {}
        self.device_slots = 0
        if profile is not None:
            self._load_profile(Path(profile))

    def _load_profile(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
            counts = {int(layer): torch.tensor(c, dtype=torch.long) for layer, c in raw.items()}
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a routing profile ({e})") from None
        for layer, c in counts.items():
            if layer not in self.counts or c.shape != self.counts[layer].shape:
                raise ValueError(f"{path}: layer {layer} does not match this model's {self.config.num_experts} "
                                 "experts per MoE layer")
            self.counts[layer] = c
            self._promote(layer)

    def save_profile(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({str(k): v.tolist() for k, v in self.counts.items()}))

    def _promote(self, layer: int) -> None:
        counts = self.counts[layer].tolist()
        ids = sorted(sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:self.num_hot])
        h, i = self.config.hidden_size, self.config.moe_intermediate_size
        w13 = torch.empty(len(ids), 2 * i, h, dtype=self.dtype)
        w2 = torch.empty(len(ids), h, i, dtype=self.dtype)
        for j, e in enumerate(ids):
            w13[j, :i] = self.reader.weight(expert_weight_name(layer, e, "gate_proj"), (i, h), self.dtype)
            w13[j, i:] = self.reader.weight(expert_weight_name(layer, e, "up_proj"), (i, h), self.dtype)
            w2[j] = self.reader.weight(expert_weight_name(layer, e, "down_proj"), (h, i), self.dtype)
        local = torch.full((self.config.num_experts,), -1, dtype=torch.long)
        local[ids] = torch.arange(len(ids))
        self.layers[layer] = HotLayer(ids, local.to(self.device), w13.to(self.device), w2.to(self.device))

    def forward(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        return self.submit(layer, hidden_states, topk_ids, topk_weights)()

    def submit(self, layer: int, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> Callable[[], torch.Tensor]:
        hot = self.layers.get(layer)
        if hot is None:
            self.counts[layer] += torch.bincount(topk_ids.flatten().cpu(), minlength=self.config.num_experts)
            if int(self.counts[layer].sum()) >= self.warmup_tokens * topk_ids.shape[1]:
                self._promote(layer)
            return self.remote.submit(layer, hidden_states, topk_ids, topk_weights)
        local = hot.local[topk_ids]
        on_device = local >= 0
        cold = self.remote.submit(layer, hidden_states, torch.where(on_device, -1, topk_ids), topk_weights)
        out = self._device_moe(hot, hidden_states, local, topk_weights)
        self.device_slots += int(on_device.sum())
        return lambda: cold() + out

    @staticmethod
    def _device_moe(hot: HotLayer, x: torch.Tensor, local: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        inter = hot.w13.shape[1] // 2
        for j in torch.unique(local[local >= 0]).tolist():
            tok, slot = torch.nonzero(local == j, as_tuple=True)
            h = F.linear(x[tok], hot.w13[j])
            y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], hot.w2[j])
            out.index_add_(0, tok, y * weights[tok, slot, None].to(y.dtype))
        return out

    def close(self) -> None:
        self.remote.close()
