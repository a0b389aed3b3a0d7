"""The gated MLP of dense layers and shared experts: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.layers.linear import Linear, SharedInputLinears


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, dtype)
        self.up_proj = Linear(hidden, intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)
        self.gate_up = SharedInputLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)
