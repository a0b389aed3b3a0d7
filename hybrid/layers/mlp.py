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
        self.kernel = False

    def use_kernel(self) -> None:
        """silu(gate) * up through the CPU kernels (cpu_kernels.elementwise.silu_mul)."""
        self.kernel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        if self.kernel:
            from cpu_kernels.elementwise import silu_mul

            act = silu_mul(gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])).view(gate.shape)
        else:
            act = F.silu(gate) * up
        out = self.down_proj(act)
        return self.tp.all_reduce(out) if self.reduce else out
