"""The MoE block both architectures share: a router on the device, routed experts through `Experts`, and
optional shared experts on the device that run while the routed ones are computed elsewhere.

The block holds its parts; how a step runs them (in which order, overlapped or captured) is defined once,
in hybrid/models/segments.py.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid.distributed.tensor_parallel import TensorParallel
from hybrid.experts.base import Experts
from hybrid.layers.add import Add


class RoutedMoe(nn.Module):
    """out = routed(x) [+ shared_experts(x)]. `gate(x)` returns (topk ids, topk weights); subclasses set
    `gate` and, where the model has them, `shared_experts` (their checkpoint names). Tensor-parallel, the routed
    and shared outputs are partial sums over each rank's share of the experts' features, summed once in combine."""

    def __init__(self, layer: int, experts: Experts, tp: TensorParallel | None = None):
        super().__init__()
        self.layer, self.experts = layer, experts
        self.tp = tp or TensorParallel()
        self.gate: nn.Module | None = None
        self.shared_experts: nn.Module | None = None
        self.add = Add()

    @property
    def has_device_part(self) -> bool:
        return self.shared_experts is not None

    def device_part(self, x: torch.Tensor) -> torch.Tensor | None:
        """What the device computes for this block besides routing: the shared experts' output, if any."""
        return None if self.shared_experts is None else self.shared_experts(x)

    def combine(self, routed: torch.Tensor, device_out: torch.Tensor | None) -> torch.Tensor:
        return self.tp.all_reduce(routed if device_out is None else self.add(routed, device_out))
