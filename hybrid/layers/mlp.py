"""The gated MLP of dense layers and shared experts: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.distributed.tensor_parallel import TensorParallel
from hybrid.layers.linear import SharedInputLinears, column_parallel, row_parallel


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): dense layers and shared experts. Tensor-parallel, each rank holds a share of
    the intermediate features and the partial outputs are summed (by the caller when `reduce` is off: shared
    experts are summed together with the routed ones)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, tp: TensorParallel | None = None,
                 reduce: bool = True):
        super().__init__()
        self.tp, self.reduce = tp or TensorParallel(), reduce
        self.gate_proj = column_parallel(hidden, intermediate, dtype, self.tp, what="intermediate features")
        self.up_proj = column_parallel(hidden, intermediate, dtype, self.tp, what="intermediate features")
        self.down_proj = row_parallel(intermediate, hidden, dtype, self.tp, what="intermediate features")
        self.gate_up = SharedInputLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        out = self.down_proj(F.silu(gate) * up)
        return self.tp.all_reduce(out) if self.reduce else out
