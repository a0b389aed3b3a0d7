"""x + y between a layer's parts (the residual stream, routed plus shared experts), in torch or the CPU kernels'
add (the same rounding), which a CPU decode program can record (cpu_kernels/program.py)."""

from __future__ import annotations

import torch
from torch import nn


class Add(nn.Module):
    def __init__(self):
        super().__init__()
        self.kernel = False

    def use_kernel(self) -> None:
        self.kernel = True

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.kernel and x.dtype == y.dtype and x.shape == y.shape:
            from cpu_kernels.elementwise import add

            return add(x, y)
        return x + y
