"""Parameters the loader fills: declared with their shape on the meta device (no memory until the checkpoint's
tensor, checked against that shape, takes its place), never trained."""

from __future__ import annotations

import torch
from torch import nn


def empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A parameter with a shape and dtype but no storage: `fill_param` gives it its values."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


def fill_param(owner: nn.Module, name: str, values: torch.Tensor) -> None:
    """Replaces `owner`'s parameter `name` by one holding `values` (a meta parameter's data cannot be set)."""
    setattr(owner, name, nn.Parameter(values, requires_grad=False))
