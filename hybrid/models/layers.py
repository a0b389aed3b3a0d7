"""Building blocks shared by the models: weight-only linear (alone or sharing an input), RMSNorm and the gated
MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialized parameter: every value is overwritten by the loader."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x @ W^T without bias; W is [out_features, in_features] as in the checkpoint. After `use_kernel`,
    the weight lives packed for the CPU kernels instead (cpu_kernels.linear.PackedLinear)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.out_features = out_features
        self.packed = None

    def use_kernel(self, packed) -> None:
        self.packed = packed
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            from cpu_kernels.linear import linear

            return linear(self.packed, x)
        return F.linear(x, self.weight)


class SharedInputLinears:
    """Linears that read the same input (q / k / v, gate / up). Once `use_kernel` gives them one matrix packed
    from their stacked weights, a call streams it in a single kernel pass and returns column slices of the
    result; until then each linear runs on its own. Not a module: the linears stay where the checkpoint
    names them."""

    def __init__(self, *linears: Linear):
        self.linears = linears
        self.packed = None

    def use_kernel(self, packed) -> None:
        self.packed = packed
        for linear in self.linears:
            linear.weight = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.packed is None:
            return tuple(linear(x) for linear in self.linears)
        from cpu_kernels.linear import linear

        return linear(self.packed, x).split([m.out_features for m in self.linears], dim=-1)


def shared_input_groups(model: nn.Module) -> list[SharedInputLinears]:
    """Every SharedInputLinears the modules of `model` hold."""
    return [g for m in model.modules() for g in vars(m).values() if isinstance(g, SharedInputLinears)]


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
