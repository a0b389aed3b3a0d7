"""RMSNorm, in torch or the CPU kernels' one-pass version."""

from __future__ import annotations

import torch
from torch import nn

from hybrid.layers.parameter import empty_param


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and scaled in the input dtype, exactly as the reference models do."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(dim, dtype=dtype)
        self.eps = eps
        self.kernel = False

    def use_kernel(self) -> None:
        """Normalize with the CPU kernels' one-pass RMSNorm: the same formula, its fp32 sum of squares taken in
        another order."""
        self.kernel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            from cpu_kernels.norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
