"""Weight-only linear layers, alone or sharing an input (q / k / v, gate / up), in torch or the CPU kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.checkpoint.shard import Shard
from hybrid.distributed.tensor_parallel import TensorParallel
from hybrid.layers.parameter import empty_param


class Linear(nn.Module):
    """y = x @ W^T without bias; W is [out_features, in_features] as in the checkpoint. After `use_kernel`,
    the weight lives packed for the CPU kernels instead (cpu_kernels.linear.PackedLinear). A tensor-parallel
    linear holds its `shard` of the checkpoint weight (in / out features are the shard's)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, shard: Shard | None = None):
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype)
        self.out_features = out_features
        self.shard = shard
        self.packed = None

    def use_kernel(self, packed) -> None:
        self.packed = packed
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            from cpu_kernels.linear import linear

            return linear(self.packed, x)
        return F.linear(x, self.weight)


def column_parallel(in_features: int, out_features: int, dtype: torch.dtype, tp: TensorParallel, unit: int = 1,
                    what: str = "output features") -> Linear:
    """This rank's rows of the weight: its share of the outputs, in whole `unit`s (a head's rows)."""
    if tp.size == 1:
        return Linear(in_features, out_features, dtype)
    start, count = tp.split(out_features // unit, what)
    return Linear(in_features, count * unit, dtype, Shard(0, start * unit, count * unit, out_features))


def row_parallel(in_features: int, out_features: int, dtype: torch.dtype, tp: TensorParallel, unit: int = 1,
                 what: str = "input features") -> Linear:
    """This rank's columns of the weight: its share of the inputs (the output is a partial sum to all-reduce)."""
    if tp.size == 1:
        return Linear(in_features, out_features, dtype)
    start, count = tp.split(in_features // unit, what)
    return Linear(count * unit, out_features, dtype, Shard(1, start * unit, count * unit, in_features))


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
